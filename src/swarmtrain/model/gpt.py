"""The GPT family (`[model] arch = "gpt"`): pre-norm blocks with LayerNorm, causal SDPA attention with a
fused biased QKV, a GELU MLP, learned positions and an untied LM head (GPT-2's layout)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config.model import ModelConfig, StageSpec
from swarmtrain.model.stage import DecoderStage, init_parameters


class Block(nn.Module):
    """`write_dim`: outputs of the residual writes (`proj`, `fc_out`): d_model, or k for a layer confined
    to a subspace (model/subspace.py), whose outputs the stage maps into the stream."""

    def __init__(self, cfg: ModelConfig, write_dim: int | None = None) -> None:
        super().__init__()
        write_dim = write_dim or cfg.d_model
        self.num_heads = cfg.num_heads
        self.ln_attn = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, write_dim)
        self.ln_mlp = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, write_dim)

    @property
    def branches(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """What the block adds to the residual stream, in order (model/subspace.py runs them apart)."""
        return (self.attend, self.feed)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d_model, dim=-1)
        shape = (batch, seq, self.num_heads, d_model // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attn.transpose(1, 2).reshape(batch, seq, d_model))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)
        return x + self.feed(x)


class GPTStage(DecoderStage):
    """Layers [spec.layer_start, spec.layer_end) of a GPT model, plus embeddings / head where they belong.

    Blocks are stored in `self.layers` under their *global* index as a string key, so a state dict
    names each layer the same way whichever stage holds it.
    """

    def __init__(self, cfg: ModelConfig, spec: StageSpec, cuts: tuple[int, ...] = ()) -> None:
        super().__init__(cfg, spec, cuts)
        if spec.is_first:  # with subspace boundaries both hold k coordinates per row
            self.tok_emb = nn.Embedding(cfg.vocab_size, self.embed_dim)
            self.pos_emb = nn.Embedding(cfg.seq_len, self.embed_dim)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, self.write_dim(i)) for i in range(spec.layer_start, spec.layer_end)}
        )
        if spec.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        return self.tok_emb(token_ids) + self.pos_emb(positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def init_weights(module: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """GPT-2 style init, deterministic per global parameter name (see `init_parameters`)."""

    def std_of(name: str) -> float | None:
        if name.endswith("bias") or ".ln_" in f".{name}" or name.startswith("ln_"):
            return None
        if name.endswith(("proj.weight", "fc_out.weight")):
            # residual-branch scaling (GPT-2), over the layers a token passes through
            return cfg.init_std / (2 * cfg.applied_layers) ** 0.5
        return cfg.init_std

    init_parameters(module, seed, std_of)
