"""`swarmtrain status --json` against a live local swarm: the shape the issue names, every announced
peer, the trainer, the bottleneck, and the rate the swarm runs at."""

import json
import subprocess
import sys
import time

import pytest

from swarm_fixtures import start_servers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_status_json_against_a_live_swarm(make_swarm):
    swarm, cfg = make_swarm("tiny")
    start_servers(swarm, {"s0a": 0, "s0b": 0, "s1": 1})
    swarm.start_trainer("trainer", "--max-samples", "100000", "--in-flight", "2", "--log-period-s", "1")
    command = [sys.executable, "-m", "swarmtrain.cli.main", "status", "--config", swarm.config_path]
    command += ["--initial-peers", swarm.address, "--json"]
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run(command, capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr[-2000:]
        snap = json.loads(out.stdout)
        # the swarm's rate is known once replicas applied a few steps (runtime/server/step_rate.py)
        running = snap["rebalance"]["observed_samples_per_s"]
        if snap["trainers"] and [len(s["peers"]) for s in snap["stages"]] == [2, 1] and running:
            break
        assert time.monotonic() < deadline, snap
        time.sleep(1)
    assert [s["index"] for s in snap["stages"]] == [0, 1]
    for stage in snap["stages"]:
        for peer in stage["peers"]:
            assert {"peer_id", "throughput_samples_per_s", "queue", "epoch"} <= set(peer)
            assert peer["same_config"] and isinstance(peer["epoch"], int)
    assert snap["bottleneck"] in (0, 1)
    assert snap["trainers"][0]["trainer_id"] == "trainer"
    text = subprocess.run(command[:-1], capture_output=True, text=True, timeout=90)
    assert text.returncode == 0 and "stage 0: 2 peer(s)" in text.stdout, text.stdout + text.stderr[-2000:]
