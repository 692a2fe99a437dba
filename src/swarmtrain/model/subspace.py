"""Exact subspace boundaries (`[model] boundary = "subspace"`, after Subspace Networks, "Protocol
Models", arXiv 2506.01260): on every stage but the last, the residual stream is by construction

    x = E0[token] + c @ B.T

with E0 a fixed full-rank token table (vocab_size x d_model, never trained), B a fixed d_model x k basis
with orthogonal columns of norm sqrt(d_model / k) (k = `boundary_dim`) and c the position's k coordinates.

Reparametrized, not projected after each optimizer step: the learned token embedding (and GPT's learned
positions) holds k coordinates per row, and every residual write of those stages (attention's output
projection, the MLP's down projection, GPT's biases too) has k outputs that B maps into the stream. A
stage keeps c, not x, as its state: each sub-layer reads x = E0[ids] + c @ B.T afresh and adds its k
outputs to c (`confined_block`). So a boundary sends c (k values per token, in the run's codec) and the
token ids (integers, never compressed), and the receiver computes the very x the sender would have, bit
for bit; the gradient that crosses back is dL/dc = dL/dx @ B, k wide.

Norms (LayerNorm, RMSNorm), attention and the MLP's input projections read the full x, token identity
included through E0, so nothing inside a block changes; only what a block writes is confined. The last
stage's layers write at full rank (their output crosses no boundary), and so do the layers of a whole
model (train-local, replicas) after its last cut (`DecoderStage.subspace_layers`).

Scales (both fixed functions of the config, so in the run's digest through it): B's columns have norm
sqrt(d_model / k), not 1, so a k-wide write (or coordinate row) of given values puts as much into the
stream as a d_model-wide one does in the plain model: with orthonormal columns a k-wide write has k / d_model
of a random d_model-wide write's energy, and AdamW, which moves every value by about the learning rate,
moved the coordinates' contribution sqrt(d_model / k) times slower than a plain model's (the same as a
learning-rate multiplier of sqrt(d_model / k) on the coordinate parameters, with their initial writes at
the plain model's scale). E0 is drawn at `TABLE_SCALE` = 8 x init_std: at init_std (a learned
embedding's start) the token identity the confined layers and the last stage read was small next to what
the layers write. Measured with train-local at 8,192 samples (docs/LOG.md, "Subspace scales"): the loss
gap to the plain model went from +9.6% to +5.1% (`llama-tiny` k=4, mean of 3 seeds), +7.5% to +5.0% (k=8,
2 seeds) and +2.9% to +1.8% (`tiny` k=4, 4 seeds); chosen on d_model = 64 only. `fold_subspace` folds
them like any B and E0.

E0 and B come from the run's seed (`training.seed`, in the digest) and fixed names (`fixed_parts`), so
every stage builds the same ones. E0 can instead come from a file (`[model] boundary_table`, its content
in the digest): a table of the training data's token co-occurrences (data/token_table.py, `swarmtrain
boundary-table`), whose rows place tokens used alike near each other; on `llama-tiny` it closes the loss
gap to the plain model that a random E0 leaves (docs/LOG.md, "A fixed token table from the data"). They are non-persistent buffers: never in a checkpoint, a gradient
exchange or the optimizer. Cost: E0 (vocab_size x d_model fp32) on every stage, which rebuilds x from it.

A stage after a subspace boundary takes its coordinates and token ids as one float tensor (batch, seq,
k + 1), the ids in the last column, exact in fp32 below `MAX_SUBSPACE_VOCAB` (`split_inputs`; the
server packs them so, net/token_ids.py, and its batching, graph cache and recomputes treat that tensor
like any input). The id column's gradient is zero and never sent.

`fold_subspace` turns the parameters into an ordinary model's computing the same function (embedding
E0 + C @ B.T, positions P @ B.T, each confined write W -> B @ W and bias b -> B @ b): what `export
--hf-out` writes, a plain Llama or GPT-2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig

BASIS_NAME, TABLE_NAME = "subspace.basis", "subspace.tokens"  # the fixed parts' seeds' names
TABLE_KEY = "table"  # the tensor's name in a `[model] boundary_table` file
TABLE_SCALE = 8.0  # E0's standard deviation in units of `init_std` (the module docstring's "Scales")
# per architecture: the learned token embedding, other learned rows that write into the stream (GPT's
# positions), and the modules whose outputs a confined layer writes into the stream
TOKEN_EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt": "tok_emb.weight"}
OTHER_EMBEDDINGS = {"llama": (), "gpt": ("pos_emb.weight",)}
RESIDUAL_WRITES = {"llama": (".self_attn.o_proj.", ".mlp.down_proj."), "gpt": (".proj.", ".fc_out.")}


def fixed_parts(cfg: ModelConfig, seed_of: Callable[[str], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B: d_model x k, orthogonal columns of norm sqrt(d_model / k); E0: vocab_size x d_model of entries
    of standard deviation TABLE_SCALE x init_std), each from `seed_of(its name)`: the same on every stage
    and in every process of a run. E0's rows are normal draws, or with `[model] boundary_table` the file's
    rows (a row of zeros: the draw). The scales are the module docstring's "Scales"."""
    generator = torch.Generator().manual_seed(seed_of(BASIS_NAME))
    basis, _ = torch.linalg.qr(torch.randn(cfg.d_model, cfg.boundary_dim, generator=generator))
    generator = torch.Generator().manual_seed(seed_of(TABLE_NAME))
    table = torch.randn(cfg.vocab_size, cfg.d_model, generator=generator)
    if cfg.boundary_table:
        rows = load_token_table(cfg.boundary_table, cfg)
        seen = seen_rows(rows)
        table[seen] = rows[seen]
    return (basis * lift_scale(cfg)).contiguous(), table * (TABLE_SCALE * cfg.init_std)


