"""A swarm snapshot from its DHT records: every stage's peers (throughput, queue, step), the bottleneck
stage, trainers (loss, samples/s) and whole-model replicas; plain data for `swarmtrain status` (table or
JSON) and anything that renders the swarm. `monitor_snapshot` adds what `swarmtrain monitor` shows
beside it: servers' counters, moves in progress, lost and retried work.

`records` is a `net.dht_records.RunRecords` (or anything with the same read methods), so the snapshot
is built from exactly what peers announce, and tested on fakes.
"""

from __future__ import annotations

import time

from swarmtrain.config import RunConfig
from swarmtrain.planner.lease_plan import live_leases, observed_samples_per_s, swarm_plan

# what servers publish in their metrics record (runtime/server/server_metrics.py) that the monitor shows
SERVER_KEYS = ("stage", "step", "resyncs", "lost_samples", "duplicates", "recomputed", "late", "moved")
# trainer counters beyond `swarm_snapshot`'s, shown when a trainer publishes them (None otherwise)
TRAINER_EXTRA_KEYS = ("retries", "timeouts")


def swarm_snapshot(cfg: RunConfig, records) -> dict:
    return _snapshot(cfg, records, records.metrics())


def _snapshot(cfg: RunConfig, records, metrics: dict[str, dict]) -> dict:
    digest = cfg.digest()
    announced = {i: records.stage_peers(i) for i in range(cfg.swarm.num_stages)}
    stages = [_stage(i, announced[i], records.stage_progress(i), digest) for i in announced]
    return {
        "run_id": cfg.swarm.run_id,
        "digest": digest,
        "stages": stages,
        "bottleneck": min(range(len(stages)), key=lambda i: stages[i]["throughput_samples_per_s"]),
        "rebalance": _rebalance(cfg, announced, records.moves()),
        "trainers": _trainers(metrics),
        "replicas": _replicas(records.replicas(digest)),
        "time": time.time(),
    }


def monitor_snapshot(cfg: RunConfig, records) -> dict:
    """`swarm_snapshot` plus what the monitor shows beside it: trainers' retries, servers' counters,
    rebalancing moves in progress, and the swarm's lost and retried work summed (`work`)."""
    metrics = records.metrics()  # read once: the DHT read is the slow part of a snapshot
    snapshot = _snapshot(cfg, records, metrics)
    for trainer in snapshot["trainers"]:
        published = metrics.get(f"trainer-{trainer['trainer_id']}", {})
        trainer.update({key: published.get(key) for key in TRAINER_EXTRA_KEYS})
    servers = [
        {"peer_id": peer_id, **{key: value.get(key) for key in SERVER_KEYS}}
        for peer_id, value in sorted(metrics.items())
        if value.get("role") == "server"
    ]
    moves = [
        {
            "peer_id": peer_id,
            **{key: value.get(key) for key in ("from", "to", "state", "time")},
        }
        for peer_id, value in sorted(records.moves().items())
        # committed ones: a proposal lives a second and may be withdrawn; a released lease's mover serves
        if value.get("state") == "moving"
    ]
    snapshot.update(servers=servers, moves=moves, work=work_totals(snapshot["trainers"], servers))
    snapshot["source"] = "dht"
    return snapshot


