"""The decoder: pre-norm blocks with causal SDPA attention and a GELU MLP, and the stage module.

A stage holds global layers [a, b). The first stage also embeds tokens and positions; the last stage
also holds the final norm, the LM head and the loss. A whole model is a single stage covering every
layer, so the local baseline and the swarm run exactly the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config.model import ModelConfig, StageSpec, partition_layers


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln_attn = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_mlp = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d_model, dim=-1)
        shape = (batch, seq, self.num_heads, d_model // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class GPTStage(nn.Module):
    """Layers [spec.layer_start, spec.layer_end) of the model, plus embeddings / head where they belong.

    forward(inputs, labels=None):
      - first stage: `inputs` are token ids (batch, seq) int64; other stages: hidden states (batch, seq, d).
      - last stage with labels: returns the mean next-token loss over labels != cfg.pad_token_id;
        last stage without labels: returns logits; other stages: hidden states.
    Blocks are stored in `self.layers` under their *global* index as a string key, so a state dict
    names each layer the same way whichever stage holds it.
    """

    def __init__(self, cfg: ModelConfig, spec: StageSpec) -> None:
        super().__init__()
        self.cfg, self.spec = cfg, spec
        if spec.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(spec.layer_start, spec.layer_end)})
        if spec.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(inputs) if self.spec.is_first else inputs
        for block in self.layers.values():
            x = block(x)
        if not self.spec.is_last:
            return x
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=self.cfg.pad_token_id,
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        return self.tok_emb(token_ids) + self.pos_emb(positions)


def init_weights(module: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """GPT-2 style init, made deterministic per global parameter name so stages built separately from
    the same seed match the corresponding slice of a whole model built from that seed."""
    for name, param in module.named_parameters():
        generator = torch.Generator().manual_seed(_name_seed(seed, name)) if seed is not None else None
        with torch.no_grad():
            if name.endswith("bias") or ".ln_" in f".{name}" or name.startswith("ln_"):
                param.zero_() if name.endswith("bias") else param.fill_(1.0)
            else:
                std = cfg.init_std
                if name.endswith(("proj.weight", "fc_out.weight")):
                    std = cfg.init_std / (2 * cfg.num_layers) ** 0.5  # residual-branch scaling (GPT-2)
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _name_seed(seed: int | None, name: str) -> int:
    import zlib

    return (int(seed or 0) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def build_stage(cfg: ModelConfig, spec: StageSpec, seed: int | None = 0) -> GPTStage:
    """The module for one stage, initialized deterministically from `seed` (None: torch's default RNG)."""
    stage = GPTStage(cfg, spec)
    init_weights(stage, cfg, seed)
    return stage


def build_model(cfg: ModelConfig, seed: int | None = 0) -> GPTStage:
    """The whole model as one stage holding every layer."""
    return build_stage(cfg, StageSpec(0, 1, 0, cfg.num_layers), seed)


def build_stages(
    cfg: ModelConfig, num_stages: int, layers_per_stage: list[int] | None = None, seed: int | None = 0
) -> list[GPTStage]:
    return [
        build_stage(cfg, spec, seed)
        for spec in partition_layers(cfg.num_layers, num_stages, layers_per_stage)
    ]
