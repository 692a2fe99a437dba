"""Every replica of a stage dies (SIGKILL: no final checkpoint) while the rest of the swarm lives: a new
server restores the stage from its newest checkpoint and adopts the swarm's step; without a checkpoint
it refuses to serve initial weights, unless told to start fresh."""

import json
import time

import pytest

from swarm_fixtures import start_servers
from swarmtrain.data import build_datasets

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(400)]


def _val_loss(make_swarm, cfg, swarm, val_set, counts):
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers(counts)
    loss = probe.run(probe.trainer.evaluate(val_set, 256), timeout_s=120)
    epochs = {p: probe.info(p).header["epoch"] for s in range(len(counts)) for p in probe.peers(s)}
    probe.close()
    return loss, epochs


def _ledger(swarm, name):
    return [json.loads(line) for line in swarm.ledger_path(name).read_text().splitlines()]


def test_a_lost_stage_is_restored_from_its_checkpoint_or_refused(make_swarm, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    overrides = {
        "training": {"max_samples": 8192},
        "swarm": {"checkpoint_dir": str(checkpoints), "checkpoint_every_steps": 10},
    }
    swarm, cfg = make_swarm("tiny", overrides)
    start_servers(swarm, {"s0": 0, "s1": 1})
    swarm.start_trainer("trainer", "--max-samples", "1024", "--in-flight", "4")
    assert swarm.wait_exit("trainer", 300) == 0, swarm.processes["trainer"].log_text()[-3000:]
    _, val_set = build_datasets(cfg)
    steps = 1024 // cfg.training.global_batch_size  # 32; stage 0's newest checkpoint is step 30
    loss_before, _ = _val_loss(make_swarm, cfg, swarm, val_set, [1, 1])

    swarm.kill("s0")
    swarm.start_server("s0new", 0)
    swarm.wait_ready(["s0new"])
    loss_after, epochs = _val_loss(make_swarm, cfg, swarm, val_set, [1, 1])
    print(f"val loss {loss_before:.4f} before stage 0 was lost, {loss_after:.4f} restored from step 30")
    assert loss_after == pytest.approx(loss_before, rel=0.03)
    assert set(epochs.values()) == {steps}  # the restored stage adopted the swarm's step
    restore = [e for e in _ledger(swarm, "s0new") if e["e"] == "restore"]
    assert restore == [dict(restore[0], source="checkpoint", epoch=steps, lost_steps=2)]

    # no checkpoint of stage 0 any more: a new stage-0 server refuses, and says why
    swarm.kill("s0new")
    for path in (checkpoints / "stage0").iterdir():
        path.unlink()
    time.sleep(5.0)  # the dead replica's progress record expires (ttl 3 s): no "live" peer to download from
    refused = swarm.start_server("s0refused", 0)
    assert swarm.wait_exit("s0refused", 120) == 2, refused.log_text()[-3000:]
    log = refused.log_text()
    assert "no live replica and no checkpoint" in log and "--fresh-start" in log
    assert "Traceback" not in log

    # on purpose: --fresh-start serves initial weights at the swarm's step, loudly
    swarm.start_server("s0fresh", 0, "--fresh-start")
    swarm.wait_ready(["s0fresh"])
    _, epochs = _val_loss(make_swarm, cfg, swarm, val_set, [1, 1])
    assert set(epochs.values()) == {steps}
    assert "every update of this stage so far is lost" in swarm.processes["s0fresh"].log_text()