def work_totals(trainers: list[dict], servers: list[dict]) -> dict:
    """Lost and retried work over the swarm; a total is None when no peer reports its counter (an
    older peer, or none of that role yet), so the page never shows an invented 0."""
    return {
        "microbatches_completed": _total(t.get("completed") for t in trainers),
        "microbatches_failed": _total(t.get("failed") for t in trainers),
        "retries": _total(t.get("retries") for t in trainers),
        "samples_lost": _total(s.get("lost_samples") for s in servers),
        "state_downloads": _total(s.get("resyncs") for s in servers),
        "duplicates": _total(s.get("duplicates") for s in servers),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _total(values) -> int | float | None:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(numbers) if numbers else None


def _rebalance(cfg: RunConfig, announced: dict[int, dict], moves: dict[str, dict]) -> dict:
    """The balancer's settings in the run file (a server's --rebalance-period-s overrides its period) and
    the plan every server computes on these records now (planner/lease_plan.swarm_plan)."""
    swarm = cfg.swarm
    plan = swarm_plan(announced, live_leases(moves), swarm.num_stages, cfg.digest(), swarm.rebalance_margin)
    return {
        "period_s": swarm.rebalance_period_s,
        "margin": swarm.rebalance_margin,
        "observed_samples_per_s": _rounded(observed_samples_per_s(announced, cfg.digest())),
        "plan": [
            {
                "peer_id": move.peer,
                "from": move.from_stage,
                "to": move.to_stage,
                "expected_samples_per_s": round(move.rate_samples_per_s, 2),
            }
            for move in plan
        ],
    }


def _stage(index: int, announced: dict, progress: dict, digest: str) -> dict:
    peers = []
    for peer_id, announcement in sorted(announced.items()):
        peers.append(
            {
                "peer_id": peer_id,
                "throughput_samples_per_s": announcement.throughput_samples_per_s,
                "limit": announcement.limit,
                "queue": announcement.queue_len,
                "epoch": progress.get(peer_id, {}).get("epoch", announcement.state_version),
                "state": announcement.state,
                "same_config": announcement.config_digest == digest,
                "addresses": announcement.addresses,
            }
        )
    # only peers of this run's config serve its trainers
    serving = [p for p in peers if p["same_config"] and p["state"] == "online"]
    return {
        "index": index,
        "peers": peers,
        "throughput_samples_per_s": sum(p["throughput_samples_per_s"] for p in serving),
    }


def _trainers(metrics: dict[str, dict]) -> list[dict]:
    trainers = []
    for peer_id, value in sorted(metrics.items()):
        if value.get("role") == "trainer":
            trainers.append(
                {
                    "trainer_id": peer_id.removeprefix("trainer-"),
                    "loss": value.get("loss"),
                    "samples_per_s": value.get("samples_per_s"),
                    "samples": value.get("samples"),
                    "completed": value.get("completed"),
                    "failed": value.get("failed"),
                }
            )
    return trainers


def _replicas(replicas: dict[str, dict]) -> list[dict]:
    keys = ("outer_step", "inner_step", "samples_per_s", "loss")
    return [
        {"peer_id": peer_id, **{k: value.get(k) for k in keys}} for peer_id, value in sorted(replicas.items())
    ]


def format_snapshot(snapshot: dict) -> str:
    """A terminal table: one line per peer, stages first, then trainers and replicas."""
    lines = [f"run {snapshot['run_id']} (config {snapshot['digest']})"]
    for stage in snapshot["stages"]:
        mark = "  <- bottleneck" if stage["index"] == snapshot["bottleneck"] else ""
        lines.append(
            f"stage {stage['index']}: {len(stage['peers'])} peer(s), "
            f"{stage['throughput_samples_per_s']:.1f} samples/s{mark}"
        )
        for p in stage["peers"]:
            note = "" if p["same_config"] else "  (other config: not used)"
            lines.append(
                f"  {p['peer_id'][-12:]}  {p['throughput_samples_per_s']:8.1f} samples/s ({p['limit']})  "
                f"queue {p['queue']:3d}  step {p['epoch']}  {p['state']}{note}"
            )
    lines.append(format_plan(snapshot["rebalance"]))
    for t in snapshot["trainers"]:
        loss = "-" if t["loss"] is None else f"{t['loss']:.4f}"
        lines.append(
            f"trainer {t['trainer_id']}: loss {loss}, {t['samples_per_s'] or 0:.1f} samples/s, {t['samples']} samples"
        )
    for r in snapshot["replicas"]:
        lines.append(
            f"replica {r['peer_id'][-12:]}: outer step {r['outer_step']}, local step {r['inner_step']}, "
            f"{r['samples_per_s'] or 0:.1f} samples/s"
        )
    if not any(s["peers"] for s in snapshot["stages"]) and not snapshot["replicas"]:
        lines.append("no peer of this run is announced (check --initial-peers and --preset/--config)")
    return "\n".join(lines)


def format_plan(rebalance: dict) -> str:
    """One line: the balancer's plan now, or why there is none."""
    if rebalance["period_s"] <= 0:
        return "rebalancing: off (period 0)"
    moves = ", ".join(f"{m['peer_id'][-8:]} {m['from']}->{m['to']}" for m in rebalance["plan"])
    observed = rebalance.get("observed_samples_per_s")  # an older snapshot has none
    running = "" if observed is None else f" (the swarm runs at {observed:g} samples/s)"
    return f"rebalancing every {rebalance['period_s']:g} s{running}: the plan is {moves or 'no move'}"
