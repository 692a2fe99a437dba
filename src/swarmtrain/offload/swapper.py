"""Executes a swap plan (plan.py): layers live in host memory, groups of them stream through the device.

Host side, made once at construction (`HostParams`): each layer's parameters are the module's own tensors,
pinned in place when the device is CUDA (so host-to-device copies are asynchronous DMA and nothing is
duplicated on the host), plus pinned staging buffers its gradients come back into. Device side: a
resident group is one dict of device tensors per layer, filled by `copy_` and run through
`torch.func.functional_call` on the host module, so no module is copied per prefetch.

Forward runs group by group without autograd and keeps each group's input (the activation checkpoint);
the last group may run with autograd and keep its graph into the backward (`keep_last_graph`, when its
saved activations fit). Backward walks the groups in reverse, recomputes each group's forward with
autograd (but a kept last group's), back-propagates, and sends the parameter gradients to the host, where
they are added to `.grad`. While group g computes,
the next group in walk order is prefetched; in the backward only when the plan says that fits, else once
g's parameters and activations are freed. The last forward group stays resident into the backward.

Transfers (`_Transfers`): on a CPU device they are plain copies and additions, done in program order,
which is how everything here is tested. `_CudaTransfers` is the only CUDA code, kept in one place: a side
stream for copies, events ordering compute after copies and copies after compute, `record_stream` so the
caching allocator never reuses memory the other stream may still use, one host synchronization per
backward group, and a thread that adds the staged gradients to the host `.grad` meanwhile. This
repository's machines have no GPU: that class runs only in the `gpu` tier (the CUDA cases in
tests/unit/test_offload.py, run by `make gpu-check`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from swarmtrain.offload.plan import SwapPlan


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class HostParams:
    """A module's parameters as the swapper streams them: the module's own host tensors (pinned once, in
    place, when `pin`), and with `pin` one pinned staging buffer per parameter for its gradient.
    `skip_prefix`: leave out the parameters whose names start with it (a stage's blocks)."""

    def __init__(self, module: nn.Module, pin: bool, skip_prefix: str | None = None) -> None:
        if any(True for _ in module.buffers()):
            raise ValueError(f"{type(module).__name__} has buffers; the swapper streams parameters only")
        named = [
            (n, p) for n, p in module.named_parameters() if not (skip_prefix and n.startswith(skip_prefix))
        ]
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.param_bytes = sum(tensor_bytes(p) for p in self.params)
        self.pin = pin
        self.keep_pinned()
        self.grad_staging = (
            [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in self.params] if pin else []
        )

    def keep_pinned(self) -> None:
        """Pin any parameter whose storage is not (at construction, or after something replaced `.data`):
        a copy from pageable memory would still be correct, only synchronous."""
        if not self.pin:
            return
        for param in self.params:
            if not param.data.is_pinned():
                param.data = param.data.pin_memory()

    def empty_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Uninitialized device tensors for the parameters, allocated on the current stream."""
        return {name: torch.empty(p.shape, dtype=p.dtype, device=device) for name, p in self.named()}

    def copy_into(self, copies: dict[str, torch.Tensor]) -> None:
        """Fill device tensors from the parameters on the current stream (asynchronously from pinned
        memory: the caller orders their use)."""
        for name, param in self.named():
            copies[name].copy_(param.detach(), non_blocking=True)

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return list(zip(self.names, self.params, strict=True))

    def add_grads(self, grads: list[torch.Tensor | None], owned: bool) -> None:
        """Add host gradients (in `params` order; None for an unused parameter) to `.grad`. `owned`: the
        tensors may become `.grad` as they are (else they are staging buffers, reused: cloned)."""
        for param, grad in zip(self.params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad if owned else grad.clone()
            else:
                param.grad.add_(grad)


@dataclass
class Fetched:
    """Device copies of one module's parameters, and the event after which they hold the values (None:
    copied in program order)."""

    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None


class _Transfers:
    """Copies between host and device in program order: a CPU "device" (and the reference semantics of
    `_CudaTransfers`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fetch(self, host: HostParams) -> Fetched:
        copies = host.empty_on(self.device)
        host.copy_into(copies)
        return Fetched(copies)

    def use(self, fetched: Fetched) -> None:
        """Before compute reads `fetched`."""

    def release(self, fetched: Fetched) -> None:
        """Before the last reference to `fetched` is dropped."""

    def send_grads(self, hosts: list[HostParams], grads: list[list[torch.Tensor | None]]) -> None:
        """Add each module's device gradients to its host `.grad`; the device tensors are not kept."""
        for host, module_grads in zip(hosts, grads, strict=True):
            host.add_grads(module_grads, owned=True)

    def wait_grads(self) -> None:
        """Every gradient sent is copied to the host (its device memory free), and no transfer is still
        reading host memory; adding them to `.grad` may still be under way (`settle`)."""

    def settle(self) -> None:
        """Every gradient sent is in host `.grad`, and no transfer is still reading host memory."""


class _CudaTransfers(_Transfers):
    """CUDA only, never run in this repository (no GPU here). The compute stream is the device's current
    stream; copies both ways run on `side`, so they overlap the compute stream's kernels.

    - Device copies of parameters are allocated on the compute stream, like everything else the plan
      counts: the caching allocator then reuses freed memory in compute-stream order (safe without events)
      and one pool holds it all, so the host running ahead cannot make the allocator keep extra blocks
      (a pool per stream would, and each would keep its own peak). Such memory may still be read by
      queued kernels when it is handed out, so `side` first waits for the compute stream's queue, then
      copies from pinned memory; the compute stream waits for an event after each layer's copy before the
      first kernel that reads that layer (`use`, per layer, so a group's first layers compute while its
      later layers arrive; `release` for copies never used), which orders every later reuse of their
      memory after the copy. No `record_stream` is needed for them: no stream but the compute
      stream allocates, and `side` only writes memory it was handed in compute order.
    - Gradients (allocated on the compute stream) are copied out on `side` after an event marking the end
      of their kernels, into pinned staging; `record_stream(side)` keeps their memory from being handed
      out again before the copy has read them. `wait_grads` is the one host synchronization per group:
      after it the device gradients' memory is free (plan.py counts no third group because of it) and the
      staged gradients are handed to the adder thread, which adds them to `.grad` on the host while the
      caller queues the next group. `settle` (the end of `LayerSwapper.backward`) waits for the adder
      too, and guarantees that no copy reads host parameters, so the optimizer may write them.
    """

    def __init__(self, device: torch.device, background_adds: bool = True) -> None:
        super().__init__(device)
        self.side = torch.cuda.Stream(device)
        self._sent: list[tuple[HostParams, list[bool]]] = []
        self._sent_copied: torch.cuda.Event | None = None
        # the host additions of a group's gradients run on a thread of their own while the next group's
        # kernels are queued (on the caller's thread they left the device idle for as long as they took)
        self._adder = ThreadPoolExecutor(1, thread_name_prefix="swap-grad-adds") if background_adds else None
        self._adding: list[Future] = []

    @property
    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def fetch(self, host: HostParams) -> Fetched:
        copies = host.empty_on(self.device)  # on the compute stream
        self.side.wait_stream(
            self.compute
        )  # kernels that last read this memory are done before it is written
        with torch.cuda.stream(self.side):
            host.copy_into(copies)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return Fetched(copies, ready)

    def use(self, fetched: Fetched) -> None:
        assert fetched.ready is not None
        self.compute.wait_event(fetched.ready)

    def release(self, fetched: Fetched) -> None:
        self.use(fetched)  # a copy never used is still ordered before the reuse of its memory

    def send_grads(self, hosts: list[HostParams], grads: list[list[torch.Tensor | None]]) -> None:
        computed = torch.cuda.Event()
        computed.record(self.compute)
        self.side.wait_event(computed)
        with torch.cuda.stream(self.side):
            for host, module_grads in zip(hosts, grads, strict=True):
                for grad, staging in zip(module_grads, host.grad_staging, strict=True):
                    if grad is not None:
                        staging.copy_(grad, non_blocking=True)
                        grad.record_stream(self.side)
                self._sent.append((host, [grad is not None for grad in module_grads]))
            self._sent_copied = torch.cuda.Event()
            self._sent_copied.record(self.side)

    def wait_grads(self) -> None:
        if self._sent_copied is None:
            return
        self._sent_copied.synchronize()  # side is in order: every earlier parameter copy is done too
        # each host sends once per backward: its staging is not written again before `settle`
        batch, self._sent, self._sent_copied = self._sent, [], None
        if self._adder is None:
            _add_staged(batch)
        else:
            self._adding.append(self._adder.submit(_add_staged, batch))

    def settle(self) -> None:
        self.wait_grads()
        adding, self._adding = self._adding, []
        for future in adding:
            future.result()  # raises what an addition raised


def _add_staged(batch: list[tuple[HostParams, list[bool]]]) -> None:
    for host, present in batch:
        host.add_grads(
            [staging if sent else None for staging, sent in zip(host.grad_staging, present, strict=True)],
            owned=False,
        )


def make_transfers(device: torch.device) -> _Transfers:
    return _CudaTransfers(device) if device.type == "cuda" else _Transfers(device)


def saved_activation_bytes(module: nn.Module, params: dict[str, torch.Tensor], *args: torch.Tensor) -> int:
    """Bytes autograd saves for the backward when `module` runs on `args` with `params` (functional_call)
    requiring gradients: distinct storages, the parameters' own not counted (a plan counts them as
    parameters). Measured rather than derived so that it holds for any layer and the device's kernels."""
    leaves = {name: t.detach().requires_grad_(t.is_floating_point()) for name, t in params.items()}
    param_storages = {t.untyped_storage().data_ptr() for t in leaves.values()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    # the output (holding the graph, so the saved tensors and their addresses) lives until the sum
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = functional_call(module, leaves, args)
    total = sum(saved.values())
    del output
    return total


@dataclass
class _Graph:
    """One group's forward with autograd: its input and parameter leaves, and its output."""

    x: torch.Tensor
    leaves: list[dict[str, torch.Tensor]]
    out: torch.Tensor


class LayerSwapper:
    """Forward/backward of `layers` (applied in sequence, tensor -> tensor) streamed through `device`
    following `plan`. Host parameters may be written (an optimizer step) once `backward` has returned,
    not between `forward` and `backward`. `keep_last_graph`: the last group's forward runs with autograd
    and its graph is kept into the backward, which then does not recompute that group (the caller has
    checked that its saved activations fit: whole_model.py); with a single group nothing is recomputed."""

    def __init__(
        self,
        layers: list[nn.Module],
        plan: SwapPlan,
        device: str | torch.device = "cpu",
        keep_last_graph: bool = False,
    ) -> None:
        if (plan.groups[-1][1] if plan.groups else 0) != len(layers):
            raise ValueError(f"the plan covers {plan.groups[-1:]} but there are {len(layers)} layers")
        self.layers = layers
        self.plan = plan
        self.device = torch.device(device)
        self.keep_last_graph = keep_last_graph
        self.hosts = [HostParams(layer, pin=self.device.type == "cuda") for layer in layers]
        self.transfers = make_transfers(self.device)
        self._resident: dict[int, list[Fetched]] = {}
        self._group_inputs: list[torch.Tensor] = []
        self._kept: _Graph | None = None  # the last group's graph, from the forward to the backward
        self.max_resident_groups = 0
        self.bytes_copied = 0
        self.groups_recomputed = 0  # backward groups that ran their forward again (tests, benches)

    # residency ----------------------------------------------------------------------------------
    def _prefetch(self, group: int) -> None:
        if group in self._resident or not 0 <= group < self.plan.num_groups:
            return
        start, end = self.plan.groups[group]
        self._resident[group] = [self.transfers.fetch(host) for host in self.hosts[start:end]]
        self.bytes_copied += sum(host.param_bytes for host in self.hosts[start:end])
        self.max_resident_groups = max(self.max_resident_groups, len(self._resident))

    def _layer_params(self, group: int) -> Iterator[tuple[nn.Module, dict[str, torch.Tensor]]]:
        """(layer, its device copies) of a group in order, each layer's copy waited for just before the
        layer is used: on CUDA the first layers compute while the later ones are still arriving."""
        for layer, fetched in zip(self._layers(group), self._resident[group], strict=True):
            self.transfers.use(fetched)
            yield layer, fetched.tensors

    def _evict(self, group: int) -> None:
        for fetched in self._resident.pop(group, []):
            self.transfers.release(fetched)

    def _layers(self, group: int) -> list[nn.Module]:
        start, end = self.plan.groups[group]
        return self.layers[start:end]

    # passes -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Output of all layers (no graph: the caller back-propagates through `backward`); remembers each
        group's input for `backward`."""
        for group in list(self._resident):  # left by a pass that did not finish: maybe stale by now
            self._evict(group)
        for host in self.hosts:
            host.keep_pinned()
        self._group_inputs, self._kept = [], None
        last = self.plan.num_groups - 1
        for group in range(self.plan.num_groups):
            self._prefetch(group)
            self._prefetch(group + 1)
            self._group_inputs.append(x)
            if group == last and self.keep_last_graph:
                self._kept = self._graph(group, x)
                x = self._kept.out.detach()
                continue  # resident, with its graph, into the backward
            with torch.no_grad():
                for layer, params in self._layer_params(group):
                    x = functional_call(layer, params, (x,))
            if group != last:
                self._evict(group)  # the last group stays for the backward
        return x

    def backward(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the forward input; parameter gradients are added to the host layers' `.grad`."""
        grad = grad_output
        for group in reversed(range(self.plan.num_groups)):
            self.transfers.wait_grads()  # group+1's gradients are on the host, their device memory free
            overlapped = self.plan.overlapped_backward[group]
            self._prefetch(group)
            if overlapped:
                self._prefetch(group - 1)
            grad = self._backward_group(group, self._group_inputs.pop(), grad)
            if not overlapped:
                self._prefetch(group - 1)  # now that group's parameters and activations are freed
        self.transfers.settle()
        return grad

    def _graph(self, group: int, x: torch.Tensor) -> _Graph:
        """The group's forward with autograd, on leaves over its device copies and its input."""
        x = x.detach().requires_grad_(True)
        leaves = []
        with torch.enable_grad():
            out = x
            for layer, params in self._layer_params(group):
                leaves.append({name: t.detach().requires_grad_(True) for name, t in params.items()})
                out = functional_call(layer, leaves[-1], (out,))
        return _Graph(x, leaves, out)

    def _backward_group(self, group: int, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """Back-propagate the group (its forward recomputed with autograd unless its graph was kept), send
        its parameter gradients to the host and release its device copies; returns the gradient w.r.t.
        its input. A function of its own so that every device tensor of the group is released when it
        returns."""
        graph, self._kept = self._kept, None
        if graph is None:
            graph = self._graph(group, x)
            self.groups_recomputed += 1
        flat = [t for params in graph.leaves for t in params.values()]
        grad_x, *grads = torch.autograd.grad(graph.out, [graph.x, *flat], grad_output, allow_unused=True)
        self._evict(group)
        start, end = self.plan.groups[group]
        in_order = iter(grads)  # None where a parameter was unused
        per_layer: list[list[torch.Tensor | None]] = [
            [next(in_order) for _ in params] for params in graph.leaves
        ]
        self.transfers.send_grads(self.hosts[start:end], per_layer)
        assert grad_x is not None
        return grad_x
