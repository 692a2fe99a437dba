"""The tensor side of a stage server: forward/backward with an activation cache, gradient
accumulation per global step with at-most-once application per micro-batch, the optimizer step,
state export/import.

Every method except `export_state` runs on the server's single compute thread (runtime/server/compute.py).

Device: the stage's parameters, optimizer state, cached graphs and open gradient buckets live on the
`ComputeDevice` (model/device.py), forwards run under its autocast; what crosses to the network or to the
other replicas is on the host: results in fp32 (encoded on the device, `replies`: on a CUDA server their
payloads may still be copying when a method returns, runtime/server/stage_replies.py), a sealed bucket's
sums, exported state.

Gradient bookkeeping: every training request names the global step it belongs to, and its gradient
goes into that step's bucket. The last stage back-propagates `loss * batch_size`, so buckets hold
the *sum* of per-sample gradients; the stage's replicas add their sums and divide by the step's
samples (runtime/server/stage_steps.py), so every step is exactly the global batch the trainers sent for it.

Parameters: the optimizer owns the master parameters; forward passes run (`functional_call`) on a
detached copy made after each step (`live`). A cached graph therefore stays valid across an optimizer
step and its backward yields the gradient at the parameters its forward used (with the default
synchronous steps a step's forwards never run before the previous step is applied, so this only
matters with `training.max_staleness = 1`). Graphs more than one step old are recomputed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.func import functional_call

from swarmtrain.config import RunConfig, StageSpec
from swarmtrain.config.model import SUBSPACE
from swarmtrain.config.sizes import saved_activation_bytes_per_sample
from swarmtrain.model import build_stage
from swarmtrain.model.device import CPU_FP32, ComputeDevice
from swarmtrain.model.diloco import OuterOptimizer
from swarmtrain.model.hf_checkpoint import load_stage_from_hf
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr
from swarmtrain.net.protocol import ProtocolError, StageRequest
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.server.stage_replies import Replies, Reply


@dataclass
class CacheEntry:
    epoch: int
    inputs: torch.Tensor  # as received (a leaf with requires_grad for float inputs)
    outputs: torch.Tensor  # graph attached
    params: list[torch.Tensor]  # the live parameter leaves this graph was built on
    nbytes: int = 0  # estimated memory of the saved activations
    # a batched forward's graph, shared by its micro-batches (runtime/server/stage_batches.py, whose
    # backwards use it); `backward_from` (a retry or late one, decided alone) recomputes instead
    group: object | None = None

    @property
    def shared(self) -> bool:
        return self.group is not None


@dataclass
class Bucket:
    """The gradient sums of one global step on this replica, and the micro-batches behind them."""

    step: int
    grad_sums: list[torch.Tensor]
    samples: int = 0
    micro_batch_ids: list[str] = field(default_factory=list)
    sealed: bool = False  # its step was closed: later arrivals are late, never accumulated
    # samples by the trainer whose micro-batches they are (`StageRequest.origin`): a close counts for
    # this replica's samples only from the trainer whose samples they are (planner/step_decision.py)
    by_origin: dict[str, int] = field(default_factory=dict)


@dataclass
class WorkerCounters:
    """What a stage worker has done since it started (the `info` reply's `counters`, in this order)."""

    forward: int = 0  # forward jobs of training micro-batches
    backward: int = 0
    fused: int = 0  # forward-backward jobs of the last stage
    eval: int = 0  # evaluation forwards
    recomputed: int = 0  # backwards whose forward graph had been dropped
    duplicates: int = 0  # micro-batches already accumulated here (a retry, a hedged copy)
    not_accumulated: int = 0  # backwards the caller asked not to accumulate
    late: int = 0  # micro-batches whose step was closed or applied when they came
    rejected_nonfinite: int = 0  # backwards with non-finite parameter gradients
    skipped_steps: int = 0  # steps counted without applying a mean (non-finite, or adopted)
    samples_forward: int = 0  # samples of training forwards
    # samples a batched forward's graph back-propagated with zero gradient, for members not in that
    # backward call (each such call costs the whole group's backward: runtime/server/stage_batches.py)
    padded_samples: int = 0

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to the counter `name` (a skip reason: duplicates, late, not_accumulated)."""
        setattr(self, name, getattr(self, name) + n)


# (samples, mean gradients) a replica applied a step with, and where it finds those of a recent step
KeptMean = tuple[int, "list[torch.Tensor] | None"]
MeansOf = Callable[[int], "KeptMean | None"]


class StageWorker:
    def __init__(
        self,
        cfg: RunConfig,
        spec: StageSpec,
        cache_size: int = 64,
        ledger: Ledger | None = None,
        cache_max_bytes: int | None = None,
        init_from_hf: str | Path | None = None,
        fault_grad_scale: float = 1.0,
        compute: ComputeDevice = CPU_FP32,
        overlap_sends: bool = False,
    ) -> None:
        """`init_from_hf`: a Hugging Face model directory whose weights replace the seed's initial ones
        (only this stage's tensors are read); they are what a stage with no trained replica or
        checkpoint starts from, like the seed's weights would be. `fault_grad_scale`: a byzantine
        replica's factor on its gradient sums (tests; runtime/faults.py). `compute`: the device and the
        autocast dtype. `cache_max_bytes`: memory for kept forward graphs (None: the device's default,
        `ComputeDevice.graph_budget_bytes`, read once the parameters and optimizer state exist).
        `overlap_sends`: on CUDA, replies leave with their payloads still copying (`Replies.overlap`; on
        CPU there is nothing to overlap: replies are made as without it)."""
        self.cfg, self.spec, self.compute = cfg, spec, compute
        self.replies = Replies(compute, overlap_sends and compute.device.type == "cuda")
        self.module = build_stage(cfg.model, spec, seed=cfg.training.seed)
        # after a subspace boundary the inputs' last column is the token ids (net/token_ids.py): their
        # (zero) gradient is not sent, only the coordinates' columns of an input gradient are
        self.io_has_ids = cfg.model.boundary == SUBSPACE and not spec.is_first
        self.grad_columns = slice(None, cfg.model.wire_dim) if self.io_has_ids else slice(None)
        if init_from_hf is not None:  # before the optimizer and the live copy are made from the parameters
            load_stage_from_hf(self.module, init_from_hf)
        self.module.to(compute.device)  # before the optimizer makes its state beside the parameters
        self.module.train()
        self.optimizer = build_optimizer(self.module, cfg.training)
        self.names = [name for name, _ in self.module.named_parameters()]
        self.params = [param for _, param in self.module.named_parameters()]
        self.live = self._live_copy()
        _init_adam_state(self.optimizer)
        # swarm.local_steps > 1: replicas step on their own gradients and average every H steps
        d, h = cfg.diloco, cfg.swarm.local_steps
        self.outer = OuterOptimizer(self.params, d.outer_learning_rate, d.outer_momentum) if h > 1 else None
        self.samples_since_sync = 0
        self.cache: OrderedDict[str, CacheEntry] = OrderedDict()
        self.cache_size = cache_size
        self.cache_bytes = 0
        self.cache_max_bytes, self._entry_bytes_per_sample = self._graph_sizes(cache_max_bytes)
        self.ledger = ledger or Ledger(None)
        self.state_lock = threading.Lock()  # parameters/optimizer vs. export to joining peers
        self.epoch = 0  # optimizer steps applied = the global step whose micro-batches come next
        self.samples_seen = 0
        # a byzantine replica for tests (runtime/faults.py): its gradient sums come out scaled
        self.fault_grad_scale = fault_grad_scale
        self.buckets: dict[int, Bucket] = {}
        self.counters = WorkerCounters()

    def _graph_sizes(self, cache_max_bytes: int | None) -> tuple[int, int]:
        """(memory for kept forward graphs, one sample's graph bytes in the compute dtype): a large stage's
        graphs are GBs. None: the device's default, read now that the parameters and state exist."""
        per_sample = saved_activation_bytes_per_sample(
            self.cfg.model, self.spec, self.compute.bytes_per_value
        )
        if cache_max_bytes is None:
            cache_max_bytes = self.compute.graph_budget_bytes(self.cfg.training.micro_batch_size * per_sample)
        return cache_max_bytes, per_sample

    # requests -----------------------------------------------------------------------------------
    def forward(self, request: StageRequest) -> Reply:
        if self.spec.is_last:
            return self._forward_last(request)
        inputs = self.compute.to_device(request.inputs)
        if request.evaluate:
            with torch.no_grad():
                outputs = self.run_module(self.live, inputs)
            self.counters.eval += 1
        else:
            entry = self._compute(inputs)
            self.cache_put(request.micro_batch_id, entry)
            outputs = entry.outputs
            self.counters.forward += 1
            self.counters.samples_forward += request.num_samples
        return self.replies.result({"mb": request.micro_batch_id}, {"outputs": outputs}, request.codec)

    def backward(self, request: StageRequest) -> Reply:
        return self.backward_from(request, self.cache_pop(request.micro_batch_id))

    def backward_from(self, request: StageRequest, entry: CacheEntry | None) -> Reply:
        """The backward of one micro-batch whose cache entry (if any) was already taken."""
        mb = request.micro_batch_id
        inputs = self.compute.to_device(request.inputs)
        if entry is None or not self.entry_usable(entry, inputs) or entry.shared:
            entry = self._compute(inputs)  # another replica did the forward (or long ago): recompute
            self.counters.recomputed += 1
        self.counters.backward += 1
        grad_outputs = self.compute.to_device(request.grad_outputs)
        grad_inputs, accumulated = self._backpropagate(
            request, entry.outputs, grad_outputs, entry.inputs, entry.params
        )
        sent = None if grad_inputs is None else grad_inputs[..., self.grad_columns]
        tensors = {} if sent is None else {"grad_inputs": sent}
        return self.replies.result({"mb": mb, "acc": accumulated}, tensors, request.codec)

    def _forward_last(self, request: StageRequest) -> Reply:
        mb, n = request.micro_batch_id, request.num_samples
        inputs, labels = self.compute.to_device(request.inputs), self.compute.to_device(request.labels)
        if request.evaluate:  # loss only, nothing kept
            with torch.no_grad():
                loss = self.run_module(self.live, inputs, labels)
            self.counters.eval += 1
            return self.replies.result({"mb": mb, "loss": float(loss)}, {}, request.codec)
        inputs = inputs.detach().requires_grad_(not self.spec.is_first)
        params = self.live
        loss = self.run_module(params, inputs, labels)
        self.counters.fused += 1
        self.counters.samples_forward += n
        grad_inputs, accumulated = self._backpropagate(request, loss * n, None, inputs, params)
        sent = None if grad_inputs is None else grad_inputs[..., self.grad_columns]
        tensors = {} if sent is None else {"grad_inputs": sent}
        header = {"mb": mb, "loss": float(loss.detach()), "acc": accumulated}
        return self.replies.result(header, tensors, request.codec)

    def entry_usable(self, entry: CacheEntry, inputs: torch.Tensor) -> bool:
        """A cached graph serves a backward if it is recent and was built on the same inputs."""
        return entry.epoch >= self.epoch - 1 and torch.equal(entry.inputs.detach(), inputs)

    def run_module(self, params: list[torch.Tensor], *args) -> torch.Tensor:
        with self.compute.autocast():  # the backward runs outside, in the dtypes the forward chose
            return functional_call(self.module, dict(zip(self.names, params, strict=True)), args)

    def _compute(self, inputs: torch.Tensor) -> CacheEntry:
        """The forward of one micro-batch's (device) inputs, with the graph its backward needs."""
        inputs = inputs if self.spec.is_first else inputs.detach().requires_grad_(True)
        params = self.live
        return CacheEntry(self.epoch, inputs, self.run_module(params, inputs), params)

    def _backpropagate(
        self, request: StageRequest, outputs, grad_outputs, inputs, params
    ) -> tuple[torch.Tensor | None, int]:
        """Accumulate parameter gradients into the request's step, at most once per micro-batch;
        always return the input gradient (and the number of samples it holds here, 0 or n: a duplicate
        of one accumulated before counts)."""
        mb, n = request.micro_batch_id, request.num_samples
        wants_input_grad = inputs.requires_grad
        extra = [inputs] if wants_input_grad else []
        skip = self.skip_reason(request)
        if skip is not None:
            # a retry (we have it, or a silent replica may have it), or a step already closed: the
            # caller still needs the input gradient, the stage must not apply the micro-batch twice
            self.counters.count(skip)
            self.ledger.write(_LEDGER_EVENT[skip], mb=mb, n=n, step=request.step)
            grad = torch.autograd.grad(outputs, extra, grad_outputs)[0] if wants_input_grad else None
            return grad, self._held(request) if skip == "duplicates" else 0
        grads = torch.autograd.grad(outputs, params + extra, grad_outputs, allow_unused=True)
        param_grads = grads[: len(params)]
        if not all_finite(param_grads):
            self.counters.rejected_nonfinite += 1
            raise ProtocolError(f"micro-batch {mb} gives non-finite parameter gradients; not accumulated")
        self.accumulate([request], param_grads)
        return (grads[-1] if wants_input_grad else None), n

    def accumulate(self, requests: list[StageRequest], param_grads) -> None:
        """Add the (finite) parameter gradient sum of `requests`, micro-batches of one step that may all
        accumulate (`skip_reason` None), to their step's bucket, each recorded once."""
        step = requests[0].step
        assert step is not None and all(r.step == step for r in requests)
        bucket = self.bucket(step)
        for acc, grad in zip(bucket.grad_sums, param_grads, strict=True):
            if grad is not None:
                acc.add_(grad, alpha=self.fault_grad_scale)
        for request in requests:
            bucket.micro_batch_ids.append(request.micro_batch_id)
            bucket.samples += request.num_samples
            bucket.by_origin[request.origin] = bucket.by_origin.get(request.origin, 0) + request.num_samples
            self.ledger.write("acc", mb=request.micro_batch_id, n=request.num_samples, step=step)

    def _held(self, request: StageRequest) -> int:
        """A duplicate's samples, when they are in the step's open bucket: its first reply was lost (a cut
        stream, a hedge whose original got this far), and reporting them lets the trainer's close name
        what this replica holds instead of a count short of it (which the step coordinator must doubt)."""
        bucket = self.buckets.get(request.step) if request.step is not None else None
        return request.num_samples if bucket is not None and not bucket.sealed else 0

    def skip_reason(self, request: StageRequest) -> str | None:
        step = request.step
        bucket = self.buckets.get(step) if step is not None else None
        if bucket is not None and request.micro_batch_id in bucket.micro_batch_ids:
            return "duplicates"
        if step is None or step < self.epoch or (bucket is not None and bucket.sealed):
            return "late"  # also what was queued before a resync moved this replica past its step
        if not request.accumulate:
            return "not_accumulated"
        return None

    def cache_put(self, mb: str, entry: CacheEntry) -> None:
        self.cache_pop(mb)
        entry.nbytes = int(entry.inputs.shape[0]) * self._entry_bytes_per_sample
        self.cache[mb] = entry
        self.cache_bytes += entry.nbytes
        # the oldest go first: a backward that finds nothing recomputes, so eviction costs time only
        while len(self.cache) > self.cache_size or (
            self.cache_bytes > self.cache_max_bytes and len(self.cache) > 1
        ):
            self.cache_pop(next(iter(self.cache)))

    def cache_pop(self, mb: str) -> CacheEntry | None:
        entry = self.cache.pop(mb, None)
        if entry is not None:
            self.cache_bytes -= entry.nbytes
        return entry

    # steps --------------------------------------------------------------------------------------
    def bucket(self, step: int) -> Bucket:
        if step not in self.buckets:
            self.buckets[step] = Bucket(step, [torch.zeros_like(p) for p in self.params])
        return self.buckets[step]

    def seal(self, step: int) -> Bucket:
        """Close a step's accumulation (nothing is added to a sealed bucket again). Its gradient sums stay
        where they were summed: the step's mean and update run there, and only what goes to stage peers
        crosses to the host, encoded (a GPU replica alone in its stage copied a whole gradient to the
        host and back every step: half a second of `gpt2-small`'s first stage)."""
        bucket = self.bucket(step)
        bucket.sealed = True
        return bucket

    @property
    def unapplied_samples(self) -> int:
        return sum(b.samples for b in list(self.buckets.values()))  # also read by the publisher thread

    def unapplied_grad_sums(self) -> list[torch.Tensor]:
        """The open buckets' sums added up, on the host."""
        sums = [torch.zeros_like(p, device="cpu") for p in self.params]
        for bucket in self.buckets.values():
            for acc, g in zip(sums, bucket.grad_sums, strict=True):
                acc.add_(g.cpu())
        return sums

    def apply_step(
        self, step: int, mean_grads: list[torch.Tensor] | None, samples: int, hold_epoch: bool = False
    ) -> bool:
        """The optimizer step of global step `step` with the stage-averaged mean gradients.

        The learning rate is a function of the step alone, identical on every stage. A non-finite
        average is never applied (every replica sees the same average, so all skip it alike); the
        step still counts, so stages keep agreeing on step numbers; so does a step with no samples
        here (`mean_grads` None: all its micro-batches failed). Returns whether it was applied.
        `hold_epoch`: the step ends with an outer round (`finish_sync` moves the epoch)."""
        if step != self.epoch:
            raise RuntimeError(f"step {step} applied at epoch {self.epoch}")
        with self.state_lock:
            applied = _step_parameters(self, step, mean_grads, samples)
            if not hold_epoch:
                self.epoch += 1
                self.live = self._live_copy()
        self.buckets.pop(step, None)
        return applied

    # rare synchronization (swarm.local_steps) -------------------------------------------------------
    def is_sync_step(self, step: int) -> bool:
        return self.outer is not None and (step + 1) % self.cfg.swarm.local_steps == 0

    def pseudo_gradient(self) -> tuple[int, list[torch.Tensor]]:
        """(samples since the last outer round, anchor - parameters)."""
        assert self.outer is not None
        with self.state_lock:
            return self.samples_since_sync, self.outer.pseudo_gradients()

    def finish_sync(self, step: int, mean_delta: list[torch.Tensor] | None) -> None:
        """The outer step of sync step `step` with the replicas' mean pseudo-gradient (None: nobody
        trained here or nobody else took part: the parameters become the anchor), then the epoch moves
        on."""
        assert self.outer is not None
        if step != self.epoch:
            raise RuntimeError(f"sync step {step} finished at epoch {self.epoch}")
        with self.state_lock:
            if mean_delta is None:
                self.outer.rebase()
            else:
                self.outer.apply(mean_delta)
            self.samples_since_sync = 0
            self.epoch += 1
            self.live = self._live_copy()

    def drop_steps_before(self, epoch: int) -> tuple[int, list[str]]:
        """Forget buckets of steps this replica will never apply (it downloaded a newer state)."""
        lost = [self.buckets.pop(s) for s in sorted(self.buckets) if s < epoch]
        return sum(b.samples for b in lost), [mb for b in lost for mb in b.micro_batch_ids]

    def advance_to(self, epoch: int) -> tuple[int, list[str]]:
        """Adopt a later step number without new parameters (this stage's updates of the skipped steps
        are lost: it was restored from an older checkpoint than the other stages)."""
        with self.state_lock:
            if epoch > self.epoch:
                self.counters.skipped_steps += epoch - self.epoch
                self.epoch = epoch
        return self.drop_steps_before(self.epoch)

    def _live_copy(self) -> list[torch.Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.params]

    # state transfer -----------------------------------------------------------------------------
    def export_state(self) -> tuple[dict, list[torch.Tensor]]:
        """Parameters and AdamW state for a joining replica (called from hivemind's thread)."""
        with self.state_lock:
            tensors = [_host_copy(p) for p in self.params]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                tensors += [
                    _host_copy(self.optimizer.state[p][key]).float().reshape(-1)
                    if key == "step"
                    else _host_copy(self.optimizer.state[p][key])
                    for p in self.params
                ]
            if self.outer is not None:  # the round's anchor and momentum: a joiner syncs like its peers
                tensors += [a.clone() for a in self.outer.anchor]
                tensors += [m.clone() for m in self.outer.momentum_buffers()]
            meta = {
                "epoch": self.epoch,
                "samples_seen": self.samples_seen,
                "names": self.names,
                "digest": self.cfg.digest(),
                "samples_since_sync": self.samples_since_sync,
            }
        return meta, tensors

    def import_state(
        self, meta: dict, tensors: list[torch.Tensor], reapply: list[KeptMean] | None = None
    ) -> tuple[int, list[str]]:
        """Load a downloaded stage state; returns what it made obsolete (samples, micro-batch ids).
        `reapply`: the steps from the state's on, applied again with these means in the same hold of the
        state lock, so the epoch moves once, to after the last of them (`import_keeping_step`)."""
        n = len(self.params)
        if (
            meta.get("names") != self.names
            or meta.get("digest") != self.cfg.digest()
            or len(tensors) not in (4 * n, 6 * n)
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
            self.samples_seen = int(meta["samples_seen"])
            self._import_outer(meta, tensors[4 * n :])
            for step, (samples, grads) in enumerate(reapply or [], start=int(meta["epoch"])):
                _step_parameters(self, step, None if grads is None else [g.clone() for g in grads], samples)
            self.epoch = int(meta["epoch"]) + len(reapply or [])
            self.live = self._live_copy()
        self.cache.clear()
        self.cache_bytes = 0
        return self.drop_steps_before(self.epoch)

    def _import_outer(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """A peer's anchor and momentum; a checkpoint (or a peer stepping every step) has none: the
        round then restarts from the parameters, with no momentum."""
        if self.outer is None:
            return
        n = len(self.params)
        anchor = tensors[:n] if tensors else [p.detach() for p in self.params]
        momentum = tensors[n:] if tensors else [torch.zeros_like(p) for p in self.params]
        params = [p.detach().clone() for p in self.params]
        self.outer.load(anchor, momentum, self.outer.outer_step)
        with torch.no_grad():  # load() restarted the parameters from the anchor: keep the peer's
            for p, value in zip(self.params, params, strict=True):
                p.copy_(value)
        self.samples_since_sync = int(meta.get("samples_since_sync", 0)) if tensors else 0

    def param_fingerprint(self) -> list[float]:
        """Two float64 sums over the parameters: replicas holding the same state agree exactly (same
        operations in the same order); one step applied from other contributions moves them far more
        than stage_sync's FINGERPRINT_RTOL. Unlike a fingerprint of one step's gradient, a divergence
        still shows after later steps."""
        with self.state_lock, torch.no_grad():
            # float64 accumulation without a float64 copy of every parameter (this runs every step)
            absolute = sum(float(torch.linalg.vector_norm(p, 1, dtype=torch.float64)) for p in self.params)
            total = sum(float(p.sum(dtype=torch.float64)) for p in self.params)
        return [absolute, total]


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory, wherever `tensor` is (state for a peer must not alias the live one)."""
    return tensor.detach().to("cpu", copy=True)


_LEDGER_EVENT = {"duplicates": "dup", "late": "late", "not_accumulated": "noacc"}


def _step_parameters(
    worker: StageWorker, step: int, mean_grads: list[torch.Tensor] | None, samples: int
) -> bool:
    """`StageWorker.apply_step`'s parameter update, the epoch aside (under the worker's `state_lock`)."""
    t = worker.cfg.training
    if mean_grads is None or not all_finite(mean_grads):
        worker.counters.skipped_steps += 1
        return False
    grads = [g.to(p.device) for p, g in zip(worker.params, mean_grads, strict=True)]
    if t.grad_clip_norm > 0:
        grads = clipped(grads, t.grad_clip_norm)
    for p, g in zip(worker.params, grads, strict=True):
        p.grad = g
    set_lr(worker.optimizer, lr_at(step * t.global_batch_size, t))
    worker.optimizer.step()
    for p in worker.params:
        p.grad = None
    worker.samples_seen += samples
    worker.samples_since_sync += samples
    return True


def clipped(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """`grads` as `clip_grad_norm_` leaves them (the same norm, the same factor), as new tensors where it
    scales and the same ones where it does not: the means they are kept for replays as they were applied,
    unclipped, without a copy of each step's (stage_steps.py)."""
    norm = torch.nn.utils.get_total_norm(grads)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if bool(factor < 1.0):  # scaled by exactly 1.0 a gradient would be itself
        return [g * factor.to(g.device) for g in grads]
    return grads


def import_keeping_step(
    worker: StageWorker, meta: dict, tensors: list[torch.Tensor], means_of: MeansOf
) -> tuple[int, list[str]]:
    """A resync's download loaded (on the compute thread, as every step is), keeping the step the
    replica reached while it downloaded: its step loop may have closed steps meanwhile, and the state
    alone would take it back to a step its peers closed while it holds samples of a later one (a
    stall). The steps between are applied again with the mean gradients it applied them with, the
    epoch never seen lower; where one is not kept (or it adopted those steps), every sample it holds is
    dropped instead and it catches up as any replica behind its peers. Returns what was made obsolete
    (samples, micro-batch ids)."""
    start, end = int(meta["epoch"]), worker.epoch
    kept = [means_of(step) for step in range(start, end)]
    if all(mean is not None for mean in kept):
        return worker.import_state(meta, tensors, [mean for mean in kept if mean is not None])
    lost_samples, lost_ids = worker.import_state(meta, tensors)
    dropped, ids = worker.drop_steps_before(max(worker.buckets, default=start) + 1)
    return lost_samples + dropped, lost_ids + ids


def all_finite(tensors) -> bool:
    present = [t for t in tensors if t is not None]
    return not present or bool(torch.isfinite(torch.stack([t.sum() for t in present])).all())


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state eagerly (as its first step would) so it can be exported before any step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
