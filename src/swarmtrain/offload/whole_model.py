"""A whole model (or a stage with embeddings and head) trained through the layer swapper: the blocks
live in host memory and stream through `device` in the groups of a swap plan sized to its memory budget;
the embeddings, final norm and head (small next to the blocks) run where the host copies are.

One micro-batch: embed with autograd, blocks forward through the swapper (no graph, group inputs kept),
head and loss with autograd on a leaf of the blocks' output, then back: the head's gradient wrt that
leaf goes back through the swapper (each group recomputed, parameter gradients added to the host
blocks), and its input gradient into the embeddings. The same gradients as the resident model, up to
floating-point order (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarmtrain.model.stage import DecoderStage
from swarmtrain.offload.plan import SwapPlan, plan_swap_groups
from swarmtrain.offload.swapper import LayerSwapper


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class SwappedGPT:
    def __init__(self, model: DecoderStage, budget_bytes: float, device: str | torch.device = "cpu") -> None:
        if not (model.spec.is_first and model.spec.is_last):
            raise ValueError("SwappedGPT trains a whole model (first and last stage in one)")
        if model.cfg.shared_layer_repeats != 1:
            raise ValueError("the layer swapper streams unique layers once: shared_layer_repeats must be 1")
        self.model = model
        self.device = torch.device(device)
        blocks = list(model.layers.values())
        self.plan: SwapPlan = plan_swap_groups([_module_bytes(b) for b in blocks], budget_bytes)
        self.swapper = LayerSwapper(blocks, self.plan, self.device)

    def loss_and_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> float:
        """Back-propagates `loss * scale` into the host parameters; returns the loss."""
        m, host = self.model, inputs.device
        x = m.embed(inputs)
        hidden = self.swapper.forward(x.detach().to(self.device)).to(host)
        leaf = hidden.detach().requires_grad_(True)
        logits = m.head(leaf)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=m.cfg.pad_token_id
        )
        (loss * scale).backward()
        assert leaf.grad is not None
        grad_x = self.swapper.backward(leaf.grad.to(self.device)).to(host)
        x.backward(grad_x)
        return float(loss.item())
