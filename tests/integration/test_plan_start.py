"""From `swarmtrain plan --json` to a training swarm: the plan chooses each device's stage and (with
--compute, for devices of different speed) an uneven layer cut; servers start with --plan and
--device-index, a trainer with --plan, and training runs through them."""

import json
import subprocess
import sys

import pytest

from swarm_fixtures import on_a_thread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FLEET = {
    "name": "two-labs",
    "num_stages": 2,
    "devices": [
        {"site": "a", "gpu": "A100", "tflops": 312, "memory_gb": 80},
        {"site": "b", "gpu": "T4", "tflops": 65, "memory_gb": 16},
    ],
    "sites": ["a", "b"],
    "latency_ms": [[1, 30], [30, 1]],
    "bandwidth_gbps": [[100, 1], [1, 100]],
}


def test_servers_and_trainer_from_a_plan(make_swarm, tmp_path):
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(FLEET))
    command = [sys.executable, "-m", "swarmtrain.cli.main", "plan", "--scenario-file", str(fleet)]
    command += ["--model", "tiny", "--compute", "--json", "--budget-s", "1"]
    planned = on_a_thread(lambda: subprocess.run(command, capture_output=True, text=True, timeout=120))
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht()  # while the plan is made: the DHT needs none of it
    out = planned.result(timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(out.stdout)
    plan = json.loads(out.stdout)
    assert sum(plan["layers_per_stage"]) == 4

    for device in range(2):
        swarm.start_server(f"device{device}", None, "--plan", str(plan_path), "--device-index", str(device))
    swarm.wait_ready(["device0", "device1"])
    for device in range(2):
        stage = next(i for i, group in enumerate(plan["groups"]) if device in group)
        assert f"stage {stage} " in swarm.processes[f"device{device}"].log_text()
    swarm.start_trainer("trainer", "--plan", str(plan_path), "--max-samples", "256", "--in-flight", "2")
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
    # a trainer without the plan has another stage cut, so another config digest: no server for it
    if plan["layers_per_stage"] != [2, 2]:
        refused = swarm.start_trainer("stranger", "--max-samples", "64", "--in-flight", "1")
        # it waits for servers of its config (after MISMATCH_GRACE_PERIODS it exits 2 naming swarm.stages, as
        # tests/integration/test_run_mismatch.py shows for swarm.compression)
        assert swarm.wait_exit("stranger", 5) is None
        refused.kill()
