"""The chaos bench, 3 minutes, in the default tier: random SIGKILLs and SIGSTOPs (5-30 s) of servers,
a whole-swarm SIGKILL crash and restart halfway; nothing applied twice, every stage balanced, the
replicas equal, no stall over 30 s, the loss where it was after the restart (bench/chaos.py decides
the verdict; this test runs it as a user would and checks its summary)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(1200)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


def test_three_minutes_of_kills_stops_and_a_crash(tmp_path):
    summary_path = tmp_path / "chaos.json"
    argv = [sys.executable, str(BENCH), "--minutes", "3", "--fault-every-s", "15", "--seed", "0"]
    argv += ["--summary-json", str(summary_path), "--keep-logs", str(tmp_path / "logs")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1100)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads(summary_path.read_text())
    assert report["kills"] >= 1 and report["stops"] >= 1  # the schedule did strike, both ways
    assert report["verdict"]["pass"]
    for stage in report["stages"]:
        assert stage["double_applied"] == 0 and stage["unaccounted"] == 0 and stage["balanced"]
    # a micro-batch stuck on a frozen peer past the close timeout has its step applied without it and
    # fails (its samples lost, accounted above): at most a handful in 3 minutes (1 of 2,636 seen in CI)
    micro_batches = report["micro_batches"]
    assert micro_batches["failed"] <= 0.005 * micro_batches["started"], micro_batches
