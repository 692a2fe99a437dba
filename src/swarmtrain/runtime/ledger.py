"""Append-only JSON-lines ledger of what a peer did with each micro-batch (accounting and fault tests).

Servers record every accumulated micro-batch id, every applied round and every discarded
accumulation; trainers record started/completed/failed micro-batches. Each line is flushed at once
so that a ledger survives a SIGKILL up to its last complete line. `read_ledger` skips a torn last line.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Ledger:
    def __init__(self, path: str | Path | None) -> None:
        self._lock = threading.Lock()
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, **fields) -> None:
        if self._file is None:
            return
        line = json.dumps({"e": event, "t": round(time.time(), 3), **fields}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_ledger(path: str | Path) -> list[dict]:
    events = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return events
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn last line of a killed process
    return events
