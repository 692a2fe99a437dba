"""The Llama family (`[model] arch = "llama"`): RMSNorm, rotary positions, SwiGLU MLP, grouped-query
attention without biases, optionally tied input/output embeddings.

Parameter names are Hugging Face's `LlamaForCausalLM` names (`model.embed_tokens`, `model.layers.<i>.
self_attn.q_proj`, ..., `model.norm`, `lm_head`), so a stage's state dict is a slice of a Hugging Face
checkpoint and the model is checked against `transformers` as its oracle (tests/unit/test_llama.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config.model import ModelConfig, StageSpec
from swarmtrain.model.stage import DecoderStage, init_parameters


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back, as Hugging Face's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


@functools.lru_cache(maxsize=16)
def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim) for positions 0..seq_len-1, each frequency twice (the
    half-split layout of `rotate_half`). Cached: every layer of every micro-batch uses the same tables."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) queries or keys by their positions' angles."""
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, write_dim: int) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, write_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(seq, self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_heads != self.num_heads:
            # grouped-query attention: query head h reads key/value head h // (heads per group)
            group = self.num_heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, write_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, write_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """`write_dim`: outputs of `o_proj` and `down_proj`: d_model, or k for a layer confined to a subspace
    (model/subspace.py), whose outputs the stage maps into the stream."""

    def __init__(self, cfg: ModelConfig, write_dim: int | None = None) -> None:
        super().__init__()
        write_dim = write_dim or cfg.d_model
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, write_dim)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg, write_dim)

    @property
    def branches(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
        """What the block adds to the residual stream, in order (model/subspace.py runs them apart)."""
        return (self.attend, self.feed)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x))

    def feed(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)
        return x + self.feed(x)


class LlamaTrunk(nn.Module):
    """What Hugging Face calls `model`: the embedding (first stage), the layers, the final norm (last)."""

    embed_tokens: nn.Embedding
    norm: RMSNorm

    def __init__(
        self, cfg: ModelConfig, spec: StageSpec, embed_dim: int, write_dim: Callable[[int], int]
    ) -> None:
        """`embed_dim`, `write_dim(layer)`: the stage's widths (`DecoderStage.embed_dim`, `write_dim`)."""
        super().__init__()
        if spec.is_first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, embed_dim)
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(cfg, write_dim(i)) for i in range(spec.layer_start, spec.layer_end)}
        )
        if spec.is_last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class LlamaStage(DecoderStage):
    """Layers [spec.layer_start, spec.layer_end) under `model.layers.<global index>`, the token embedding
    on the first stage, the final norm and LM head on the last. With tied embeddings (one stage only:
    `RunConfig.require_swarm_model`) the head multiplies by `model.embed_tokens.weight` and there is no
    `lm_head` parameter, as in a tied Hugging Face checkpoint."""

    def __init__(self, cfg: ModelConfig, spec: StageSpec, cuts: tuple[int, ...] = ()) -> None:
        super().__init__(cfg, spec, cuts)
        if cfg.tie_embeddings and spec.is_first != spec.is_last:
            raise ValueError("tied embeddings need the first and the last stage in one module")
        self.model = LlamaTrunk(cfg, spec, self.embed_dim, self.write_dim)
        if spec.is_last and not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleDict:  # type: ignore[override]
        return self.model.layers

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.model.norm(hidden)
        if self.cfg.tie_embeddings:
            return F.linear(normed, self.model.embed_tokens.weight)
        return self.lm_head(normed)


def init_weights(module: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """Normal(0, init_std) weights, norm weights 1, and the residual branches' output projections scaled
    by 1/sqrt(2 x applied layers) (GPT-2's rule, as most Llama pretraining recipes keep it)."""

    def std_of(name: str) -> float | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return cfg.init_std / (2 * cfg.applied_layers) ** 0.5
        return cfg.init_std

    init_parameters(module, seed, std_of)
