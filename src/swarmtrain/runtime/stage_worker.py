"""The tensor side of a stage server: forward/backward with an activation cache, gradient
accumulation with at-most-once application per micro-batch, the optimizer step, state export/import.

Every method except `export_state` runs on the server's single compute thread (runtime/compute.py).

Gradient bookkeeping: the last stage back-propagates `loss * batch_size`, so every stage accumulates
the *sum* of per-sample gradients (`grad_sums`); dividing by `pending_samples` gives the mean over
the samples this replica processed, and the synchronizer averages those means weighted by samples.

Parameters: the optimizer owns the master parameters; forward passes run (`functional_call`) on a
detached copy made after each step (`live`). A cached graph therefore stays valid across an optimizer
step and its backward yields the gradient at the parameters its forward used (one step stale at
most, like any pipelined SWARM update), instead of failing autograd's in-place check or forcing a
recomputation. Graphs more than one epoch old are recomputed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.func import functional_call

from swarmtrain.config import RunConfig, StageSpec
from swarmtrain.model import build_stage
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr
from swarmtrain.net.protocol import Message, ProtocolError, StageRequest, make_message
from swarmtrain.runtime.ledger import Ledger


@dataclass
class CacheEntry:
    epoch: int
    inputs: torch.Tensor  # as received (a leaf with requires_grad for float inputs)
    outputs: torch.Tensor  # graph attached
    params: list[torch.Tensor]  # the live parameter leaves this graph was built on


@dataclass
class Snapshot:
    """Accumulated gradients (sums) and the micro-batches behind them, taken out for one round."""

    epoch: int
    grad_sums: list[torch.Tensor]
    samples: int
    micro_batch_ids: list[str]
    taken_at_s: float = 0.0  # time.monotonic() of the cut


class StageWorker:
    def __init__(
        self, cfg: RunConfig, spec: StageSpec, cache_size: int = 64, ledger: Ledger | None = None
    ) -> None:
        self.cfg, self.spec = cfg, spec
        self.module = build_stage(cfg.model, spec, seed=cfg.training.seed)
        self.module.train()
        self.optimizer = build_optimizer(self.module, cfg.training)
        self.names = [name for name, _ in self.module.named_parameters()]
        self.params = [param for _, param in self.module.named_parameters()]
        self.live = self._live_copy()
        self.grad_sums = [torch.zeros_like(p) for p in self.params]
        _init_adam_state(self.optimizer)
        self.cache: OrderedDict[str, CacheEntry] = OrderedDict()
        self.cache_size = cache_size
        self.ledger = ledger or Ledger(None)
        self.state_lock = threading.Lock()  # parameters/optimizer vs. export to joining peers
        self.epoch = 0
        self.samples_seen = 0
        self.pending_samples = 0
        self.pending_ids: list[str] = []
        self.accumulated_ids: set[str] = set()
        self.on_accumulate = None  # callback() to wake the synchronizer
        self.others_samples = 0  # samples of same-epoch stage peers, as last seen by the synchronizer
        self.frozen: Snapshot | None = None  # the accumulation cut exactly at the global batch
        self.counters = dict(
            forward=0,
            backward=0,
            fused=0,
            eval=0,
            recomputed=0,
            duplicates=0,
            not_accumulated=0,
            samples_forward=0,
        )

    # requests -----------------------------------------------------------------------------------
    def forward(self, request: StageRequest) -> Message:
        if self.spec.is_last:
            return self._forward_last(request)
        if request.evaluate:
            with torch.no_grad():
                outputs = self._run(self.live, request.inputs)
            self.counters["eval"] += 1
        else:
            entry = self._compute(request)
            self._cache_put(request.micro_batch_id, entry)
            outputs = entry.outputs
            self.counters["forward"] += 1
            self.counters["samples_forward"] += request.num_samples
        return make_message(
            "result", {"mb": request.micro_batch_id}, {"outputs": outputs.detach()}, request.codec
        )

    def backward(self, request: StageRequest) -> Message:
        mb = request.micro_batch_id
        entry = self.cache.pop(mb, None)
        stale = entry is not None and entry.epoch < self.epoch - 1
        if entry is None or stale or not torch.equal(entry.inputs.detach(), request.inputs):
            entry = self._compute(request)  # another replica did the forward (or long ago): recompute
            self.counters["recomputed"] += 1
        self.counters["backward"] += 1
        grad_inputs = self._backpropagate(
            mb,
            request.num_samples,
            entry.outputs,
            request.grad_outputs,
            entry.inputs,
            entry.params,
            request.accumulate,
        )
        tensors = {} if grad_inputs is None else {"grad_inputs": grad_inputs}
        return make_message("result", {"mb": mb}, tensors, request.codec)

    def _forward_last(self, request: StageRequest) -> Message:
        mb, n = request.micro_batch_id, request.num_samples
        if request.evaluate:  # loss only, nothing kept
            with torch.no_grad():
                loss = self._run(self.live, request.inputs, request.labels)
            self.counters["eval"] += 1
            return make_message("result", {"mb": mb, "loss": float(loss)}, {}, request.codec)
        inputs = request.inputs.detach().requires_grad_(not self.spec.is_first)
        params = self.live
        loss = self._run(params, inputs, request.labels)
        self.counters["fused"] += 1
        self.counters["samples_forward"] += n
        grad_inputs = self._backpropagate(mb, n, loss * n, None, inputs, params, request.accumulate)
        tensors = {} if grad_inputs is None else {"grad_inputs": grad_inputs}
        return make_message("result", {"mb": mb, "loss": float(loss.detach())}, tensors, request.codec)

    def _run(self, params: list[torch.Tensor], *args) -> torch.Tensor:
        return functional_call(self.module, dict(zip(self.names, params, strict=True)), args)

    def _compute(self, request: StageRequest) -> CacheEntry:
        inputs = request.inputs if self.spec.is_first else request.inputs.detach().requires_grad_(True)
        params = self.live
        return CacheEntry(self.epoch, inputs, self._run(params, inputs), params)

    def _backpropagate(
        self, mb: str, n: int, outputs, grad_outputs, inputs, params, accumulate: bool = True
    ) -> torch.Tensor | None:
        """Accumulate parameter gradients once per micro-batch; always return the input gradient."""
        wants_input_grad = inputs.requires_grad
        extra = [inputs] if wants_input_grad else []
        if mb in self.accumulated_ids or not accumulate:
            # a retry: we already have it (the caller lost our answer), or another replica may have it
            # (it went silent after receiving it): never apply twice
            key = "duplicates" if mb in self.accumulated_ids else "not_accumulated"
            self.counters[key] += 1
            self.ledger.write("dup" if key == "duplicates" else "noacc", mb=mb, n=n)
            return torch.autograd.grad(outputs, extra, grad_outputs)[0] if wants_input_grad else None
        grads = torch.autograd.grad(outputs, params + extra, grad_outputs, allow_unused=True)
        for acc, grad in zip(self.grad_sums, grads[: len(params)], strict=True):
            if grad is not None:
                acc.add_(grad)
        self.accumulated_ids.add(mb)
        self.pending_ids.append(mb)
        self.pending_samples += n
        self.ledger.write("acc", mb=mb, n=n, epoch=self.epoch)
        if (
            self.frozen is None
            and self.pending_samples + self.others_samples >= self.cfg.training.global_batch_size
        ):
            # cut here, on the compute thread, so a round averages the global batch and not whatever
            # arrived while the synchronizer was waking up; later samples go to the next round
            self.frozen = self.take_snapshot()
            if self.on_accumulate is not None:
                self.on_accumulate()
        return grads[-1] if wants_input_grad else None

    def _cache_put(self, mb: str, entry: CacheEntry) -> None:
        self.cache[mb] = entry
        self.cache.move_to_end(mb)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    # rounds -------------------------------------------------------------------------------------
    def take_snapshot(self) -> Snapshot:
        snapshot = Snapshot(
            self.epoch, self.grad_sums, self.pending_samples, self.pending_ids, time.monotonic()
        )
        self.grad_sums = [torch.zeros_like(p) for p in self.params]
        self.pending_samples, self.pending_ids = 0, []
        return snapshot

    def take_round_snapshot(self) -> Snapshot:
        """The frozen cut if there is one (merged with nothing else), otherwise everything pending."""
        snapshot, self.frozen = self.frozen, None
        return snapshot if snapshot is not None else self.take_snapshot()

    def restore_snapshot(self, snapshot: Snapshot) -> None:
        """Put a snapshot back after a failed round (it joins what accumulated meanwhile)."""
        for acc, g in zip(self.grad_sums, snapshot.grad_sums, strict=True):
            acc.add_(g)
        self.pending_samples += snapshot.samples
        self.pending_ids = snapshot.micro_batch_ids + self.pending_ids

    def drop_pending(self) -> tuple[int, list[str]]:
        """Discard accumulated gradients (before a resync); returns what was lost."""
        frozen, self.frozen = self.frozen, None
        snapshot = self.take_snapshot()
        if frozen is not None:
            return frozen.samples + snapshot.samples, frozen.micro_batch_ids + snapshot.micro_batch_ids
        return snapshot.samples, snapshot.micro_batch_ids

    def unapplied_grad_sums(self) -> list[torch.Tensor]:
        if self.frozen is None:
            return [g.clone() for g in self.grad_sums]
        return [g + f for g, f in zip(self.grad_sums, self.frozen.grad_sums, strict=True)]

    @property
    def unapplied_samples(self) -> int:
        return self.pending_samples + (self.frozen.samples if self.frozen is not None else 0)

    def apply_update(self, mean_grads: list[torch.Tensor], group_samples: int) -> None:
        """One optimizer step with the stage-averaged mean gradients (gradients accumulated since the
        snapshot are in `grad_sums` and belong to the next epoch)."""
        t = self.cfg.training
        with self.state_lock:
            for p, g in zip(self.params, mean_grads, strict=True):
                p.grad = g
            if t.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip_norm)
            set_lr(self.optimizer, lr_at(self.samples_seen, t))
            self.optimizer.step()
            for p in self.params:
                p.grad = None
            self.samples_seen += group_samples
            self.epoch += 1
            self.live = self._live_copy()

    def _live_copy(self) -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.params]

    # state transfer -----------------------------------------------------------------------------
    def export_state(self) -> tuple[dict, list[torch.Tensor]]:
        """Parameters and AdamW state for a joining replica (called from hivemind's thread)."""
        with self.state_lock:
            tensors = [p.detach().clone() for p in self.params]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                tensors += [
                    self.optimizer.state[p][key].detach().clone().float().reshape(-1)
                    if key == "step"
                    else self.optimizer.state[p][key].detach().clone()
                    for p in self.params
                ]
            meta = {
                "epoch": self.epoch,
                "samples_seen": self.samples_seen,
                "names": self.names,
                "digest": self.cfg.digest(),
            }
        return meta, tensors

    def import_state(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        n = len(self.params)
        if (
            meta.get("names") != self.names
            or meta.get("digest") != self.cfg.digest()
            or len(tensors) != 4 * n
        ):
            raise ProtocolError("downloaded state does not match this stage (names, digest or size)")
        for i, p in enumerate(self.params):
            if tensors[i].shape != p.shape or tensors[n + i].shape != p.shape:
                raise ProtocolError(f"downloaded state: shape mismatch for {self.names[i]}")
        with self.state_lock:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.copy_(tensors[i])
                    state = self.optimizer.state[p]
                    state["exp_avg"].copy_(tensors[n + i])
                    state["exp_avg_sq"].copy_(tensors[2 * n + i])
                    state["step"].fill_(float(tensors[3 * n + i].reshape(-1)[0]))
            self.epoch = int(meta["epoch"])
            self.samples_seen = int(meta["samples_seen"])
            self.live = self._live_copy()
        self.cache.clear()

    def grad_fingerprint(self, grads: list[torch.Tensor]) -> list[float]:
        """Two numbers that differ when two replicas applied different averaged gradients."""
        total = sum(float(g.double().sum()) for g in grads)
        squares = sum(float(g.double().pow(2).sum()) for g in grads)
        return [total, squares]


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state eagerly (as its first step would) so it can be exported before any step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