def seen_rows(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of a token table hold the data's row (bool per id); the others are zero rows, which
    `fixed_parts` draws from the seed."""
    return rows.abs().sum(dim=1) > 0


def save_token_table(path: str | Path, rows: torch.Tensor) -> None:
    """Write a token table (`[model] boundary_table`): vocab_size x d_model float32, rows of unit-variance
    entries, zero rows for tokens the model draws from the seed (data/token_table.py makes one)."""
    save_file({TABLE_KEY: rows.float().contiguous()}, str(path))


def load_token_table(path: str | Path, cfg: ModelConfig) -> torch.Tensor:
    """The rows of `[model] boundary_table`, checked against the model; ConfigError naming the file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            if TABLE_KEY not in handle.keys():
                raise ConfigError(f"model.boundary_table {path} holds no {TABLE_KEY!r} tensor")
            rows = handle.get_tensor(TABLE_KEY)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"model.boundary_table {path}: not a readable safetensors file ({exc})") from None
    if tuple(rows.shape) != (cfg.vocab_size, cfg.d_model):
        raise ConfigError(
            f"model.boundary_table {path} is {tuple(rows.shape)}, the model needs (vocab_size, d_model) = "
            f"({cfg.vocab_size}, {cfg.d_model}): make it for this model (`swarmtrain boundary-table`)"
        )
    if not torch.isfinite(rows).all():
        raise ConfigError(f"model.boundary_table {path} holds non-finite values")
    return rows.float()


def lift_scale(cfg: ModelConfig) -> float:
    """The norm of each of B's columns, sqrt(d_model / k): a k-wide write or coordinate row then puts as
    much into the stream as a d_model-wide one of the same values does."""
    return math.sqrt(cfg.d_model / cfg.boundary_dim)


class Subspace(nn.Module):
    """The fixed basis and token table of a subspace run, as buffers that move with the stage but are
    never saved or trained (filled by `build_stage` from the seed)."""

    basis: torch.Tensor  # (d_model, k)
    table: torch.Tensor  # (vocab_size, d_model)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("basis", torch.empty(cfg.d_model, cfg.boundary_dim), persistent=False)
        self.register_buffer("table", torch.empty(cfg.vocab_size, cfg.d_model), persistent=False)

    def fill(self, basis: torch.Tensor, table: torch.Tensor) -> None:
        with torch.no_grad():
            self.basis.copy_(basis)
            self.table.copy_(table)

    def lift(self, coords: torch.Tensor) -> torch.Tensor:
        """(..., k) coordinates -> (..., d_model): coords @ B.T."""
        return F.linear(coords, self.basis)

    def rebuild(self, fixed: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """The hidden state x = E0[ids] + coords @ B.T, from `fixed` = E0[ids]."""
        return fixed + self.lift(coords)


def confined_block(
    block: nn.Module, space: Subspace, fixed: torch.Tensor, coords: torch.Tensor
) -> torch.Tensor:
    """One pass of a block whose residual writes have k outputs: each branch (attention, MLP) reads the
    rebuilt x and adds its k outputs to the coordinates, so x stays E0[ids] + coords @ B.T exactly."""
    branches = cast(tuple[Callable[[torch.Tensor], torch.Tensor], ...], block.branches)  # a family's block
    for branch in branches:
        coords = coords + branch(space.rebuild(fixed, coords))
    return coords


def split_inputs(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's (batch, seq, k + 1) inputs after a subspace boundary: (coordinates, token ids)."""
    return inputs[..., :-1], inputs[..., -1].long()


def fold_subspace(
    named: Mapping[str, torch.Tensor], arch: str, basis: torch.Tensor, table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A subspace model's parameters (whole model, our names) as a plain model's that computes the same
    function: the token embedding E0 + C @ B.T, other embeddings P @ B.T, every confined write (k rows)
    B @ W and its bias B @ b; the rest as they are. Folded in float64, stored in float32."""
    k = basis.shape[1]
    basis64 = basis.double()
    folded = {}
    for name, tensor in named.items():
        value = tensor.detach().cpu().double()
        if name == TOKEN_EMBEDDING[arch]:
            value = table.double() + value @ basis64.T
        elif name in OTHER_EMBEDDINGS[arch]:
            value = value @ basis64.T
        elif any(write in f".{name}" for write in RESIDUAL_WRITES[arch]) and value.shape[0] == k:
            value = basis64 @ value  # (d, k) @ (k, in) for a weight, (d, k) @ (k,) for a bias
        folded[name] = value.to(tensor.dtype)
    return folded
