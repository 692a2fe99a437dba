"""Compression-aware stage boundaries (`[model] boundary`): layers that narrow the hidden state a stage
sends to the next one from `d_model` to `boundary_dim` values per token, learned with the model.

Boundary k sits between stage k and stage k+1. Its `down` half ends stage k (what goes on the wire is
its output) and its `up` half starts stage k+1, so the names are global (`boundaries.<k>.down.weight`)
and a whole model (train-local, replicas, checkpoints) holds both halves at the same cuts and computes
exactly what the stages compute. Four kinds:

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
- `lowrank-embed`: `lowrank`, and the boundary before the last stage also re-adds what a low-rank cut
  drops first, the identity of each position's token (after Subspace Networks, which re-inject token
  embeddings after a compressed layer): up = z @ Q.T + T[current token], with T an embedding of its own
  (vocab_size + 1 rows, zero at start, so the model starts as `lowrank`). The last stage knows the
  tokens without a byte more on the wire: it receives the labels, and the current token at position t
  is the label at t - 1 (samples are windows of one token stream, data/packing.py); position 0 reads the
  extra row ("unknown"). A whole model reads the same ids from its inputs. Boundaries before a middle
  stage are plain `lowrank`: a middle stage receives no token ids.

Each boundary's parameters are initialized from (seed, its name), as every other parameter is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from swarmtrain.config.model import ModelConfig

MAXOUT_PIECES = 2
LOWRANK_KINDS = ("lowrank", "lowrank-embed")  # x @ P and z @ Q.T, no biases, from one orthonormal basis


def current_ids_from_inputs(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A whole model's current-token ids for a `lowrank-embed` boundary: its inputs, with position 0
    unknown (row vocab_size), as the last stage sees them (`current_ids_from_labels`)."""
    ids = token_ids.clone()
    ids[..., 0] = vocab_size
    return ids


def current_ids_from_labels(labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The last stage's current-token ids: the label of the position before (samples are windows of one
    token stream), position 0 and any label outside the vocabulary (an ignored one) unknown."""
    ids = labels.roll(1, dims=-1)
    ids[..., 0] = vocab_size
    return ids.masked_fill((ids < 0) | (ids >= vocab_size), vocab_size)


class Down(nn.Module):
    """The sending half: (..., d_model) -> (..., boundary_dim)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.boundary
        width = cfg.boundary_dim * (MAXOUT_PIECES if self.kind == "maxout" else 1)
        self.proj = nn.Linear(cfg.d_model, width, bias=self.kind not in LOWRANK_KINDS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        if self.kind == "maxout":
            z = z.unflatten(-1, (-1, MAXOUT_PIECES)).amax(dim=-1)
        return z


class Up(nn.Module):
    """The receiving half: (..., boundary_dim) -> (..., d_model); with `tokens` (a `lowrank-embed`
    boundary before the last stage) plus the current tokens' own embedding."""

    tokens: nn.Embedding | None

    def __init__(self, cfg: ModelConfig, tokens: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.boundary_dim, cfg.d_model, bias=cfg.boundary not in LOWRANK_KINDS)
        self.tokens = nn.Embedding(cfg.vocab_size + 1, cfg.d_model) if tokens else None

    def forward(self, z: torch.Tensor, current_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.proj(z)
        if self.tokens is None:
            return x
        if current_ids is None:
            raise ValueError("a lowrank-embed boundary's last stage needs the labels (its tokens' context)")
        return x + self.tokens(current_ids)


class Boundary(nn.Module):
    """Boundary k's halves that one module holds: `down` on stage k, `up` on stage k+1, both in a whole
    model."""

    down: Down | None
    up: Up | None

    def __init__(self, cfg: ModelConfig, down: bool, up: bool, tokens: bool = False) -> None:
        """`tokens`: the up half re-adds the current tokens' embedding (`lowrank-embed`, the boundary
        before the last stage)."""
        super().__init__()
        self.down = Down(cfg) if down else None
        self.up = Up(cfg, tokens) if up else None

    def send(self, x: torch.Tensor) -> torch.Tensor:
        if self.down is None:
            raise RuntimeError("this module holds no down half of the boundary")
        return self.down(x)

    def receive(self, z: torch.Tensor, current_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.up is None:
            raise RuntimeError("this module holds no up half of the boundary")
        return self.up(z, current_ids)

    def forward(self, x: torch.Tensor, current_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.receive(self.send(x), current_ids)


def init_boundaries(boundaries: nn.ModuleDict, cfg: ModelConfig, seed_of: Callable[[str], int]) -> None:
    """`lowrank`, `lowrank-embed`: both halves of boundary k from one orthonormal d x r matrix drawn from
    `seed_of(k)`, so the stage that holds `down` and the one that holds `up` start from the same
    subspace; a token embedding starts at zero. The other kinds keep the architecture's initialization."""
    if cfg.boundary not in LOWRANK_KINDS:
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
                if boundary.up.tokens is not None:
                    boundary.up.tokens.weight.zero_()
