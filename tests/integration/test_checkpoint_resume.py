"""A whole swarm stopped and started again resumes where it was: servers write their stage to
--checkpoint-dir (periodically and on a graceful stop) and load it on start; a restarted trainer
continues at the swarm's step and data position, and its micro-batches are accumulated."""

import json

import pytest
import torch

from swarm_fixtures import start_servers
from swarmtrain.data import build_datasets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SERVERS = {"s0a": 0, "s0b": 0, "s1": 1}
# trained before the stop: 16 steps, a checkpoint every 5 (and at the stop) keeps 3 of 4 (1024 samples,
# every 10, checked the same and cost ~2 s more)
FIRST_SAMPLES = 512
CHECKPOINT_EVERY_STEPS = 5


def _state(probe, val_set=None):
    """Every server's (epoch, samples_seen, params) and, given `val_set`, the val loss through the swarm
    `probe` is in."""
    probe.wait_for_peers([2, 1])
    infos = {peer: probe.info(peer, want="params") for stage in (0, 1) for peer in probe.peers(stage)}
    if val_set is None:
        return infos, None
    return infos, probe.run(probe.trainer.evaluate(val_set, 256), timeout_s=120)


def test_whole_swarm_stop_and_restart_resumes_at_the_step_it_reached(make_swarm, tmp_path):
    overrides = {
        "training": {"max_samples": 8192},
        "swarm": {
            "checkpoint_dir": str(tmp_path / "checkpoints"),
            "checkpoint_every_steps": CHECKPOINT_EVERY_STEPS,
        },
    }
    swarm, cfg = make_swarm("tiny", overrides)
    start_servers(swarm, SERVERS)
    swarm.start_trainer("trainer", "--max-samples", str(FIRST_SAMPLES), "--in-flight", "4")
    assert swarm.wait_exit("trainer", 300) == 0, swarm.processes["trainer"].log_text()[-3000:]
    first = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    assert first["microbatches_failed"] == 0 and first["retries_not_accumulated"] <= 2, first
    _, val_set = build_datasets(cfg)
    probe = make_swarm.probe(cfg, swarm)
    before, loss_before = _state(probe, val_set)
    probe.close()
    again, _ = make_swarm("tiny", overrides)  # a new DHT, new processes, the same checkpoint dir
    # the new swarm's DHT and its probe (one for before and after its trainer) start while the old
    # servers stop: they know none of them, and the stop is mostly a wait; the new servers start only
    # once the old ones wrote their checkpoints
    again.start_dht()
    probe = make_swarm.probe(cfg, again)
    swarm.stop_all()  # SIGTERM: each server writes its final checkpoint
    steps = FIRST_SAMPLES // cfg.training.global_batch_size
    saved = sorted(p.name for p in (tmp_path / "checkpoints" / "stage0").glob("*.json"))
    every = CHECKPOINT_EVERY_STEPS
    assert saved == [f"step{s:08d}.json" for s in (2 * every, 3 * every, steps)], saved  # the last 3 kept

    for name, stage in SERVERS.items():
        again.start_server(name, stage)
    again.wait_ready(list(SERVERS))
    after, loss_after = _state(probe, val_set)
    print(f"val loss before the stop {loss_before:.4f}, after the restart {loss_after:.4f}")
    assert loss_after == pytest.approx(loss_before, rel=0.03)
    by_stage = lambda infos, stage: [i for i in infos.values() if i.header["stage"] == stage]  # noqa: E731
    # a retry sent without accumulating (see below; CI once in the first run) leaves its stage one
    # micro-batch short of the trainer's samples: the restart must bring back exactly what was reached
    short_before = cfg.training.micro_batch_size * (first["retries_not_accumulated"] > 0)
    for stage in (0, 1):
        reference = by_stage(before, stage)[0]
        assert reference.header["epoch"] == steps, reference.header
        assert FIRST_SAMPLES - short_before <= reference.header["samples_seen"] <= FIRST_SAMPLES, (
            reference.header,
            first,
        )
        for info in by_stage(after, stage):
            reached = (reference.header["epoch"], reference.header["samples_seen"])
            assert (info.header["epoch"], info.header["samples_seen"]) == reached
            for name in reference.tensors:
                assert torch.equal(info.tensor(name), reference.tensor(name)), name

    # the same trainer id again: a new incarnation, accumulated, continuing the data stream
    again.start_trainer("trainer", "--max-samples", "256", "--in-flight", "4")
    assert again.wait_exit("trainer", 300) == 0, again.processes["trainer"].log_text()[-3000:]
    summary = json.loads((again.workdir / "trainer.summary.json").read_text())
    assert summary["start_step"] == steps and summary["data_start_sample"] == FIRST_SAMPLES
    trainer_log = again.processes["trainer"].log_text()[-3000:]
    # a chain whose reply stream ended empty (hivemind, under load; seen once in CI right after the
    # restart) is retried without accumulating at any stage: at most once per stage, the stages then
    # apply one micro-batch fewer, and nothing else may be lost
    assert summary["microbatches_failed"] == 0 and summary["retries_not_accumulated"] <= 2, trainer_log
    short = cfg.training.micro_batch_size * (summary["retries_not_accumulated"] > 0)
    final, _ = _state(probe)  # no loss compared here: none evaluated
    for info in final.values():
        assert info.header["epoch"] == steps + 8, info.header
        assert (
            FIRST_SAMPLES + 256 - short_before - short <= info.header["samples_seen"] <= FIRST_SAMPLES + 256
        ), (
            info.header,
            trainer_log,
        )
