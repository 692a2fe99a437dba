"""A byzantine replica of stage 0: its gradient sums come out scaled by 1e6, and every third step it
sends NaN instead. The stage refuses the NaN sums at the boundary and clips the scaled ones
(model/robust.py): every parameter stays finite and the validation loss stays within 5% of the same
run with an honest replica, on the same samples."""

import json
import math

import pytest
import torch

from swarm_fixtures import start_servers

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

SAMPLES = 2048


def _run(make_swarm, monkeypatch, byzantine: bool) -> tuple[float, dict]:
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": 8192}})
    start_servers(swarm, {"s0a": 0, "s1": 1})
    if byzantine:
        monkeypatch.setenv("SWARMTRAIN_FAULT_GRAD_SCALE", "1e6")
        monkeypatch.setenv("SWARMTRAIN_FAULT_NAN_GRADS_EVERY", "3")
    swarm.start_server("s0b", 0)
    monkeypatch.delenv("SWARMTRAIN_FAULT_GRAD_SCALE", raising=False)
    monkeypatch.delenv("SWARMTRAIN_FAULT_NAN_GRADS_EVERY", raising=False)
    swarm.wait_ready(["s0b"])
    swarm.start_trainer("trainer", "--max-samples", str(SAMPLES), "--in-flight", "2", "--eval-samples", "256")
    assert swarm.wait_exit("trainer", 400) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads(swarm.summary_path("trainer").read_text())
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1])
    for stage in (0, 1):
        for peer in probe.peers(stage):
            params = probe.info(peer, want="params")
            assert all(torch.isfinite(params.tensor(n)).all() for n in params.tensors), (stage, peer)
    infos = {p: probe.info(p).header for p in probe.peers(0)}
    swarm.stop_all(grace_s=5.0)
    return summary["val_loss"], infos


def test_byzantine_replica_is_contained(make_swarm, monkeypatch):
    honest_loss, _ = _run(make_swarm, monkeypatch, byzantine=False)
    byzantine_loss, infos = _run(make_swarm, monkeypatch, byzantine=True)
    clipped = sum(i["steps"].get("clipped_contributions", 0) for i in infos.values())
    print(
        f"val loss honest {honest_loss:.4f}, with a byzantine replica {byzantine_loss:.4f}, clipped {clipped}"
    )
    assert math.isfinite(byzantine_loss)
    assert clipped > 0  # the fault fired and was caught
    assert byzantine_loss <= 1.05 * honest_loss
