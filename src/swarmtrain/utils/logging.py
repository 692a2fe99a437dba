"""Logging factory: one place that decides format and level, called by entry points only."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """Return a module logger; handlers are attached by `setup_logging`, never at import time."""
    return logging.getLogger(name)


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
