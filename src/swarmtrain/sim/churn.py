"""Churn: which peers join, leave gracefully or fail, and when. Seeded models and CSV trace files.

A churn schedule is a time-ordered list of (time_s, peer index, event) plus the peers that start
offline. Every mode of one comparison gets the *same* schedule. In a trace file a peer whose first
event is `join` starts offline; every other peer starts live.

Models (all parameters are the defaults of the functions below):
- `none`: nobody comes or goes.
- `preemptible`: spot instances. Each lives an exponential lifetime (mean 6 h) and fails; in addition,
  batch reclaims arrive as a Poisson process (mean every 20 min) and take 30-100% of the live peers of
  one pool (same device type and location, picked in proportion to its live size) at once. A reclaimed
  instance is replaced by a new one of the same kind that joins 2 min + an exponential (mean 8 min) later.
- `exponential`: each peer alternates exponential up times (mean 1 h, ending in a failure) and down
  times (mean 10 min).
- `diurnal`: volunteers. The wanted fraction online follows the local hour,
  `0.5 + 0.4 cos(2 pi (hour - 20) / 24)` (peak at 20:00); a location's UTC offset is spread evenly over
  the day by its index; sessions last an exponential 2 h and end in a graceful leave; an offline peer
  returns after an exponential with mean `2 h * (1 - p) / p` at its current local p.
- `regional-outage`: a Poisson process of outages (mean every 30 min) each takes down one location
  (picked in proportion to its live peers) for 1 min + an exponential (mean 10 min); all its live peers
  fail at once and rejoin when it ends.
"""

from __future__ import annotations

import csv
import heapq
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swarmtrain.config.errors import UserError
from swarmtrain.sim.entities import Fleet
from swarmtrain.utils.rng import make_rng

EVENTS = ("join", "leave", "fail")
HEADER = ("time_s", "peer", "event")
CHURN_MODELS = ("none", "preemptible", "exponential", "diurnal", "regional-outage")


