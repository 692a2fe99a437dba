"""What happened between two snapshots: peers joining, leaving or moving between stages, state downloads,
restores, trainers coming and going, lost and retried work.

A pure function on plain snapshot data (`monitor_snapshot`'s shape, or a simulator timeline frame), so
the monitor derives the same events from a live DHT and from a replayed simulation, and tests feed it
fake snapshots. Peers are matched by peer id: a peer that leaves one stage and appears at another in
the same diff moved; a rebalancing lease (`moves`) names a move before it is visible in the stages.
"""

from __future__ import annotations

# event kinds, also the label values of the monitor's Prometheus event counter
KINDS = (
    "start",
    "join",
    "leave",
    "move",
    "state_download",
    "restore",
    "trainer_join",
    "trainer_leave",
    "lost_work",
)

# aggregate work counters that become events when they grow: key -> (kind, what one unit is). Retries
# are no events: a busy swarm retries every few seconds and would bury the rest (the page charts them).
WORK_EVENTS = {
    "microbatches_failed": ("lost_work", "micro-batch(es) failed for good (trainers)"),
    "samples_lost": (
        "lost_work",
        "sample(s) of unapplied gradients lost (a dead, moved or resynced replica)",
    ),
}


def diff_snapshots(prev: dict | None, cur: dict) -> list[dict]:
    """Events between consecutive snapshots `prev` and `cur`, in a stable order. With no `prev` (the
    first snapshot) a single `start` event says what was found: nobody joined at that moment."""
    now = cur.get("time")
    if prev is None:
        return [_event(now, "start", None, None, _start_text(cur))]
    events = _peer_events(prev, cur, now)
    events += _trainer_events(prev, cur, now)
    events += _work_events(prev, cur, now)
    return events


def _event(time_s, kind: str, peer_id: str | None, stage: int | None, text: str) -> dict:
    return {"time": time_s, "kind": kind, "peer_id": peer_id, "stage": stage, "text": text}


def short_id(peer_id: str | None) -> str:
    """The tail of a peer id: base58 ids share long prefixes, their ends tell peers apart."""
    return "-" if peer_id is None else peer_id[-12:]


def _start_text(snapshot: dict) -> str:
    peers = sum(len(s["peers"]) for s in snapshot.get("stages", []))
    return (
        f"monitoring {snapshot.get('run_id')}: {peers} peer(s) in {len(snapshot.get('stages', []))} stage(s), "
        f"{len(snapshot.get('trainers', []))} trainer(s)"
    )


def _placements(snapshot: dict) -> dict[str, dict[int, dict]]:
    """peer id -> {stage index: its peer entry}; a moving peer may be announced at two stages at once."""
    out: dict[str, dict[int, dict]] = {}
    for stage in snapshot.get("stages", []):
        for peer in stage["peers"]:
            out.setdefault(peer["peer_id"], {})[stage["index"]] = peer
    return out


def _leases(snapshot: dict) -> dict[str, tuple]:
    return {m["peer_id"]: (m.get("from"), m.get("to")) for m in snapshot.get("moves") or []}


def _peer_events(prev: dict, cur: dict, now) -> list[dict]:
    before, after = _placements(prev), _placements(cur)
    old_leases, new_leases = _leases(prev), _leases(cur)
    events = []
    for peer_id, (source, target) in sorted(new_leases.items()):
        if old_leases.get(peer_id) != (source, target):
            text = f"{short_id(peer_id)} decided to move from stage {source} to stage {target} (rebalancing)"
            events.append(_event(now, "move", peer_id, target, text))
    for peer_id in sorted(before.keys() | after.keys()):
        lease = new_leases.get(peer_id) or old_leases.get(peer_id)
        events += _membership(peer_id, before.get(peer_id, {}), after.get(peer_id, {}), lease, now)
        for stage in sorted(before.get(peer_id, {}).keys() & after.get(peer_id, {}).keys()):
            events += _same_stage(peer_id, stage, before[peer_id][stage], after[peer_id][stage], now)
    events += _server_events(prev, cur, now)
    return events


