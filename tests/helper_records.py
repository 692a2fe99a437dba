"""Helper scripts that tests run inside test-bed namespaces print one JSON object per line (their
records); tests read those objects, never the text with a regular expression."""

from __future__ import annotations

import json
import time

from swarmtrain.runtime.procs import ManagedProcess


def records(text: str) -> list[dict]:
    """The JSON objects among the lines of `text` (other lines, e.g. a Python warning, are skipped)."""
    found = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


def wait_for_record(proc: ManagedProcess, key: str, timeout_s: float = 30.0) -> dict:
    """The first record of `proc` that has `key`, once printed; AssertionError after `timeout_s` or
    when the process ended without it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r for r in records(proc.log_text()) if key in r]
        if found:
            return found[0]
        if not proc.alive:
            break
        time.sleep(0.05)
    raise AssertionError(f"{proc.name}: no {key!r} record in {timeout_s} s; log:\n{proc.log_text()[-3000:]}")
