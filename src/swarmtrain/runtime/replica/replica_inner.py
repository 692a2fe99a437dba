"""One asynchronous replica's local training (its inner loop), and DiLoCo run in one process.

`InnerTrainer` is what `swarmtrain replica` runs between outer steps: the whole model on this
replica's data shard, `training.global_batch_size / N` samples per inner step, AdamW with the
learning rate of the global step, global-norm clipping: `train-local`'s step (`local.optimizer_step`)
on a smaller batch. `diloco_reference` runs N such replicas in one process with exact averaging, the
reference the live replicas and the benchmark compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import ConfigError
from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.model import build_model
from swarmtrain.model.device import CPU_FP32, ComputeDevice
from swarmtrain.model.diloco import OuterOptimizer
from swarmtrain.model.hf_checkpoint import load_stage_from_hf
from swarmtrain.model.optim import build_optimizer, lr_at
from swarmtrain.offload.whole_model import SwappedGPT
from swarmtrain.runtime.local import optimizer_step, validation_loss


def replica_batch_samples(cfg: RunConfig, shard_count: int) -> int:
    """Samples per inner step of one of `shard_count` replicas: whole micro-batches of the global batch."""
    t = cfg.training
    per_replica, rest = divmod(t.global_batch_size, shard_count)
    if rest or per_replica % t.micro_batch_size:
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must split into {shard_count} replica "
            f"shards of whole micro-batches of {t.micro_batch_size}"
        )
    return per_replica


class InnerTrainer:
    """The whole model, its AdamW and this shard's data stream; `step` is the global inner step number,
    which sets both the learning rate and the position in the shard's data."""

    def __init__(
        self,
        cfg: RunConfig,
        shard_index: int = 0,
        shard_count: int = 1,
        datasets=None,
        swap_budget_bytes: float | None = None,
        compute: ComputeDevice = CPU_FP32,
        init_from_hf: str | None = None,
    ) -> None:
        """`compute`: the device the model trains on and the autocast dtype. `swap_budget_bytes`: keep
        the model in host memory and stream the blocks through `compute.device` in groups that fit this
        budget (offload/whole_model.py; fp32 only) instead of holding the model resident there. `init_from_hf`: a Hugging Face
        model directory whose weights replace the seed's (a joiner still downloads the swarm's state)."""
        self.cfg = cfg
        self.batch_samples = replica_batch_samples(cfg, shard_count)
        self.shard_index, self.shard_count = shard_index, shard_count
        self.model = build_model(cfg.model, seed=cfg.training.seed, cuts=cfg.boundary_cuts())
        if init_from_hf is not None:  # before the optimizer and the outer step's anchor copy them
            load_stage_from_hf(self.model, init_from_hf)
        if swap_budget_bytes and compute.mixed:
            raise ConfigError("the layer swapper computes in fp32: use --dtype fp32 with --offload-budget-mb")
        if swap_budget_bytes and (self.model.boundaries or self.model.space is not None):
            # SwappedGPT streams the blocks and runs embed and head around them, no boundary layers
            raise ConfigError(
                "the layer swapper does not run boundary layers ([model] boundary): drop --offload-budget-mb"
            )
        # swapped: the model stays in host memory and only the blocks visit the device
        self.compute = ComputeDevice(torch.device("cpu"), compute.dtype) if swap_budget_bytes else compute
        self.model.to(self.compute.device)  # before the optimizer makes its state beside the parameters
        self.scaler = self.compute.grad_scaler()
        self.optimizer = build_optimizer(self.model, cfg.training)
        self.train_set, self.val_set = datasets or build_datasets(cfg)
        self.step = 0
        self._batches = self._stream(0)
        self.swapped = (
            SwappedGPT(
                self.model, swap_budget_bytes, compute.device, micro_batch_size=cfg.training.micro_batch_size
            )
            if swap_budget_bytes
            else None
        )

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _stream(self, step: int):
        t = self.cfg.training
        return iterate_batches(
            self.train_set,
            t.micro_batch_size,
            seed=t.seed,
            shard_index=self.shard_index,
            shard_count=self.shard_count,
            skip_samples=step * self.batch_samples,
        )

    def seek(self, step: int) -> None:
        """Continue at global inner step `step` (a joiner adopting the swarm's position)."""
        self.step = step
        self._batches = self._stream(step)

    def train_step(self) -> float:
        t = self.cfg.training
        accumulation = self.batch_samples // t.micro_batch_size
        lr = lr_at(self.step * t.global_batch_size, t)
        swapped = self.swapped.loss_and_backward if self.swapped is not None else None
        loss = optimizer_step(
            self.model,
            self.optimizer,
            self._batches,
            accumulation,
            lr,
            t,
            swapped,
            compute=self.compute,
            scaler=self.scaler,
        )
        self.step += 1
        return loss

    def val_loss(self, max_samples: int | None = None) -> float:
        t = self.cfg.training
        return validation_loss(
            self.model, self.val_set, t.micro_batch_size, max_samples or t.eval_samples, self.compute
        )


@dataclass(frozen=True)
class DilocoReferenceResult:
    val_loss: float
    inner_steps: int
    outer_steps: int
    samples: int


def diloco_reference(cfg: RunConfig, replicas: int, total_samples: int, eval_samples: int | None = None):
    """N replicas in one process, averaging exactly (mean of equal-weight pseudo-gradients) every
    `diloco.inner_steps` inner steps, until the run has trained `total_samples` (rounded down to whole
    global steps); the validation loss of the resulting weights (all replicas hold the same)."""
    d = cfg.diloco
    datasets = build_datasets(cfg)
    trainers = [InnerTrainer(cfg, k, replicas, datasets) for k in range(replicas)]
    outers = [OuterOptimizer(tr.params(), d.outer_learning_rate, d.outer_momentum) for tr in trainers]
    steps = total_samples // cfg.training.global_batch_size
    for step in range(1, steps + 1):
        for trainer in trainers:
            trainer.train_step()
        if step % d.inner_steps == 0 or step == steps:
            _average_exactly(outers)
    return DilocoReferenceResult(
        val_loss=trainers[0].val_loss(eval_samples),
        inner_steps=steps,
        outer_steps=outers[0].outer_step,
        samples=steps * cfg.training.global_batch_size,
    )


def _average_exactly(outers: list[OuterOptimizer]) -> None:
    deltas = [outer.pseudo_gradients() for outer in outers]
    mean = [torch.stack(group).mean(dim=0) for group in zip(*deltas, strict=True)]
    for outer in outers:
        outer.apply(mean)
