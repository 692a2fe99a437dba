"""Executes a swap plan: layers live in host memory, groups stream through the accelerator.

Forward runs group by group without autograd and keeps only each group's input (the activation
checkpoint). Backward walks the groups in reverse, recomputes each group's forward with autograd on the
device, back-propagates, and adds the parameter gradients to the host copies. While group i computes,
group i+1 (in walk order) is copied on a side CUDA stream; the last forward group stays resident into
the backward. On a CPU "device" the same code runs synchronously, which is how it is tested here.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from swarmtrain.offload.plan import SwapPlan


class LayerSwapper:
    """Forward/backward of `layers` (applied in sequence, tensor -> tensor) streamed through `device`."""

    def __init__(self, layers: list[nn.Module], plan: SwapPlan, device: str | torch.device = "cpu") -> None:
        self.layers = layers
        self.plan = plan
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._resident: dict[int, list[nn.Module]] = {}
        self._ready: dict[int, torch.cuda.Event] = {}
        self._group_inputs: list[torch.Tensor] = []
        self.max_resident_groups = 0
        self.bytes_copied = 0

    # residency ----------------------------------------------------------------------------------
    def _prefetch(self, group: int) -> None:
        if group in self._resident or not 0 <= group < self.plan.num_groups:
            return
        start, end = self.plan.groups[group]
        if self._stream is None:
            self._resident[group] = [self._copy(layer) for layer in self.layers[start:end]]
        else:
            with torch.cuda.stream(self._stream):
                self._resident[group] = [self._copy(layer) for layer in self.layers[start:end]]
                event = torch.cuda.Event()
                event.record(self._stream)
                self._ready[group] = event
        self.max_resident_groups = max(self.max_resident_groups, len(self._resident))

    def _copy(self, layer: nn.Module) -> nn.Module:
        self.bytes_copied += sum(p.numel() * p.element_size() for p in layer.parameters())
        return copy.deepcopy(layer).to(self.device, non_blocking=True)

    def _acquire(self, group: int) -> list[nn.Module]:
        self._prefetch(group)
        event = self._ready.pop(group, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return self._resident[group]

    def _evict(self, group: int) -> None:
        self._resident.pop(group, None)
        self._ready.pop(group, None)

    # passes -------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Output of all layers; remembers each group's input for `backward`."""
        self._group_inputs = []
        last = self.plan.num_groups - 1
        for group in range(self.plan.num_groups):
            modules = self._acquire(group)
            self._prefetch(group + 1)
            self._group_inputs.append(x)
            for module in modules:
                x = module(x)
            if group != last:
                self._evict(group)  # the last group stays for the backward
        return x

    def backward(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the forward input; parameter gradients accumulate into the host layers."""
        grad = grad_output
        for group in reversed(range(self.plan.num_groups)):
            modules = self._acquire(group)
            self._prefetch(group - 1)
            x = self._group_inputs[group].detach().requires_grad_(True)
            with torch.enable_grad():
                out = x
                for module in modules:
                    out = module(out)
            out.backward(grad)
            grad = x.grad
            start, _ = self.plan.groups[group]
            for offset, module in enumerate(modules):
                _accumulate_to_host(self.layers[start + offset], module)
            self._evict(group)
        self._group_inputs = []
        return grad


def _accumulate_to_host(host: nn.Module, device_copy: nn.Module) -> None:
    for host_param, device_param in zip(host.parameters(), device_copy.parameters(), strict=True):
        if device_param.grad is None:
            continue
        grad = device_param.grad.to(host_param.device, non_blocking=False)
        host_param.grad = grad if host_param.grad is None else host_param.grad + grad
