"""GPU memory of training each stage of a cut model, and the fewest stages that fit a GPU.

Per stage, for one micro-batch of B samples in flight (a peer holding m micro-batches needs m x the
activations: pass B x m):

- weights: the working copy in the compute dtype (4 B/param in fp32, 2 B in bf16/fp16);
- gradients: in the compute dtype (4 or 2 B/param);
- optimizer: AdamW's two fp32 moments (8 B/param) plus, with bf16/fp16 compute, the fp32 master weights
  the step updates before casting the working copy back (4 B/param). Either way 16 B/param in all, the
  accounting of mixed-precision Adam in the ZeRO paper (Rajbhandari et al. 2020); an fp32 gradient
  accumulation buffer would add 2 B/param;
- activations: B x `sizes.saved_activation_bytes_per_sample` in the compute dtype (RMSNorm statistics,
  SDPA's logsumexp and the loss stay fp32), what autograd keeps for the backward.

Parameters and their state count unique layers; activations count applied layers (shared layers).
A stage fits a GPU of G GB (1e9 bytes) when its total is at most (1 - headroom) x G: the headroom
(default 10%) stands for the CUDA context, the allocator's fragmentation and the short-lived buffers of
the backward (activation gradients) that the totals leave out. Pure arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarmtrain.config import sizes
from swarmtrain.config.errors import UserError
from swarmtrain.config.model import ModelConfig, StageSpec, partition_layers

GB = 1e9
DEFAULT_HEADROOM = 0.1
DEFAULT_GPU_GB = (16.0, 24.0)
ADAM_MOMENT_BYTES = 2 * sizes.FP32_BYTES


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter and per activation value of one compute dtype."""

    name: str
    compute_bytes: int  # working weights, gradients, activations
    master_bytes: int  # fp32 master weights held by the optimizer (0: the weights are fp32 already)

    @property
    def optimizer_bytes_per_param(self) -> int:
        return self.master_bytes + ADAM_MOMENT_BYTES

    @property
    def bytes_per_param(self) -> int:
        return 2 * self.compute_bytes + self.optimizer_bytes_per_param


PRECISIONS = {
    "fp32": Precision("fp32", sizes.FP32_BYTES, 0),
    "bf16": Precision("bf16", sizes.FP16_BYTES, sizes.FP32_BYTES),
    "fp16": Precision("fp16", sizes.FP16_BYTES, sizes.FP32_BYTES),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r} (choose from: {', '.join(PRECISIONS)})") from None


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs on its GPU to train (see the module docstring)."""

    index: int
    layer_start: int
    layer_end: int
    params: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes

    def as_dict(self) -> dict[str, int]:
        return {
            "index": self.index,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "params": self.params,
            "weight_bytes": self.weight_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "total_bytes": self.total_bytes,
        }


def stage_memory(model: ModelConfig, stage: StageSpec, micro_batch: int, precision: Precision) -> StageMemory:
    if micro_batch <= 0:
        raise UserError(f"micro-batch must be positive, got {micro_batch}")
    params = sizes.params_per_stage(model, stage)
    per_sample = sizes.saved_activation_bytes_per_sample(model, stage, precision.compute_bytes)
    return StageMemory(
        index=stage.index,
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        params=params,
        weight_bytes=params * precision.compute_bytes,
        gradient_bytes=params * precision.compute_bytes,
        optimizer_bytes=params * precision.optimizer_bytes_per_param,
        activation_bytes=micro_batch * per_sample,
    )


def check_cut(model: ModelConfig, stages: Sequence[StageSpec]) -> None:
    """Tied embeddings put the token embedding and the head in one module: one stage only."""
    if model.tie_embeddings and len(stages) > 1:
        raise UserError(f"tied embeddings need the whole model in one stage, got {len(stages)} stages")


def memory_table(
    model: ModelConfig, stages: Sequence[StageSpec], micro_batch: int, precision: Precision
) -> list[StageMemory]:
    check_cut(model, stages)
    return [stage_memory(model, stage, micro_batch, precision) for stage in stages]


def usable_bytes(gpu_gb: float, headroom: float = DEFAULT_HEADROOM) -> float:
    if not gpu_gb > 0:
        raise UserError(f"GPU memory must be positive, got {gpu_gb} GB")
    if not 0 <= headroom < 1:
        raise UserError(f"headroom must be in [0, 1), got {headroom}")
    return gpu_gb * GB * (1 - headroom)


def largest_even_stage_bytes(
    model: ModelConfig, num_stages: int, micro_batch: int, precision: Precision
) -> int:
    """The largest stage total when the layers are cut evenly into `num_stages` stages."""
    stages = partition_layers(model.num_layers, num_stages)
    return max(m.total_bytes for m in memory_table(model, stages, micro_batch, precision))


@dataclass(frozen=True)
class Fit:
    """The fewest evenly cut stages whose largest stage fits one GPU size, and that stage's bytes. When
    no even cut fits (not even one layer per stage, or tied embeddings that do not fit one stage),
    `num_stages` is None and `largest_stage_bytes` is that of the most stages tried."""

    gpu_gb: float
    usable_bytes: float
    num_stages: int | None
    largest_stage_bytes: int

    @property
    def fits(self) -> bool:
        return self.num_stages is not None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "gpu_gb": self.gpu_gb,
            "usable_bytes": self.usable_bytes,
            "num_stages": self.num_stages,
            "largest_stage_bytes": self.largest_stage_bytes,
        }


def fewest_even_stages(
    model: ModelConfig,
    gpu_gb: float,
    micro_batch: int,
    precision: Precision,
    headroom: float = DEFAULT_HEADROOM,
) -> Fit:
    """Scan 1, 2, ... stages (even cuts, earlier stages taking the remainder): every stage's layer count
    never grows with more stages, so the largest stage never grows either and the first fit is the
    fewest. Tied embeddings allow one stage only."""
    limit = usable_bytes(gpu_gb, headroom)
    max_stages = 1 if model.tie_embeddings else model.num_layers
    largest = 0
    for num_stages in range(1, max_stages + 1):
        largest = largest_even_stage_bytes(model, num_stages, micro_batch, precision)
        if largest <= limit:
            return Fit(gpu_gb, limit, num_stages, largest)
    return Fit(gpu_gb, limit, None, largest)
