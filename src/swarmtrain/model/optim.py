"""The optimizer and learning-rate schedule shared by the local baseline and every stage server, so the
two train the same way: AdamW (no decay on biases, norms and embeddings' positions), linear warmup then
cosine decay, both measured in samples so that batch size changes do not shift the schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from swarmtrain.config import TrainingConfig


def build_optimizer(module: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _name, param in module.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2)
    )


def lr_at(samples_seen: int, cfg: TrainingConfig) -> float:
    """Learning rate after `samples_seen` training samples."""
    if cfg.warmup_samples and samples_seen < cfg.warmup_samples:
        return (
            cfg.learning_rate
            * (samples_seen + cfg.global_batch_size)
            / (cfg.warmup_samples + cfg.global_batch_size)
        )
    decay_samples = max(1, cfg.max_samples - cfg.warmup_samples)
    progress = min(1.0, (samples_seen - cfg.warmup_samples) / decay_samples)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_learning_rate + (cfg.learning_rate - cfg.min_learning_rate) * cosine


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def adam_state_tensors(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """AdamW's moments and step counts as plain tensors (exp_avg of every param, exp_avg_sq, step), for a
    joining replica (on the host, whatever device the parameters are on); zeros for a parameter that has
    not been stepped yet."""
    out: list[torch.Tensor] = []
    for key in ("exp_avg", "exp_avg_sq"):
        for p in params:
            value = optimizer.state.get(p, {}).get(key)
            out.append(
                value.detach().to("cpu", copy=True)
                if value is not None
                else torch.zeros_like(p, device="cpu")
            )
    for p in params:
        step = optimizer.state.get(p, {}).get("step")
        out.append(torch.tensor([float(step) if step is not None else 0.0]))
    return out


@torch.no_grad()
def load_adam_state(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], tensors: list[torch.Tensor]
) -> None:
    """The inverse of `adam_state_tensors` (creates the state of parameters never stepped here)."""
    n = len(params)
    if len(tensors) != 3 * n:
        raise ValueError(f"AdamW state has {len(tensors)} tensors, expected {3 * n}")
    for i, p in enumerate(params):
        if tensors[i].shape != p.shape or tensors[n + i].shape != p.shape:
            raise ValueError(f"AdamW state shape {tuple(tensors[i].shape)} != {tuple(p.shape)}")
        optimizer.state[p] = {
            "step": torch.tensor(float(tensors[2 * n + i].reshape(-1)[0])),
            "exp_avg": tensors[i].detach().to(device=p.device, dtype=p.dtype, copy=True),
            "exp_avg_sq": tensors[n + i].detach().to(device=p.device, dtype=p.dtype, copy=True),
        }
