"""Compression-aware stage boundaries (`[model] boundary`): layers that narrow the hidden state a stage
sends to the next one from `d_model` to `boundary_dim` values per token, learned with the model.

Boundary k sits between stage k and stage k+1. Its `down` half ends stage k (what goes on the wire is
its output) and its `up` half starts stage k+1, so the names are global (`boundaries.<k>.down.weight`)
and a whole model (train-local, replicas, checkpoints) holds both halves at the same cuts and computes
exactly what the stages compute. Three kinds:

- `bottleneck` (SWARM's compression-aware bottleneck): down = Linear(d, r), up = Linear(r, d), both
  initialized like any other weight (normal, `init_std`); the residual stream is cut at the boundary.
- `maxout` (SWARM's maxout variant): down = Linear(d, 2r) and the max of each pair of outputs (a
  learned piecewise-linear compression), up = Linear(r, d).
- `lowrank` (a low-rank boundary with a residual path, after Subspace Networks and ResBM): down =
  x @ P and up = z @ Q.T, without biases, where P and Q start as the same d x r matrix with orthonormal
  columns. At initialization, up(down(x)) is the projection of x onto P's subspace: the residual
  stream's component there crosses the boundary unchanged (an identity path for values and gradients),
  and training moves P and Q apart where that helps. P and Q are separate parameters because they sit
  on different stages (tying them would need their gradients combined across stages every step, which
  the swarm does not do, as for tied embeddings).

Each boundary's parameters are initialized from (seed, its name), as every other parameter is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from swarmtrain.config.model import ModelConfig

MAXOUT_PIECES = 2


class Down(nn.Module):
    """The sending half: (..., d_model) -> (..., boundary_dim)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.boundary
        width = cfg.boundary_dim * (MAXOUT_PIECES if self.kind == "maxout" else 1)
        self.proj = nn.Linear(cfg.d_model, width, bias=self.kind != "lowrank")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        if self.kind == "maxout":
            z = z.unflatten(-1, (-1, MAXOUT_PIECES)).amax(dim=-1)
        return z


class Up(nn.Module):
    """The receiving half: (..., boundary_dim) -> (..., d_model)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.boundary_dim, cfg.d_model, bias=cfg.boundary != "lowrank")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(z)


class Boundary(nn.Module):
    """Boundary k's halves that one module holds: `down` on stage k, `up` on stage k+1, both in a whole
    model."""

    down: Down | None
    up: Up | None

    def __init__(self, cfg: ModelConfig, down: bool, up: bool) -> None:
        super().__init__()
        self.down = Down(cfg) if down else None
        self.up = Up(cfg) if up else None

    def send(self, x: torch.Tensor) -> torch.Tensor:
        if self.down is None:
            raise RuntimeError("this module holds no down half of the boundary")
        return self.down(x)

    def receive(self, z: torch.Tensor) -> torch.Tensor:
        if self.up is None:
            raise RuntimeError("this module holds no up half of the boundary")
        return self.up(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.receive(self.send(x))


def init_boundaries(boundaries: nn.ModuleDict, cfg: ModelConfig, seed_of: Callable[[str], int]) -> None:
    """`lowrank`: both halves of boundary k from one orthonormal d x r matrix drawn from `seed_of(k)`, so the
    stage that holds `down` and the one that holds `up` start from the same subspace. The other kinds
    keep the architecture's initialization."""
    if cfg.boundary != "lowrank":
        return
    for key, module in boundaries.items():
        boundary = cast(Boundary, module)
        generator = torch.Generator().manual_seed(seed_of(key))
        basis, _ = torch.linalg.qr(torch.randn(cfg.d_model, cfg.boundary_dim, generator=generator))
        with torch.no_grad():
            if boundary.down is not None:
                boundary.down.proj.weight.copy_(basis.T)  # (r, d): x @ P
            if boundary.up is not None:
                boundary.up.proj.weight.copy_(basis)  # (d, r): z @ Q.T
