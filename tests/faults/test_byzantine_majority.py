"""Three replicas of stage 0, one byzantine (its gradient sums scaled by 1e6, NaN every third step): with
an honest majority the stage's robust combination (net/robust.py: each contribution clipped to 4x the
lower median per-sample norm) contains it. Default tier (issue 23: the slow-tier test has 2 replicas,
no majority). Every parameter stays finite, the two honest replicas hold identical parameters, the
fault fired and was clipped, and the validation loss stays within 5% of local training on the same
samples."""

import dataclasses
import json
import math
import time

import pytest
import torch

from swarm_fixtures import in_background, start_servers
from swarmtrain.runtime.faults import FaultHooks
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.local import LocalTrainer

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(400)]

SAMPLES = 1024
EVAL_SAMPLES = 256


def test_one_byzantine_replica_of_three_is_contained(make_swarm):
    # a NaN step's sums (and a scaled one's beyond the 1e6 bound) are refused at the boundary: the honest
    # replicas wait the exchange timeout for the byzantine one's on most steps, so a short timeout keeps
    # the test short. 1 s (was 2) is still far above an honest exchange on loopback (milliseconds)
    swarm, cfg = make_swarm(
        "tiny",
        {
            "training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES},
            "swarm": {"averaging_timeout_s": 1.0},
        },
    )
    # the one-process reference on the same samples, computed while the swarm runs: the honest replicas
    # wait the exchange timeout on every third step and leave the cores mostly idle (~23 samples/s)
    torch.set_num_threads(1)
    local_cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    reference = in_background(lambda: LocalTrainer(local_cfg, progress=False).train())
    start_servers(swarm, {"s0a": 0, "s0b": 0, "s1": 1})
    swarm.start_server("s0x", 0, faults=FaultHooks(grad_scale=1e6, nan_every=3))
    swarm.wait_ready(["s0x"])
    trainer = swarm.start_trainer("trainer", "--in-flight", "4", "--eval-samples", str(EVAL_SAMPLES))
    assert swarm.wait_exit("trainer", 300) == 0, trainer.log_text()[-3000:]
    summary = json.loads(swarm.summary_path("trainer").read_text())

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([3, 1])
    params = {p: probe.info(p, want="params") for stage in (0, 1) for p in probe.peers(stage)}
    for peer, info in params.items():
        assert all(torch.isfinite(info.tensor(n)).all() for n in info.tensors), peer
    byzantine_peer = next(e["peer"] for e in read_ledger(swarm.ledger_path("s0x")) if e["e"] == "start")
    honest = [p for p in probe.peers(0) if p != byzantine_peer]
    assert len(honest) == 2
    clipped = {p[-6:]: params[p].header["steps"]["clipped_contributions"] for p in probe.peers(0)}
    local = reference.result()
    print(
        f"val loss with 1 byzantine of 3 stage-0 replicas {summary['val_loss']:.4f}, local "
        f"{local.final_val_loss:.4f}; clipped contributions per replica {clipped}"
    )
    assert math.isfinite(summary["val_loss"])
    assert sum(clipped.values()) > 0  # the fault fired and was caught
    # the honest replicas end identical; a partial exchange just before the end (the byzantine one's
    # sums are refused or late) may still be being repaired by a resync: wait for it (seen in CI)
    deadline = time.monotonic() + 60.0
    while True:
        a, b = (probe.info(p, want="params") for p in honest)
        equal = all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.tensors)
        if equal or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)
    assert summary["val_loss"] <= 1.05 * local.final_val_loss
