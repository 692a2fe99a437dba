"""Typed metrics of every role as log lines: `metrics {json}`, one object per line.

Servers (`runtime/server/server_metrics.py`), trainers (`runtime/trainer/trainer_metrics.py`) and
replicas (`runtime/replica/replica_metrics.py`) each define a frozen dataclass on `MetricsRecord`, with a
`role` field whose default names the role; the base gives all three the same JSON form, log line and
reading back. Benchmarks, experiments and tests read them with `from_log`, never by matching the
human-readable lines with regular expressions, so adding a field or rewording a message breaks nobody.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Self

LOG_PREFIX = "metrics "


class MetricsRecord:
    """What every role's metrics dataclass shares; a subclass holds only its fields (`role` last)."""

    def to_dict(self) -> dict:
        """The record as JSON-ready data (the DHT metrics record's value, the log line's object)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def log_line(self) -> str:
        return LOG_PREFIX + json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> Self:
        """The record from a dict that may hold fields a newer writer added (ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_log(cls, text: str) -> list[Self]:
        """Every metrics line of this role in a log, oldest first (other lines skipped)."""
        role = cls.__dataclass_fields__["role"].default  # type: ignore[attr-defined]
        return [cls.from_dict(record) for record in records_from_log(text, role)]


def records_from_log(text: str, role: str) -> list[dict[str, Any]]:
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
