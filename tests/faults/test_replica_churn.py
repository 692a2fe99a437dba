"""SIGKILL one of two DiLoCo replicas mid-run: the survivor finishes its run (waiting for the dead one
at most until its DHT record expires); a new replica started on the dead one's shard downloads the
outer state, trains from the survivor's position and ends with the survivor's weights."""

import json
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(420)]


def _inner_step(log_text: str) -> int:
    steps = [
        int(line.split("inner step ")[1].split("/")[0])
        for line in log_text.splitlines()
        if "inner step " in line
    ]
    return max(steps, default=0)


def test_kill_a_replica_and_a_new_one_catches_up(make_swarm):
    # 16,384 samples: 512 local steps each, long enough to kill and rejoin mid-run
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": 16384}})
    swarm.start_dht()
    common = ("--threads", "1", "--eval-samples", "128", "--log-period-s", "1")
    swarm.start_replica("a", "0/2", *common, "--wait-for-replicas", "2")
    swarm.start_replica("b", "1/2", *common, "--wait-for-replicas", "2")
    deadline = time.monotonic() + 120
    while _inner_step(swarm.processes["b"].log_text()) < 100:
        assert time.monotonic() < deadline and swarm.processes["b"].alive, swarm.processes["b"].log_text()[
            -3000:
        ]
        time.sleep(0.2)
    victim = swarm.processes["b"]
    swarm.kill("b")
    assert not victim.alive  # the fault fired
    time.sleep(3)
    swarm.start_replica("b2", "1/2", *common, "--wait-for-replicas", "2")  # a is there: no wait

    for name in ("a", "b2"):
        assert swarm.wait_exit(name, 300) == 0, swarm.processes[name].log_text()[-3000:]
    a, b2 = (json.loads(swarm.summary_path(n).read_text()) for n in ("a", "b2"))
    steps = cfg.training.max_samples // cfg.training.global_batch_size
    assert a["final_inner_step"] == b2["final_inner_step"] == steps  # both ran to the run's end
    assert a["joined_from"] == "fresh", a
    assert b2["joined_from"] == "peers" and b2["start_inner_step"] > 100, b2
    assert a["outer_steps"] == b2["outer_steps"]
    assert b2["rounds_averaged"] >= 3, b2  # it contributed after joining
    assert a["fingerprint"] == pytest.approx(b2["fingerprint"], rel=5e-3)
    assert a["val_loss"] == pytest.approx(b2["val_loss"], rel=5e-3)
