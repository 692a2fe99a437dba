"""No traceback in any log (utils/logging.py): after `setup_logging`, an exception logged by us, by a
library (hivemind's loggers), by asyncio for a task nobody awaited, by Python for an exception it could
not raise, by a thread that died, or handed to `sys.excepthook` is one line naming it; at
SWARMTRAIN_LOGLEVEL=DEBUG the traceback stays. Each case runs in its own interpreter: the hooks are
process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = r"""
import asyncio, gc, logging, threading
from swarmtrain.utils.logging import get_logger, setup_logging

setup_logging()
try:
    raise ValueError("first\nsecond line")
except ValueError:
    get_logger("swarmtrain.test").exception("ours failed")
    logging.getLogger("hivemind.averaging").error("theirs failed", exc_info=True)

async def unawaited():
    raise TimeoutError()

loop = asyncio.new_event_loop()
task = loop.create_task(unawaited())
loop.run_until_complete(asyncio.sleep(0.01))
del task
gc.collect()
loop.close()

class Broken:
    def __del__(self):
        raise RuntimeError("in a finalizer")

Broken()
gc.collect()
thread = threading.Thread(target=lambda: 1 / 0, name="worker")
thread.start()
thread.join()
import sys
try:
    raise EOFError()
except EOFError:
    sys.excepthook(*sys.exc_info())  # as multiprocessing's resource_sharer thread does
print("done", flush=True)
"""


def _run(level: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SWARMTRAIN_LOGLEVEL"}
    if level:
        env["SWARMTRAIN_LOGLEVEL"] = level
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    return done.stderr


def test_every_exception_is_one_line_and_named():
    err = _run(None)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    for expected in (
        "ours failed (ValueError: first second line)",
        "theirs failed (ValueError: first second line)",
        "Task exception was never retrieved",
        "(TimeoutError)",
        "(RuntimeError: in a finalizer)",
        "thread worker failed (ZeroDivisionError: division by zero)",
        "uncaught exception (EOFError)",
    ):
        assert any(expected in line for line in lines), (expected, err)


def test_debug_keeps_the_tracebacks():
    err = _run("DEBUG")
    assert err.count("Traceback") >= 5, err


def test_a_bug_in_a_command_is_one_line_and_exit_1(monkeypatch, capsys):
    from swarmtrain.cli import main, status

    monkeypatch.delenv("SWARMTRAIN_LOGLEVEL", raising=False)

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "run", broken)
    assert main.main(["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "swarmtrain status: internal error: KeyError: 'a bug' (a bug; SWARMTRAIN_LOGLEVEL=DEBUG shows its traceback)"
    ]
