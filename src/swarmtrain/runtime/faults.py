"""Fault hooks for tests: a faulty peer, described by one object passed into the server or replica.

A byzantine stage replica's gradient sums come out scaled (`grad_scale`) and every k-th step it sends
NaN instead (`nan_every`); a DiLoCo replica does the same to its pseudo-gradients, and its averager can
reduce its n-th all-reduce but send no results back (`drop_results_in`), as a broken result stream does.

Only the command line reads the environment (`FaultHooks.from_environ`, in `cli/server.py` and
`cli/replica.py`), so a test can make one process of a swarm faulty; the runtime receives the hooks as
an argument and never looks at environment variables. The default object has no effect.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SCALE_ENV = "SWARMTRAIN_FAULT_GRAD_SCALE"
NAN_EVERY_ENV = "SWARMTRAIN_FAULT_NAN_GRADS_EVERY"
DROP_RESULTS_ENV = "SWARMTRAIN_FAULT_DROP_RESULTS_IN"


@dataclass(frozen=True)
class FaultHooks:
    grad_scale: float = 1.0
    nan_every: int = 0  # every k-th step or round is sent as NaN; 0: never
    drop_results_in: int = 0  # the all-reduce (1-based) whose results are withheld; 0: none

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> FaultHooks:
        return cls(
            grad_scale=float(environ.get(SCALE_ENV, "1")),
            nan_every=int(environ.get(NAN_EVERY_ENV, "0")),
            drop_results_in=int(environ.get(DROP_RESULTS_ENV, "0")),
        )

    def sends_nan(self, index: int) -> bool:
        """Whether step or round `index` is one this faulty peer sends as NaN."""
        return bool(self.nan_every) and index % self.nan_every == 0

    def corrupted(self, tensors: list[torch.Tensor], index: int) -> list[torch.Tensor]:
        """What a faulty peer sends for step or round `index` (the tensors themselves when healthy)."""
        if self.sends_nan(index):
            return nan_like(tensors)
        if self.grad_scale != 1.0:
            return [t * self.grad_scale for t in tensors]
        return tensors


NO_FAULTS = FaultHooks()


def nan_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(t, float("nan")) for t in tensors]
