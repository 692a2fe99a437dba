"""A faulty replica for tests, switched on by environment variables of its process: its gradient sums
(stage servers) or pseudo-gradients (replicas) come out scaled (SWARMTRAIN_FAULT_GRAD_SCALE), and every
k-th step or round it sends NaN instead (SWARMTRAIN_FAULT_NAN_GRADS_EVERY=k). A replica's averager can
also reduce its n-th all-reduce but send no results back (SWARMTRAIN_FAULT_DROP_RESULTS_IN=n), as a broken
result stream does. Unset: no effect."""

from __future__ import annotations

import os

import torch

SCALE_ENV = "SWARMTRAIN_FAULT_GRAD_SCALE"
NAN_EVERY_ENV = "SWARMTRAIN_FAULT_NAN_GRADS_EVERY"
DROP_RESULTS_ENV = "SWARMTRAIN_FAULT_DROP_RESULTS_IN"


def grad_scale() -> float:
    return float(os.environ.get(SCALE_ENV, "1"))


def drop_results_in() -> int:
    """The all-reduce (1-based) whose results this replica's averager withholds; 0: none."""
    return int(os.environ.get(DROP_RESULTS_ENV, "0"))


def sends_nan(index: int) -> bool:
    """Whether step or round `index` is one this faulty replica sends as NaN."""
    every = int(os.environ.get(NAN_EVERY_ENV, "0"))
    return bool(every) and index % every == 0


def nan_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(t, float("nan")) for t in tensors]


def corrupted(tensors: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    """What a faulty replica sends for step or round `index` (the tensors themselves when healthy)."""
    if sends_nan(index):
        return nan_like(tensors)
    scale = grad_scale()
    return [t * scale for t in tensors] if scale != 1.0 else tensors
