"""What a launcher says when a peer does not start (runtime/harness/local_swarm.py `not_started`): the exit
code of one that died; the state and Python stacks of one still running, for a start that hangs once in a
CI run and leaves nothing else to read."""

import os
import sys
import time

import pytest

from swarmtrain.runtime.harness.local_swarm import not_started
from swarmtrain.runtime.harness.stall_watchdog import py_spy_path
from swarmtrain.runtime.procs import ManagedProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HANGS = "import time\ndef stuck_in_start_up():\n    print('starting', flush=True)\n    time.sleep(600)\nstuck_in_start_up()"


def _peer(tmp_path, code: str) -> ManagedProcess:
    return ManagedProcess("peer", [sys.executable, "-c", code], tmp_path / "peer.log", env=dict(os.environ))


def test_a_peer_that_died_is_reported_with_its_exit_code_and_log(tmp_path):
    proc = _peer(tmp_path, "print('bad flag', flush=True); raise SystemExit(3)")
    proc.proc.wait(timeout=60)
    message = str(not_started(proc, "the DHT"))
    proc.kill()
    assert message.startswith("the DHT did not start: exit code 3") and message.endswith("bad flag\n")


@pytest.mark.skipif(py_spy_path() is None, reason="py-spy is not installed (a dev dependency)")
def test_a_peer_still_starting_is_reported_with_its_state_and_stacks(tmp_path):
    proc = _peer(tmp_path, HANGS)
    try:
        while "starting" not in proc.log_text():
            assert proc.alive
            time.sleep(0.05)
        message = str(not_started(proc, "the DHT"))
    finally:
        proc.kill()
    assert message.startswith("the DHT did not start: still running; its processes:")
    assert f"{proc.pid}: state S, waits in " in message and "stuck_in_start_up" in message
    assert message.endswith("its log:\nstarting\n")
