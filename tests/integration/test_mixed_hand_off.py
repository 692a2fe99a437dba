"""Direct hand-off chosen per hop: when two neighbouring stages' peers both announce themselves behind
a NAT (`--auto-relay`), neither can dial the other, so the trainer relays the stages up to that boundary
and the servers hand off directly from there on. A real swarm on 127.0.0.1 of three `tiny` stages:
stages 0 and 1 announce a NAT, stage 2 is public. (On loopback everyone could dial everyone: what this
checks is the trainer's choice and that the mixed path trains as local training does; tests/integration/
test_nat.py has real NATs.)"""

import dataclasses
import json

import pytest
import torch

from swarmtrain.runtime.local import LocalTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SAMPLES = 1024
EVAL_SAMPLES = 256


def test_stages_behind_nats_are_relayed_and_the_rest_hand_off_directly(make_swarm):
    swarm, cfg = make_swarm(
        "tiny",
        {
            "swarm": {"num_stages": 3},
            "training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES},
        },
    )
    swarm.start_dht()
    servers = {"s0": (0, "--auto-relay"), "s1": (1, "--auto-relay"), "s2": (2,)}
    for name, (stage, *flags) in servers.items():
        swarm.start_server(name, stage, *flags)
    swarm.wait_ready(list(servers))
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES), "--compression", "none"]
    swarm.start_trainer("trainer", *args, "--log-period-s", "5")
    assert swarm.wait_exit("trainer", 240) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())

    torch.set_num_threads(1)
    local_cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    local = LocalTrainer(local_cfg, progress=False).train()
    completed, steps = summary["microbatches_completed"], SAMPLES // cfg.training.global_batch_size
    rpc = summary["rpc"]
    print(
        f"val loss after {SAMPLES} samples: swarm {summary['val_loss']:.4f}, local {local.final_val_loss:.4f}; "
        f"calls { ({k: v['calls'] for k, v in rpc.items()}) }"
    )
    assert completed == SAMPLES // cfg.training.micro_batch_size
    assert summary["microbatches_failed"] == 0 and summary["steps"] == steps
    # stage 0 relayed (its forward and backward called by the trainer); stages 1 and 2 by one chain
    # from stage 1 per micro-batch; no chain from stage 0
    assert rpc["stage0_forward"]["calls"] == completed
    assert rpc["stage0_backward"]["calls"] == completed
    assert rpc["stage1_chain"]["calls"] == completed
    assert "stage0_chain" not in rpc and "stage2_forward_backward" not in rpc
    assert summary["val_loss"] == pytest.approx(local.final_val_loss, rel=0.03)
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1, 1])
    short = cfg.training.micro_batch_size * summary["retries_not_accumulated"]
    for stage in range(3):
        (peer,) = probe.peers(stage)
        info = probe.info(peer)
        assert info.header["epoch"] == steps, info.header
        # stage 1, behind a NAT, dials stage 2's data plane; nothing reaches the others that way
        assert (info.header["direct_in"] >= completed) if stage == 2 else info.header["direct_in"] == 0
        assert SAMPLES - short <= info.header["samples_seen"] <= SAMPLES, info.header
