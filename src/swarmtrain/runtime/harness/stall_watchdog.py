"""Evidence for rare stalls: when a local swarm's trainers complete no micro-batch for `quiet_s`, dump
every live process's Python stacks (py-spy) into the swarm's work directory.

A stall that happens once in twenty runs is gone by the time anyone looks; the stacks of every process
at the moment it happened say where each one waited. The watchdog only watches and writes: it never
fails a test (a test that SIGSTOPs a peer stalls on purpose). It reads the trainers' ledgers (`done`
events), so it sees what the accounting sees, and dumps once per stall (re-armed by the next
completion).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

DUMP_TIMEOUT_S = 15.0  # py-spy on a SIGSTOPped or busy process can take seconds; never wait forever


@dataclass
class _LedgerTail:
    """Counts `done` events appended to one trainer ledger since the last read."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def new_completions(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # a line still being written
        return sum(1 for line in lines if b'"e":"done"' in line)


def py_spy_path() -> str | None:
    """py-spy next to this Python (a virtualenv's bin, not always on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stacks(pids: dict[str, int], timeout_s: float = DUMP_TIMEOUT_S) -> str:
    """Every named process's stacks as one text (py-spy dump); a process py-spy cannot read says why."""
    exe = py_spy_path()
    if exe is None:
        return "py-spy is not installed: no stacks (pip install py-spy)\n"
    parts = []
    for name, pid in pids.items():
        try:
            done = subprocess.run(
                [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s
            )
            text = done.stdout or done.stderr
        except subprocess.TimeoutExpired:
            text = f"py-spy did not answer in {timeout_s:.0f} s\n"
        parts.append(f"===== {name} (pid {pid}) =====\n{text}")
    return "\n".join(parts)


@dataclass
class StallWatchdog:
    """Watches `ledgers()` (trainer ledger paths, re-read each poll: trainers start late) and, while
    `alive()` says a trainer runs, dumps `pids()`'s stacks to `out_dir/stall-N.txt` after `quiet_s`
    without a completion. Armed by the first completion, and again after a time with no trainer
    running: start-up is not a stall."""

    ledgers: Callable[[], list[Path]]
    pids: Callable[[], dict[str, int]]
    alive: Callable[[], bool]
    out_dir: Path
    quiet_s: float = 10.0
    poll_s: float = 1.0
    on_dump: Callable[[Path], None] | None = None  # e.g. print it where a failing test shows its output
    dumps: list[Path] = field(default_factory=list)
    _tails: dict[Path, _LedgerTail] = field(default_factory=dict)
    _last_completion: float | None = None
    _dumped_this_stall: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StallWatchdog:
        self._thread = threading.Thread(target=self._loop, name="stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(DUMP_TIMEOUT_S * 4)

    def rearm(self) -> None:
        """Wait for a first completion again (a swarm restarted on purpose is not stalled)."""
        self._last_completion, self._dumped_this_stall = None, False

    def poll(self, now: float) -> Path | None:
        """One look at the ledgers; the dump written, if this poll found a stall."""
        for path in self.ledgers():
            self._tails.setdefault(path, _LedgerTail(path))
        if sum(tail.new_completions() for tail in self._tails.values()):
            self._last_completion, self._dumped_this_stall = now, False
            return None
        if not self.alive():
            self.rearm()  # the next trainers' start-up is not a stall either
            return None
        if self._last_completion is None or self._dumped_this_stall:
            return None
        quiet_s = now - self._last_completion
        if quiet_s < self.quiet_s:
            return None
        self._dumped_this_stall = True
        return self._dump(quiet_s)

    def _dump(self, quiet_s: float) -> Path:
        path = self.out_dir / f"stall-{len(self.dumps) + 1}.txt"
        header = f"no micro-batch completed for {quiet_s:.1f} s (at {time.strftime('%H:%M:%S')})\n\n"
        path.write_text(header + dump_stacks(self.pids()))
        self.dumps.append(path)
        logger.warning(
            "stall: no micro-batch completed for %.1f s; stacks of every process in %s", quiet_s, path
        )
        if self.on_dump is not None:
            self.on_dump(path)
        return path

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll(time.monotonic())
            except Exception:  # evidence is best effort: never take a test down with it
                logger.exception("stall watchdog")
