"""Logging factory: one place that decides format and level, called by entry points only.

No log of any role shows a traceback (README "Logs"): once `setup_logging` ran, an exception attached
to any log record (ours, hivemind's, asyncio's "Task exception was never retrieved"), an exception
Python could not raise ("Exception ignored in ...") and an uncaught exception in a thread are each
reported as one line naming the exception. A failure is still reported where it happens; its traceback
is kept only at SWARMTRAIN_LOGLEVEL=DEBUG, for whoever debugs it.

Lines that repeat (a trainer's retry of every refused attempt while a replica catches up: dozens a
second) go through `log_repeated`: one line per logger and message template every `REPEAT_PERIOD_S`,
the next one saying how many were held back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable

_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """Return a module logger; handlers are attached by `setup_logging`, never at import time."""
    return logging.getLogger(name)


REPEAT_PERIOD_S = 10.0


class RepeatLimiter:
    """At most one line per `period_s` for each (logger, message template, `key`); the lines held back
    in between are counted, and the next line that passes ends in "(k more like this in the last N s)".
    A burst that stops is therefore summed up by the next line of its kind, not at once."""

    def __init__(
        self, period_s: float = REPEAT_PERIOD_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.period_s, self._clock = period_s, clock
        self._lock = threading.Lock()
        self._last: dict[tuple, tuple[float, int]] = {}  # -> (when a line last passed, held back since)

    def log(self, logger: logging.Logger, level: int, msg: str, *args, key: Hashable = None) -> bool:
        """Log `msg % args` unless a line of its kind passed within the period; True if it was logged."""
        if not logger.isEnabledFor(level):
            return False
        kind, now_s = (logger.name, msg, key), self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now_s - last[0] < self.period_s:
                self._last[kind] = (last[0], last[1] + 1)
                return False
            self._last[kind] = (now_s, 0)
        if last is not None and last[1]:
            msg, args = f"{msg} (%d more like this in the last %.0f s)", (*args, last[1], now_s - last[0])
        logger.log(level, msg, *args)
        return True


_repeats = RepeatLimiter()


def log_repeated(logger: logging.Logger, level: int, msg: str, *args, key: Hashable = None) -> bool:
    """`logger.log(level, msg, *args)` through the process's `RepeatLimiter` (see it)."""
    return _repeats.log(logger, level, msg, *args, key=key)


def setup_logging(level: str | None = None, stream=None) -> None:
    """Configure the root `swarmtrain` logger once for a process (CLI entry points call this)."""
    level_name = (level or os.environ.get("SWARMTRAIN_LOGLEVEL", "INFO")).upper()
    root = logging.getLogger("swarmtrain")
    root.setLevel(level_name)
    if not any(getattr(h, "_swarmtrain", False) for h in root.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._swarmtrain = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.propagate = False
    if level_name != "DEBUG":
        one_line_exceptions()


def one_line_exceptions() -> None:
    """Every exception a log record, Python's unraisable hook or a thread would print with its
    traceback is reported as one line instead (idempotent; forked children inherit it)."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "_one_line", False):
        logging.setLogRecordFactory(_one_line_factory(factory))
    sys.unraisablehook = _unraisable_in_one_line
    threading.excepthook = _thread_exception_in_one_line
    # uncaught in the main thread, and what calls the hook itself (multiprocessing's resource_sharer
    # thread printed an EOFError's traceback in a DiLoCo replica's log at its exit)
    sys.excepthook = _uncaught_in_one_line


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _one_line_factory(make_record):
    def make(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 (a record whose arguments do not fit its format)
                message = str(record.msg)
            record.msg, record.args = f"{message} ({describe(exc)})", None
            record.exc_info, record.exc_text = None, None
        return record

    make._one_line = True  # type: ignore[attr-defined]
    return make


def _unraisable_in_one_line(unraisable) -> None:
    where = f" in {unraisable.object!r:.120}" if unraisable.object is not None else ""
    message = unraisable.err_msg or "Exception ignored"
    exc = unraisable.exc_value
    what = describe(exc) if exc is not None else unraisable.exc_type.__name__
    logging.getLogger("swarmtrain").warning("%s%s (%s)", message, where, what)


def _thread_exception_in_one_line(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("swarmtrain").error("thread %s failed (%s)", name, describe(args.exc_value))


def _uncaught_in_one_line(exc_type, exc, _traceback) -> None:
    what = describe(exc) if exc is not None else exc_type.__name__
    logging.getLogger("swarmtrain").error("uncaught exception (%s)", what)
