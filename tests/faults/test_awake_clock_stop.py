"""A real SIGSTOP of a process running the awake clock (utils/awake_clock.py): the 3 s it was stopped do
not count on it, and the monotonic clock beside it counts them."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.timeout(60), pytest.mark.timed]

CHILD = """
import json, sys, time
from swarmtrain.utils.awake_clock import awake_clock
clock = awake_clock()
start_m, start_a = time.monotonic(), clock()
print("ready", flush=True)
sys.stdin.readline()
# the watching thread counts the stop when it next runs: on a loaded machine that came after the parent's
# fixed second (CI: nothing counted yet); wait for it, bounded
deadline = time.monotonic() + 20
while clock.stopped_s == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"monotonic_s": time.monotonic() - start_m, "awake_s": clock() - start_a}), flush=True)
"""


def _stopped_within(pid: int, timeout_s: float) -> bool:
    """Whether /proc shows every thread of `pid` stopped ("T") within `timeout_s`."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state == "T" for state in states):
            return True
        time.sleep(0.02)
    return False


def test_the_time_a_process_was_stopped_does_not_count_on_its_awake_clock():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        # a failure should say whether the stop took effect at all (CI failed twice with nothing counted)
        assert _stopped_within(child.pid, timeout_s=5.0), "SIGSTOP did not stop the child"
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        times = json.loads(child.stdout.readline())
        assert times["monotonic_s"] >= 3.4
        assert times["monotonic_s"] - times["awake_s"] >= 2.5  # the stop, less a tick
    finally:
        child.kill()
        child.wait(timeout=10)
