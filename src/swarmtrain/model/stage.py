"""What every architecture's stage shares: the pass through its layers (repeated when layers are shared),
the head and the loss, and deterministic per-parameter initialization.

A stage holds global layers [a, b) of the model. The first stage also embeds tokens; the last stage also
holds the final norm, the LM head and the loss. A whole model is the single stage covering every layer,
so the local reference and the swarm run exactly the same code.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config.model import SUBSPACE, ModelConfig, StageSpec
from swarmtrain.model.boundary import Boundary, current_ids_from_inputs, current_ids_from_labels
from swarmtrain.model.subspace import Subspace, confined_block, split_inputs


class DecoderStage(nn.Module):
    """forward(inputs, labels=None, logits_only=False):
      - first stage: `inputs` are token ids (batch, seq) int64; other stages: hidden states (batch, seq, d).
      - last stage with labels: the mean next-token loss over labels != cfg.pad_token_id;
        last stage without labels, or with logits_only: logits; other stages: hidden states.

    Subclasses build their modules and provide `layers` (a ModuleDict keyed by global layer index),
    `embed(token_ids)` and `head(hidden) -> logits`. With subspace boundaries (model/subspace.py) a stage
    after the first takes (batch, seq, k + 1): coordinates and token ids; a stage before the last
    returns coordinates; `embed` gives the learned k coordinates and the layers in `subspace_layers`
    write k values (each family sizes them by `embed_dim` and `write_dim`).
    """

    layers: nn.ModuleDict
    space: Subspace | None

    def __init__(self, cfg: ModelConfig, spec: StageSpec, cuts: tuple[int, ...] = ()) -> None:
        """`cuts`: for a whole model (one stage) of a run whose stages are cut with boundary layers
        (`[model] boundary`), the first global layer of every stage but the first; boundary k sits
        before layer cuts[k]."""
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.boundaries, self._crossings = _boundaries(cfg, spec, cuts)
        self.space = Subspace(cfg) if cfg.boundary == SUBSPACE else None
        self.subspace_layers = _confined_layers(cfg, spec, cuts)

    @property
    def embed_dim(self) -> int:
        """Width of the learned token embedding: k coordinates with subspace boundaries, else d_model."""
        return self.cfg.boundary_dim if self.space is not None else self.cfg.d_model

    def write_dim(self, layer: int) -> int:
        """Outputs of global layer `layer`'s residual writes: k where it is confined to the subspace."""
        return self.cfg.boundary_dim if layer in self.subspace_layers else self.cfg.d_model

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, inputs: torch.Tensor, labels: torch.Tensor | None = None, logits_only: bool = False
    ) -> torch.Tensor:
        """`logits_only`: the last stage returns its logits even when given labels (which a
        `lowrank-embed` boundary reads as its tokens' context), for callers that take each request's
        loss from one batch's logits."""
        if self.space is not None:
            x = self._subspace_pass(inputs, self.space)
            if not self.spec.is_last:
                return x  # the coordinates
        else:
            x = self._pass(inputs, labels)
            if not self.spec.is_last:
                return self._boundary(self.spec.index).send(x) if self.cfg.boundary != "none" else x
        logits = self.head(x)
        return logits if labels is None or logits_only else self.loss(logits, labels)

    def _pass(self, inputs: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The hidden state after this stage's layers (and its whole-model boundary layers)."""
        current_ids = self._current_ids(inputs, labels)
        x = self.embed(inputs) if self.spec.is_first else inputs
        if not self.spec.is_first and self.cfg.boundary != "none":
            x = self._boundary(self.spec.index - 1).receive(x, current_ids)
        for key, block in self.layers.items():
            x = self._cross(x, int(key), current_ids)
            # shared layers (SWARM, ALBERT): each unique layer applied `shared_layer_repeats` times in a
            # row, so the function does not depend on where the stages are cut (a whole model in one
            # process computes what the swarm's stages do) and unrolls to a plain deep model
            for _ in range(self.cfg.shared_layer_repeats):
                x = block(x)
        return self._cross(x, self.spec.layer_end, current_ids)

    def _subspace_pass(self, inputs: torch.Tensor, space: Subspace) -> torch.Tensor:
        """Subspace boundaries: coordinates through the confined layers, then (the last stage, or a whole
        model past its last cut) the rebuilt hidden state through the full-rank ones. Returns the
        coordinates on a stage before the last, the hidden state on the last."""
        if self.spec.is_first:
            token_ids, coords = inputs, self.embed(inputs)
        else:
            coords, token_ids = split_inputs(inputs)
        fixed = space.table[token_ids]  # E0 of each position's token
        x = None
        for key, block in self.layers.items():
            confined = int(key) in self.subspace_layers
            if not confined and x is None:
                x = space.rebuild(fixed, coords)
            for _ in range(self.cfg.shared_layer_repeats):
                if confined:
                    coords = confined_block(block, space, fixed, coords)
                else:
                    x = block(x)
        if not self.spec.is_last:
            return coords
        return space.rebuild(fixed, coords) if x is None else x

    @property
    def reads_labels(self) -> bool:
        """Whether this stage's forward reads its labels before the loss: the last stage (not a whole
        model) behind a `lowrank-embed` boundary, which re-embeds the current tokens from them. Callers
        that take losses from logits pass labels only then, so no other stage copies them."""
        return self.cfg.boundary == "lowrank-embed" and self.spec.is_last and not self.spec.is_first

    def _current_ids(self, inputs: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
        """The current tokens a `lowrank-embed` boundary re-embeds (model/boundary.py): a whole model's
        inputs, the last stage's labels shifted by one; None where no boundary reads them."""
        if self.cfg.boundary != "lowrank-embed" or not self.spec.is_last:
            return None
        if self.spec.is_first:
            return current_ids_from_inputs(inputs, self.cfg.vocab_size)
        return None if labels is None else current_ids_from_labels(labels, self.cfg.vocab_size)

    def _boundary(self, index: int) -> Boundary:
        return cast(Boundary, self.boundaries[str(index)])

    def _cross(self, x: torch.Tensor, position: int, current_ids: torch.Tensor | None) -> torch.Tensor:
        """A whole model's boundaries that sit before global layer `position` (down, then up)."""
        for key in self._crossings.get(position, ()):
            x = self.boundaries[key](x, current_ids)
        return x

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of `logits` over labels != cfg.pad_token_id (computed in fp32)."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.cfg.pad_token_id,
        )


def _boundaries(
    cfg: ModelConfig, spec: StageSpec, cuts: tuple[int, ...]
) -> tuple[nn.ModuleDict, dict[int, list[str]]]:
    """The boundary halves a module holds, under global keys, and for a whole model where each sits."""
    if cfg.boundary in ("none", SUBSPACE):  # subspace boundaries have no layers of their own
        return nn.ModuleDict(), {}
    embeds = cfg.boundary == "lowrank-embed"  # only the boundary before the last stage (it has the labels)
    if spec.num_stages > 1:
        halves = {}
        if not spec.is_first:
            halves[str(spec.index - 1)] = Boundary(cfg, down=False, up=True, tokens=embeds and spec.is_last)
        if not spec.is_last:
            halves[str(spec.index)] = Boundary(cfg, down=True, up=False)
        return nn.ModuleDict(halves), {}
    crossings: dict[int, list[str]] = {}
    for k, position in enumerate(cuts):
        crossings.setdefault(position, []).append(str(k))
    boundaries = {
        str(k): Boundary(cfg, down=True, up=True, tokens=embeds and k == len(cuts) - 1)
        for k in range(len(cuts))
    }
    return nn.ModuleDict(boundaries), crossings


def _confined_layers(cfg: ModelConfig, spec: StageSpec, cuts: tuple[int, ...]) -> frozenset[int]:
    """The global layers whose residual writes live in the subspace: every layer of a stage before the
    last (its output crosses a boundary), and a whole model's layers before its last cut."""
    if cfg.boundary != SUBSPACE:
        return frozenset()
    if spec.num_stages > 1:
        return frozenset() if spec.is_last else frozenset(range(spec.layer_start, spec.layer_end))
    return frozenset(range(cuts[-1])) if cuts else frozenset()


def init_parameters(module: nn.Module, seed: int | None, std_of: Callable[[str], float | None]) -> None:
    """Fill each parameter deterministically from (seed, its global name), so stages built separately
    from one seed equal the corresponding slice of a whole model built from it. `std_of(name)` gives a
    normal's standard deviation, or None for a norm weight (ones) or a bias (zeros)."""
    for name, param in module.named_parameters():
        generator = torch.Generator().manual_seed(name_seed(seed, name)) if seed is not None else None
        std = std_of(name)
        with torch.no_grad():
            if std is None:
                param.zero_() if name.endswith("bias") else param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def name_seed(seed: int | None, name: str) -> int:
    """The seed of the generator that initializes the parameter (or group) `name`."""
    return (int(seed or 0) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
