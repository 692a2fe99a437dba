"""A real SIGSTOP of a process running the awake clock (utils/awake_clock.py): the 3 s it was stopped do
not count on it, and the monotonic clock beside it counts them."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.timeout(60)]

CHILD = """
import json, sys, time
from swarmtrain.utils.awake_clock import awake_clock
clock = awake_clock()
start_m, start_a = time.monotonic(), clock()
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps({"monotonic_s": time.monotonic() - start_m, "awake_s": clock() - start_a}), flush=True)
"""


def test_the_time_a_process_was_stopped_does_not_count_on_its_awake_clock():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(1.0)  # the watching thread's next tick sees the overshoot
        child.stdin.write("go\n")
        child.stdin.flush()
        times = json.loads(child.stdout.readline())
        assert times["monotonic_s"] >= 4.4
        assert times["monotonic_s"] - times["awake_s"] >= 2.5  # the stop, less a tick
    finally:
        child.kill()
        child.wait(timeout=10)
