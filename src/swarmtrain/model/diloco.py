"""DiLoCo's outer step (Douillard et al. 2023): replicas train locally for H inner steps, then apply the
average of their pseudo-gradients (weights at the round's start minus weights now) to the round's
starting weights with Nesterov-momentum SGD, and continue from the result.

The same object serves a whole-model replica (`swarmtrain replica`) and one stage's replicas taking
local steps inside SWARM; it knows nothing about the network: the caller averages the pseudo-gradients
(weighted by samples) and hands the mean back. Every replica that applies the same mean to the same
anchor with the same momentum ends with bitwise-equal weights, which is what lets replicas compare
fingerprints and a joiner copy the outer state of any peer.

The anchor and the momentum live in host memory whatever device the live weights are on: the averagers
(hivemind's all-reduce, the stage exchange) and state downloads work on host tensors, and the outer step
runs once per round, so its copies cost little next to H inner steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterOptimizer:
    """Holds the anchor (the weights every replica agreed on at the start of the round) and the outer
    momentum; `params` are the live weights the inner optimizer trains."""

    def __init__(self, params: Sequence[torch.Tensor], learning_rate: float, momentum: float) -> None:
        self.params = list(params)
        self.anchor = [p.detach().to("cpu", copy=True) for p in self.params]
        self.optimizer = torch.optim.SGD(
            self.anchor, lr=learning_rate, momentum=momentum, nesterov=momentum > 0
        )
        self.outer_step = 0

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """anchor - params: the direction the inner steps moved against, per parameter."""
        return [a - p.detach().to(a.device) for a, p in zip(self.anchor, self.params, strict=True)]

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> None:
        """One outer step with the round's mean pseudo-gradient; the live weights restart from it."""
        if not all(bool(torch.isfinite(g).all()) for g in averaged):
            # every replica sees the same mean, so all skip it and stay equal; their inner progress
            # of this round is dropped rather than spreading non-finite weights
            self.reset_params()
            self.outer_step += 1
            return
        for anchor, grad in zip(self.anchor, averaged, strict=True):
            anchor.grad = grad.to(device=anchor.device, dtype=anchor.dtype, copy=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.reset_params()
        self.outer_step += 1

    @torch.no_grad()
    def rebase(self) -> None:
        """A round nobody else joined: the live weights become the anchor as they are (an outer step
        on one replica's own pseudo-gradient would only rescale its progress)."""
        for anchor, param in zip(self.anchor, self.params, strict=True):
            anchor.copy_(param.detach())
        self.outer_step += 1

    @torch.no_grad()
    def reset_params(self) -> None:
        for param, anchor in zip(self.params, self.anchor, strict=True):
            param.copy_(anchor)

    # state shared with joining replicas ------------------------------------------------------------
    def momentum_buffers(self) -> list[torch.Tensor]:
        """One buffer per anchor tensor (zeros before the first outer step with momentum)."""
        buffers = []
        for anchor in self.anchor:
            buffer = self.optimizer.state.get(anchor, {}).get("momentum_buffer")
            buffers.append(buffer if buffer is not None else torch.zeros_like(anchor))
        return buffers

    @torch.no_grad()
    def load(self, anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], outer_step: int) -> None:
        """Adopt another replica's outer state; the live weights restart from its anchor."""
        if len(anchor) != len(self.anchor) or len(momentum) != len(self.anchor):
            raise ValueError(
                f"outer state has {len(anchor)}/{len(momentum)} tensors, expected {len(self.anchor)}"
            )
        for mine, theirs in zip(self.anchor, anchor, strict=True):
            if mine.shape != theirs.shape:
                raise ValueError(f"outer state shape {tuple(theirs.shape)} != {tuple(mine.shape)}")
            mine.copy_(theirs)
        if self.optimizer.defaults["momentum"] > 0:
            for mine, buffer in zip(self.anchor, momentum, strict=True):
                # where the anchor is (the host): a replica on CUDA passes buffers made like its parameters
                buffer = buffer.detach().to(device=mine.device, dtype=mine.dtype, copy=True)
                self.optimizer.state[mine]["momentum_buffer"] = buffer
        self.outer_step = int(outer_step)
        self.reset_params()
