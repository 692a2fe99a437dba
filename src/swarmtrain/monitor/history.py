"""The monitor's memory: a bounded time series of what every snapshot showed (trainers' loss and
samples/s, each stage's throughput and peers, lost and retried work) and the events derived between
consecutive snapshots.

`history_point` is pure; `SwarmHistory` only appends to bounded deques under a lock, because the poller
thread adds snapshots while web requests read them.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque

from swarmtrain.monitor.events import diff_snapshots

DEFAULT_MAX_POINTS = 1800  # an hour at the default 2 s interval
DEFAULT_MAX_EVENTS = 500


def history_point(snapshot: dict) -> dict:
    """What the charts need from one snapshot, as plain JSON-safe data."""
    return {
        "time": snapshot.get("time"),
        "stage_throughput": [finite(s["throughput_samples_per_s"]) for s in snapshot.get("stages", [])],
        "stage_peers": [len(s["peers"]) for s in snapshot.get("stages", [])],
        "trainers": {
            t["trainer_id"]: {"loss": finite(t.get("loss")), "samples_per_s": finite(t.get("samples_per_s"))}
            for t in snapshot.get("trainers", [])
        },
        "work": json_safe(dict(snapshot.get("work") or {})),
    }


def finite(value) -> float | int | None:
    """A number, or None for missing, NaN and infinite values (a trainer's loss before its first step)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def json_safe(value):
    """`value` with every non-finite float replaced by None: JSON has no NaN, browsers refuse it."""
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class SwarmHistory:
    """Snapshots in, a bounded history and event log out. Thread-safe."""

    def __init__(self, max_points: int = DEFAULT_MAX_POINTS, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self._lock = threading.Lock()
        self._points: deque[dict] = deque(maxlen=max_points)
        self._events: deque[dict] = deque(maxlen=max_events)
        self._event_counts: Counter[str] = Counter()  # never trimmed: Prometheus counters only grow
        self._latest: dict | None = None
        self._polls = 0
        self._error: str | None = None

    def add(self, snapshot: dict) -> list[dict]:
        """Record one snapshot; returns the events it brought."""
        with self._lock:
            events = diff_snapshots(self._latest, snapshot)
            self._points.append(history_point(snapshot))
            self._events.extend(events)
            self._event_counts.update(e["kind"] for e in events)
            self._latest = snapshot
            self._polls += 1
            self._error = None
            return events

    def record_error(self, message: str) -> None:
        """A failed poll: shown on the page until the next good snapshot; the history is kept."""
        with self._lock:
            self._error = message

    def view(self) -> dict:
        """Everything the page, /api/swarm and /metrics show, as one consistent JSON-safe copy."""
        with self._lock:
            return json_safe(
                {
                    "snapshot": self._latest,
                    "points": list(self._points),
                    "events": list(self._events),
                    "event_counts": dict(self._event_counts),
                    "polls": self._polls,
                    "error": self._error,
                }
            )
