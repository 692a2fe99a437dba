"""The trainer's validation asks a failed micro-batch again after a pause, and a validation that fails
every round is reported, not raised as a bug (runtime/trainer/swarm_trainer.py: `evaluate`)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.runtime.trainer import swarm_trainer
from swarmtrain.runtime.trainer.call_policy import MicroBatchFailed
from swarmtrain.runtime.trainer.swarm_trainer import (
    EVAL_ROUNDS,
    SwarmTrainer,
    TrainerOptions,
    ValidationFailed,
)

pytestmark = pytest.mark.unit


class Batches:
    """Two validation micro-batches of 2 samples, as `PackedDataset.ordered_batches` yields them."""

    def ordered_batches(self, batch_size: int, max_samples: int):
        for i in range(2):
            yield torch.full((2, 4), i), torch.full((2, 4), i)


def trainer_failing(failures: dict[int, int], monkeypatch) -> tuple[SwarmTrainer, list[str]]:
    """A trainer whose validation micro-batch i fails `failures[i]` times, then answers loss i + 1."""
    monkeypatch.setattr(swarm_trainer, "EVAL_PAUSE_MIN_S", 0.0)
    cfg = get_preset("tiny")
    trainer = SwarmTrainer.__new__(SwarmTrainer)
    trainer.cfg = cfg.replace(swarm=dataclasses.replace(cfg.swarm, announce_period_s=0.001))
    trainer.options, trainer.tracker = TrainerOptions(trainer_id="t"), None
    asked: list[str] = []
    trainer.versions = []  # the step each validation micro-batch named

    async def evaluate_one(mb, n, inputs, labels, version):
        asked.append(mb)
        trainer.versions.append(version)
        i = int(inputs[0, 0])
        if failures.get(i, 0) > 0:
            failures[i] -= 1
            raise MicroBatchFailed(f"stage 0 evaluation of {mb}: 6 attempts failed")
        return float(i + 1)

    trainer._evaluate_one = evaluate_one
    return trainer, asked


def test_a_micro_batch_that_failed_is_asked_again_and_counts_once(monkeypatch):
    trainer, asked = trainer_failing({0: EVAL_ROUNDS - 1}, monkeypatch)
    loss = asyncio.run(trainer.evaluate(Batches(), 4))
    assert loss == pytest.approx((1.0 * 2 + 2.0 * 2) / 4)
    assert [mb.rsplit("-", 1)[1] for mb in asked] == ["eval0"] * EVAL_ROUNDS + ["eval1"]


def test_a_micro_batch_failing_every_round_is_a_validation_failure_naming_it(monkeypatch):
    trainer, asked = trainer_failing({1: EVAL_ROUNDS}, monkeypatch)
    with pytest.raises(ValidationFailed, match=rf"eval1: {EVAL_ROUNDS} rounds failed, last: stage 0"):
        asyncio.run(trainer.evaluate(Batches(), 4))
    assert len(asked) == 1 + EVAL_ROUNDS


def test_a_named_step_reaches_every_micro_batch_and_none_names_none(monkeypatch):
    """A probe that never trained names the swarm's step (bench/chaos.py), so a replica still behind it
    waits instead of answering on older parameters; without one, no step is named."""
    trainer, _ = trainer_failing({}, monkeypatch)
    asyncio.run(trainer.evaluate(Batches(), 4, step=17))
    asyncio.run(trainer.evaluate(Batches(), 4))
    assert trainer.versions == [17, 17, None, None]