def _membership(peer_id: str, old: dict, new: dict, lease: tuple | None, now) -> list[dict]:
    added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    name = short_id(peer_id)
    if added and removed:
        text = f"{name} moved from stage {removed[0]} to stage {added[0]}"
        return [_event(now, "move", peer_id, added[0], text)]
    events = []
    for stage in added:
        if lease is not None and lease[1] == stage:
            continue  # its lease was reported: this is the move becoming visible
        also = " (still announced at another stage)" if old else ""
        text = f"{name} joined stage {stage} ({new[stage].get('state', 'online')}){also}"
        events.append(_event(now, "join", peer_id, stage, text))
    for stage in removed:
        if lease is not None and lease[0] == stage:
            text = f"{name} left stage {stage} to move to stage {lease[1]}"
            events.append(_event(now, "move", peer_id, stage, text))
        else:
            events.append(_event(now, "leave", peer_id, stage, f"{name} left stage {stage}"))
    return events


def _same_stage(peer_id: str, stage: int, old: dict, new: dict, now) -> list[dict]:
    name, old_epoch, new_epoch = short_id(peer_id), old.get("epoch"), new.get("epoch")
    if isinstance(old_epoch, int) and isinstance(new_epoch, int) and new_epoch < old_epoch:
        text = f"{name} at stage {stage} went back from step {old_epoch} to {new_epoch} (restored state)"
        return [_event(now, "restore", peer_id, stage, text)]
    if old.get("state") == "joining" and new.get("state") == "online" and new_epoch:
        text = f"{name} serves stage {stage} from step {new_epoch} (state downloaded or restored)"
        return [_event(now, "state_download", peer_id, stage, text)]
    return []


def _server_events(prev: dict, cur: dict, now) -> list[dict]:
    """Servers' own counters: a resync (stage state downloaded after falling behind), a finished move."""
    old = {s["peer_id"]: s for s in prev.get("servers") or []}
    events = []
    for server in cur.get("servers") or []:
        before = old.get(server["peer_id"])
        if before is None:
            continue  # a new record: its counters are history, not news
        name, stage = short_id(server["peer_id"]), server.get("stage")
        if _grew(before.get("resyncs"), server.get("resyncs")):
            text = f"{name} downloaded stage {stage}'s state from its peers (resync), now at step {server.get('step')}"
            events.append(_event(now, "state_download", server["peer_id"], stage, text))
        moved = server.get("moved")
        if isinstance(moved, dict) and before.get("moved") != moved:
            text = (
                f"{name} finished moving from stage {moved.get('from')} to stage {moved.get('to')} in "
                f"{moved.get('seconds')} s ({_megabytes(moved.get('bytes'))} of state downloaded)"
            )
            events.append(_event(now, "move", server["peer_id"], moved.get("to"), text))
    return events


def _trainer_events(prev: dict, cur: dict, now) -> list[dict]:
    old = {t["trainer_id"] for t in prev.get("trainers", [])}
    new = {t["trainer_id"] for t in cur.get("trainers", [])}
    events = [_event(now, "trainer_join", t, None, f"trainer {t} started") for t in sorted(new - old)]
    events += [_event(now, "trainer_leave", t, None, f"trainer {t} stopped") for t in sorted(old - new)]
    return events


def _work_events(prev: dict, cur: dict, now) -> list[dict]:
    old, new = prev.get("work") or {}, cur.get("work") or {}
    events = []
    for key, (kind, what) in WORK_EVENTS.items():
        if _grew(old.get(key), new.get(key)):
            events.append(_event(now, kind, None, None, f"{_count(new[key] - old[key])} {what}"))
    return events


def _grew(old, new) -> bool:
    return isinstance(old, (int, float)) and isinstance(new, (int, float)) and new > old


def _count(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _megabytes(num_bytes) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if isinstance(num_bytes, (int, float)) else "? MB"
