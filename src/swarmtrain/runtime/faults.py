"""Fault hooks for tests: a faulty peer, described by one object passed into the server or replica.

A byzantine stage replica's gradient sums come out scaled (`grad_scale`) and every k-th step it sends
NaN instead (`nan_every`); a DiLoCo replica does the same to its pseudo-gradients, and its averager can
reduce its n-th all-reduce but send no results back (`drop_results_in`), as a broken result stream does.

No production command can make a peer faulty: `swarmtrain server` and `swarmtrain replica` always run
with `NO_FAULTS`, and nothing reads fault settings from the environment. Tests start a faulty peer
through the harness (`LocalSwarm.start_server(..., faults=FaultHooks(...))`), which launches it with the
test-only entry point `swarmtrain.cli.faulty`; the runtime receives the hooks as an argument. The
default object has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FaultHooks:
    grad_scale: float = 1.0
    nan_every: int = 0  # every k-th step or round is sent as NaN; 0: never
    drop_results_in: int = 0  # the all-reduce (1-based) whose results are withheld; 0: none

    def as_args(self) -> list[str]:
        """The options of `swarmtrain.cli.faulty` that describe these hooks."""
        return [
            f"--grad-scale={self.grad_scale!r}",
            f"--nan-every={self.nan_every}",
            f"--drop-results-in={self.drop_results_in}",
        ]

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
