"""Typed metrics of every role as log lines: `metrics {json}`, one object per line.

Servers (`runtime/server/server_metrics.py`), trainers (`runtime/trainer/trainer_metrics.py`) and
replicas (`runtime/replica/replica_metrics.py`) each log a frozen dataclass with a `role` field this
way. Benchmarks, experiments and tests read them back with `records_from_log` and the dataclass's
`from_dict`, never by matching the human-readable lines with regular expressions, so adding a field
or rewording a message breaks nobody.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

LOG_PREFIX = "metrics "

T = TypeVar("T")


def metrics_line(metrics: Any) -> str:
    """The log line of a metrics dataclass."""
    return LOG_PREFIX + json.dumps(dataclasses.asdict(metrics), separators=(",", ":"))


def from_fields(cls: type[T], data: dict) -> T:
    """`cls` from a dict that may hold fields a newer writer added (ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


def records_from_log(text: str, role: str) -> list[dict]:
    """The JSON object of every metrics line of `role` in a log, oldest first (other lines skipped)."""
    found = []
    for line in text.splitlines():
        start = line.find(LOG_PREFIX + "{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start + len(LOG_PREFIX) :])
        except ValueError:
            continue  # a line cut off by a kill
        if isinstance(record, dict) and record.get("role") == role:
            found.append(record)
    return found