class TraceError(UserError):
    """A churn trace file that cannot be used; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class ChurnEvent:
    time_s: float
    peer: int
    event: str


@dataclass(frozen=True)
class ChurnSchedule:
    events: tuple[ChurnEvent, ...]
    initially_offline: frozenset[int] = frozenset()

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(EVENTS, 0)
        for e in self.events:
            out[e.event] += 1
        return out


class _Builder:
    """Emits consistent events (a peer fails only while live, joins only while offline) in time order."""

    def __init__(self, num_peers: int, duration_s: float, offline: set[int] | None = None) -> None:
        self.duration_s = duration_s
        self.live = np.ones(num_peers, dtype=bool)
        self.initially_offline = frozenset(offline or ())
        for p in self.initially_offline:
            self.live[p] = False
        self.generation = np.zeros(num_peers, dtype=np.int64)
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.events: list[ChurnEvent] = []

    def push(self, time_s: float, kind: str, peer: int = -1) -> None:
        if time_s <= self.duration_s:
            gen = int(self.generation[peer]) if peer >= 0 else 0
            heapq.heappush(self.heap, (time_s, self.seq, kind, peer, gen))
            self.seq += 1

    def pop(self):
        """Next (time, kind, peer) whose peer generation is still current."""
        while self.heap:
            time_s, _, kind, peer, gen = heapq.heappop(self.heap)
            if peer < 0 or gen == self.generation[peer]:
                return time_s, kind, peer
        return None

    def emit(self, time_s: float, peer: int, event: str) -> None:
        self.live[peer] = event == "join"
        self.generation[peer] += 1  # invalidates that peer's pending model events
        self.events.append(ChurnEvent(time_s, peer, event))

    def schedule(self) -> ChurnSchedule:
        return ChurnSchedule(tuple(self.events), self.initially_offline)


def _pools(fleet: Fleet, key) -> list[list[int]]:
    groups: dict = {}
    for i, peer in enumerate(fleet.peers):
        groups.setdefault(key(peer), []).append(i)
    return list(groups.values())


def _pick_pool(rng: np.random.Generator, pools: list[list[int]], live: np.ndarray) -> list[int]:
    weights = np.array([live[pool].sum() for pool in pools], dtype=float)
    if weights.sum() == 0:
        return []
    chosen = pools[int(rng.choice(len(pools), p=weights / weights.sum()))]
    return [p for p in chosen if live[p]]


def preemptible(
    fleet: Fleet,
    duration_s: float,
    seed: int,
    mean_lifetime_s: float = 6 * 3600.0,
    mean_batch_interval_s: float = 1200.0,
    batch_fraction: tuple[float, float] = (0.3, 1.0),
    restart_min_s: float = 120.0,
    restart_mean_s: float = 480.0,
) -> ChurnSchedule:
    rng = make_rng(seed, "churn", "preemptible")
    b = _Builder(fleet.num_peers, duration_s)
    for p in range(fleet.num_peers):
        b.push(rng.exponential(mean_lifetime_s), "fail", p)
    b.push(rng.exponential(mean_batch_interval_s), "batch")
    pools = _pools(fleet, lambda peer: (peer.device, peer.location))
    while (item := b.pop()) is not None:
        time_s, kind, peer = item
        if kind == "batch":
            live = _pick_pool(rng, pools, b.live)
            take = math.ceil(rng.uniform(*batch_fraction) * len(live))
            victims = sorted(rng.choice(live, size=take, replace=False).tolist()) if take else []
            b.push(time_s + rng.exponential(mean_batch_interval_s), "batch")
        else:
            victims = [peer]
        for v in victims:
            if kind == "join":
                b.emit(time_s, v, "join")
                b.push(time_s + rng.exponential(mean_lifetime_s), "fail", v)
            else:
                b.emit(time_s, v, "fail")
                b.push(time_s + restart_min_s + rng.exponential(restart_mean_s), "join", v)
    return b.schedule()


def exponential(
    fleet: Fleet, duration_s: float, seed: int, mean_uptime_s: float = 3600.0, mean_downtime_s: float = 600.0
) -> ChurnSchedule:
    rng = make_rng(seed, "churn", "exponential")
    b = _Builder(fleet.num_peers, duration_s)
    for p in range(fleet.num_peers):
        b.push(rng.exponential(mean_uptime_s), "fail", p)
    while (item := b.pop()) is not None:
        time_s, kind, peer = item
        b.emit(time_s, peer, kind)
        mean = mean_downtime_s if kind == "fail" else mean_uptime_s
        b.push(time_s + rng.exponential(mean), "join" if kind == "fail" else "fail", peer)
    return b.schedule()


def _online_fraction(time_s: float, utc_offset_h: float) -> float:
    hour = (time_s / 3600.0 + utc_offset_h) % 24.0
    return 0.5 + 0.4 * math.cos(2 * math.pi * (hour - 20.0) / 24.0)


def diurnal(
    fleet: Fleet, duration_s: float, seed: int, mean_session_s: float = 7200.0, start_hour_utc: float = 0.0
) -> ChurnSchedule:
    rng = make_rng(seed, "churn", "diurnal")
    num_locations = len(fleet.locations.names)
    offsets = [24.0 * loc / num_locations + start_hour_utc for loc in range(num_locations)]
    offline = {
        p
        for p, peer in enumerate(fleet.peers)
        if rng.random() >= _online_fraction(0.0, offsets[peer.location])
    }
    b = _Builder(fleet.num_peers, duration_s, offline)

    def next_return(t: float, p: int) -> float:
        frac = _online_fraction(t, offsets[fleet.peers[p].location])
        return t + rng.exponential(mean_session_s * (1 - frac) / frac)

    for p in range(fleet.num_peers):
        b.push(
            next_return(0.0, p) if p in offline else rng.exponential(mean_session_s),
            "join" if p in offline else "leave",
            p,
        )
    while (item := b.pop()) is not None:
        time_s, kind, peer = item
        b.emit(time_s, peer, kind)
        if kind == "leave":
            b.push(next_return(time_s, peer), "join", peer)
        else:
            b.push(time_s + rng.exponential(mean_session_s), "leave", peer)
    return b.schedule()


def regional_outage(
    fleet: Fleet,
    duration_s: float,
    seed: int,
    mean_interval_s: float = 1800.0,
    min_outage_s: float = 60.0,
    mean_outage_s: float = 600.0,
) -> ChurnSchedule:
    rng = make_rng(seed, "churn", "regional-outage")
    b = _Builder(fleet.num_peers, duration_s)
    pools = _pools(fleet, lambda peer: peer.location)
    b.push(rng.exponential(mean_interval_s), "outage")
    while (item := b.pop()) is not None:
        time_s, kind, peer = item
        if kind == "join":
            b.emit(time_s, peer, "join")
            continue
        victims = _pick_pool(rng, pools, b.live)
        end_s = time_s + min_outage_s + rng.exponential(mean_outage_s)
        for v in victims:
            b.emit(time_s, v, "fail")
            b.push(end_s, "join", v)
        b.push(time_s + rng.exponential(mean_interval_s), "outage")
    return b.schedule()


def churn_schedule(name: str, fleet: Fleet, duration_s: float, seed: int) -> ChurnSchedule:
    if name == "none":
        return ChurnSchedule(())
    models = {
        "preemptible": preemptible,
        "exponential": exponential,
        "diurnal": diurnal,
        "regional-outage": regional_outage,
    }
    if name not in models:
        raise UserError(f"unknown churn model {name!r} (choose from: {', '.join(CHURN_MODELS)})")
    return models[name](fleet, duration_s, seed)


def load_trace(path: str | Path, fleet: Fleet) -> ChurnSchedule:
    """Read a CSV trace `time_s,peer,event`; any problem is a TraceError naming the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    rows = [
        (n, line)
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not rows:
        raise TraceError(f"trace {path} is empty (expected a header `time_s,peer,event`)")
    header_line, header = rows[0]
    if tuple(f.strip() for f in header.split(",")) != HEADER:
        raise TraceError(
            f"trace {path} line {header_line}: header must be `time_s,peer,event`, got {header.strip()!r}"
        )
    index = fleet.index_of()
    parsed: list[tuple[int, float, int, str]] = []
    for line_no, fields in zip(
        (n for n, _ in rows[1:]), csv.reader(line for _, line in rows[1:]), strict=True
    ):
        parsed.append(_parse_row(path, line_no, fields, index, parsed[-1][1] if parsed else 0.0))
    return _check_consistency(path, parsed, fleet)


def _parse_row(path: Path, line_no: int, fields: list[str], index: dict[str, int], last_s: float):
    where = f"trace {path} line {line_no}"
    if len(fields) != 3:
        raise TraceError(f"{where}: expected 3 fields `time_s,peer,event`, got {len(fields)}")
    time_text, peer_id, event = (f.strip() for f in fields)
    try:
        time_s = float(time_text)
    except ValueError:
        raise TraceError(f"{where}: time_s {time_text!r} is not a number") from None
    if not math.isfinite(time_s) or time_s < 0:
        raise TraceError(f"{where}: time_s must be a finite number >= 0, got {time_text}")
    if time_s < last_s:
        raise TraceError(
            f"{where}: time_s {time_s:g} goes back in time (previous event at {last_s:g}); sort the trace"
        )
    if peer_id not in index:
        known = ", ".join(list(index)[:3]) + (", ..." if len(index) > 3 else "")
        raise TraceError(f"{where}: unknown peer {peer_id!r} (the fleet's peers are {known})")
    if event not in EVENTS:
        raise TraceError(f"{where}: event must be join, leave or fail, got {event!r}")
    return line_no, time_s, index[peer_id], event


def _check_consistency(path: Path, parsed, fleet: Fleet) -> ChurnSchedule:
    first_event: dict[int, str] = {}
    for _, _, peer, event in parsed:
        first_event.setdefault(peer, event)
    offline = {p for p, e in first_event.items() if e == "join"}
    live = {p: p not in offline for p in range(fleet.num_peers)}
    events = []
    for line_no, time_s, peer, event in parsed:
        name = fleet.peers[peer].peer_id
        if event == "join" and live[peer]:
            raise TraceError(f"trace {path} line {line_no}: peer {name} joins but is already live")
        if event != "join" and not live[peer]:
            raise TraceError(f"trace {path} line {line_no}: peer {name} cannot {event}: it is not live")
        live[peer] = event == "join"
        events.append(ChurnEvent(time_s, peer, event))
    return ChurnSchedule(tuple(events), frozenset(offline))


def write_trace(path: str | Path, schedule: ChurnSchedule, fleet: Fleet) -> None:
    """Write a schedule as a trace file that `load_trace` reads back to the same schedule.

    A trace cannot say "offline from the start and never joins"; such peers are written as leaving at
    time 0 (the only difference on reading back)."""
    with_events = {e.peer for e in schedule.events}
    never_join = sorted(p for p in schedule.initially_offline if p not in with_events)
    try:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(HEADER)
            for p in never_join:
                writer.writerow(["0.0", fleet.peers[p].peer_id, "leave"])
            for e in schedule.events:
                writer.writerow([repr(float(e.time_s)), fleet.peers[e.peer].peer_id, e.event])
    except OSError as exc:
        raise UserError(f"cannot write trace {path}: {exc.strerror}") from None
