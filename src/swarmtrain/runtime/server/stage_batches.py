"""Request batching on a stage: queued micro-batches of one kind and step computed as one call.

The compute thread (runtime/server/compute.py) hands `run_forwards` or `run_backwards` the requests it
took together; each returns one outcome per request, equal to what `StageWorker.forward`/`backward`
would return for it alone:

- outputs, losses and input gradients are computed per sample, so a micro-batch's rows of a
  concatenated call are its own (bitwise in fp32 on CPU: tests/unit/test_stage_batches.py);
- the parameter gradients of a call are one sum over its micro-batches, added to their step's bucket
  once, and every micro-batch is recorded in the bucket and the ledger as if it ran alone. Only requests
  that may all accumulate share a call (a retry, a late or a not-accumulated micro-batch runs alone), so
  at-most-once accumulation is decided per micro-batch exactly as before. The sum differs from adding the
  micro-batches one by one in floating-point rounding only;
- a call whose parameter gradients are not finite is run again one request at a time, so only the
  micro-batch that caused it is refused;
- a batched training forward keeps one graph for its micro-batches (`Group`); the backwards of its
  members use it whenever they come back, together or not: each call back-propagates the whole group's
  outputs with zero gradient on the rows of members not in it (exactly zero contribution to the
  parameter gradients), keeping the graph until its last member is back. Backwards without a graph
  (none kept: evicted, or another replica ran the forward) are recomputed together: one forward and one
  backward of their concatenated inputs (bench/device_stage.py counts these recomputes).

On a small micro-batch most of a call's cost does not grow with its size (Python, dispatch, one kernel
launch per operation), which is what batching saves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from swarmtrain.config import RunConfig
from swarmtrain.model.device import ComputeDevice, busy_clock_s
from swarmtrain.net.protocol import ProtocolError, StageRequest
from swarmtrain.runtime.server.compute import BatchItem
from swarmtrain.runtime.server.stage_replies import Reply
from swarmtrain.runtime.server.stage_worker import CacheEntry, StageWorker, all_finite


@dataclass(eq=False)
class Group:
    """The graph of one batched training forward: its micro-batches in order and their row offsets."""

    members: tuple[str, ...]
    offsets: tuple[int, ...]  # len(members) + 1 row boundaries
    inputs: torch.Tensor  # the concatenated inputs (a leaf with requires_grad for hidden states)
    outputs: torch.Tensor
    params: list[torch.Tensor]
    pending: set[str] = field(init=False)  # members whose backward has not run through the graph yet

    def __post_init__(self) -> None:
        self.pending = set(self.members)


def batch_item(worker: StageWorker, request: StageRequest, mates: int = 1) -> BatchItem:
    """The compute queue's view of a request: requests of one kind with equal keys may share a call (a
    `backward` runs `run_backwards`, every other kind the forward); `mates`: how many of them (this one
    included) are known to be arriving together."""
    inputs = request.inputs
    key: Hashable = (request.kind, request.step, tuple(inputs.shape[1:]), inputs.dtype)
    tokens = int(inputs.shape[0]) * (int(inputs.shape[1]) if inputs.dim() > 1 else 1)
    if request.kind == "backward":
        return BatchItem(key, tokens, request, lambda rs: run_backwards(worker, rs), mates)
    return BatchItem(key, tokens, request, lambda rs: run_forwards(worker, rs), mates)


def backwards_left(worker: StageWorker, micro_batch_id: str) -> int:
    """The backwards its batched forward's group still expects (1 for a micro-batch without a group)."""
    entry = worker.cache.get(micro_batch_id)
    group = entry.group if entry is not None else None
    return len(group.pending) if isinstance(group, Group) and group.pending else 1


def run_forwards(worker: StageWorker, requests: list[StageRequest]) -> Sequence[Reply | Exception]:
    """`worker.forward` of each request (the last stage's fused forward and backward included)."""
    if len(requests) == 1:
        return _one_by_one(worker.forward, requests)
    if requests[0].evaluate:
        return _evaluate(worker, requests)
    if not _may_share_accumulation(worker, requests):
        return _one_by_one(worker.forward, requests)
    if worker.spec.is_last:
        return _fused(worker, requests)
    return _forward_group(worker, requests)


def run_backwards(worker: StageWorker, requests: list[StageRequest]) -> Sequence[Reply | Exception]:
    """`worker.backward` of each request. The members here of a group back-propagate its graph once
    (whether or not the whole group is here); a micro-batch with a graph of its own uses it; the others
    (no graph kept) are recomputed together in one forward and one backward."""
    entries = {r.micro_batch_id: worker.cache_pop(r.micro_batch_id) for r in requests}
    by_mb = {r.micro_batch_id: r for r in requests}
    if len(by_mb) < len(requests) or not _may_share_accumulation(worker, requests):
        return [_guarded(lambda r=r: worker.backward_from(r, entries[r.micro_batch_id])) for r in requests]
    outcomes: dict[str, Reply | Exception] = {}
    for group in {id(e.group): e.group for e in entries.values() if e is not None and e.group}.values():
        assert isinstance(group, Group)
        here = [mb for mb in group.members if mb in by_mb and mb in group.pending]
        if here and _group_usable(worker, group, entries, by_mb, here):
            outcomes.update(_group_backward(worker, group, [by_mb[mb] for mb in here]))
    recompute = []
    for request in requests:
        mb, entry = request.micro_batch_id, entries[request.micro_batch_id]
        if mb in outcomes:
            continue
        if (
            entry is not None
            and not entry.shared
            and worker.entry_usable(entry, worker.compute.to_device(request.inputs))
        ):
            outcomes[mb] = _guarded(lambda r=request, e=entry: worker.backward_from(r, e))
        else:
            recompute.append(request)
    if len(recompute) > 1:
        outcomes.update(_recompute_backward(worker, recompute))
    elif recompute:
        outcomes[recompute[0].micro_batch_id] = _guarded(lambda: worker.backward_from(recompute[0], None))
    return [outcomes[r.micro_batch_id] for r in requests]


# forwards ---------------------------------------------------------------------------------------------
def _evaluate(worker: StageWorker, requests: list[StageRequest]) -> list[Reply | Exception]:
    inputs, offsets = _concat(worker, [r.inputs for r in requests])
    with torch.no_grad():
        outputs = worker.run_module(worker.live, inputs, *_logits_args(worker, requests))
        replies = []
        for request, (a, b) in zip(requests, _spans(offsets), strict=True):
            worker.counters.eval += 1
            mb = request.micro_batch_id
            if worker.spec.is_last:
                loss = worker.module.loss(outputs[a:b], worker.compute.to_device(request.labels))
                replies.append(worker.replies.result({"mb": mb, "loss": float(loss)}, {}, request.codec))
            else:
                replies.append(worker.replies.result({"mb": mb}, {"outputs": outputs[a:b]}, request.codec))
    return replies


def _forward_group(worker: StageWorker, requests: list[StageRequest]) -> list[Reply | Exception]:
    inputs, offsets = _concat(worker, [r.inputs for r in requests])
    inputs = inputs if worker.spec.is_first else inputs.detach().requires_grad_(True)
    params = worker.live
    outputs = worker.run_module(params, inputs)
    members = tuple(r.micro_batch_id for r in requests)
    group = Group(members, offsets, inputs, outputs, params)
    replies: list[Reply | Exception] = []
    for request, (a, b) in zip(requests, _spans(offsets), strict=True):
        entry = CacheEntry(worker.epoch, inputs[a:b].detach(), outputs[a:b], params, group=group)
        worker.cache_put(request.micro_batch_id, entry)
        worker.counters.forward += 1
        worker.counters.samples_forward += request.num_samples
        tensors = {"outputs": outputs[a:b]}
        replies.append(worker.replies.result({"mb": request.micro_batch_id}, tensors, request.codec))
    return replies


def _fused(worker: StageWorker, requests: list[StageRequest]) -> list[Reply | Exception]:
    """The last stage's forward, loss and backward of several micro-batches in one graph."""
    inputs, offsets = _concat(worker, [r.inputs for r in requests])
    inputs = inputs.detach().requires_grad_(not worker.spec.is_first)
    params = worker.live
    logits = worker.run_module(params, inputs, *_logits_args(worker, requests))
    spans = _spans(offsets)
    losses = [
        worker.module.loss(logits[a:b], worker.compute.to_device(r.labels))
        for r, (a, b) in zip(requests, spans, strict=True)
    ]
    # each micro-batch back-propagates loss * its samples, as alone (the stage's buckets hold sums)
    total = torch.stack([loss * r.num_samples for loss, r in zip(losses, requests, strict=True)]).sum()
    wants_input_grad = inputs.requires_grad
    grads = torch.autograd.grad(total, params + ([inputs] if wants_input_grad else []), allow_unused=True)
    param_grads = grads[: len(params)]
    if not all_finite(param_grads):
        return _one_by_one(worker.forward, requests)  # find the micro-batch at fault, keep the others
    worker.accumulate(requests, param_grads)
    replies: list[Reply | Exception] = []
    for request, loss, (a, b) in zip(requests, losses, spans, strict=True):
        worker.counters.fused += 1
        worker.counters.samples_forward += request.num_samples
        sent = grads[-1][a:b, ..., worker.grad_columns] if wants_input_grad else None  # coordinates only
        tensors = {"grad_inputs": sent} if sent is not None else {}
        header = {"mb": request.micro_batch_id, "loss": float(loss.detach()), "acc": request.num_samples}
        replies.append(worker.replies.result(header, tensors, request.codec))
    return replies


# backwards --------------------------------------------------------------------------------------------
def _group_usable(worker: StageWorker, group: Group, entries: dict, by_mb: dict, members: list[str]) -> bool:
    """Each of `members` has its entry of this group, still usable, for the inputs its backward brings."""
    for mb in members:
        entry = entries.get(mb)
        if entry is None or entry.group is not group:
            return False
        if not worker.entry_usable(entry, worker.compute.to_device(by_mb[mb].inputs)):
            return False
    return True


def _recompute_backward(worker: StageWorker, requests: list[StageRequest]) -> dict:
    """Micro-batches without a usable graph: one forward of their concatenated inputs, one backward."""
    inputs, offsets = _concat(worker, [r.inputs for r in requests])
    inputs = inputs if worker.spec.is_first else inputs.detach().requires_grad_(True)
    params = worker.live
    group = Group(
        tuple(r.micro_batch_id for r in requests), offsets, inputs, worker.run_module(params, inputs), params
    )
    worker.counters.recomputed += len(requests)
    return _group_backward(worker, group, requests)


def _group_backward(worker: StageWorker, group: Group, requests: list[StageRequest]) -> dict:
    """One backward through a group's graph with the output gradients of `requests` (members of the
    group, in its order) and zero on the other members' rows; the graph is kept while members are left."""
    grads_by_mb = {r.micro_batch_id: worker.compute.to_device(r.grad_outputs) for r in requests}
    like = next(iter(grads_by_mb.values()))
    spans = dict(zip(group.members, _spans(group.offsets), strict=True))
    parts = [
        grads_by_mb[mb] if mb in grads_by_mb else like.new_zeros((b - a, *like.shape[1:]))
        for mb, (a, b) in spans.items()
    ]
    group.pending -= grads_by_mb.keys()
    worker.counters.padded_samples += sum(b - a for mb, (a, b) in spans.items() if mb not in grads_by_mb)
    wants_input_grad = group.inputs.requires_grad
    extra = [group.inputs] if wants_input_grad else []
    grads = torch.autograd.grad(
        group.outputs,
        group.params + extra,
        torch.cat(parts),
        allow_unused=True,
        retain_graph=bool(group.pending),
    )
    param_grads = grads[: len(group.params)]
    if not all_finite(param_grads):  # each recomputes alone, so only the one at fault is refused
        return {r.micro_batch_id: _guarded(lambda r=r: worker.backward_from(r, None)) for r in requests}
    worker.accumulate(requests, param_grads)
    outcomes: dict[str, Reply | Exception] = {}
    for request in requests:
        a, b = spans[request.micro_batch_id]
        worker.counters.backward += 1
        sent = grads[-1][a:b, ..., worker.grad_columns] if wants_input_grad else None  # coordinates only
        tensors = {"grad_inputs": sent} if sent is not None else {}
        header = {"mb": request.micro_batch_id, "acc": request.num_samples}
        outcomes[request.micro_batch_id] = worker.replies.result(header, tensors, request.codec)
    return outcomes


# helpers ----------------------------------------------------------------------------------------------
def _may_share_accumulation(worker: StageWorker, requests: list[StageRequest]) -> bool:
    """Distinct micro-batches that all accumulate now: their gradients may be summed in one call."""
    ids = {r.micro_batch_id for r in requests}
    return len(ids) == len(requests) and all(worker.skip_reason(r) is None for r in requests)


def _concat(worker: StageWorker, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + int(t.shape[0]))
    return worker.compute.to_device(torch.cat(tensors)), tuple(offsets)


def _logits_args(worker: StageWorker, requests: list[StageRequest]) -> tuple:
    """The module's arguments after its inputs when each request's loss is taken from one batch's
    logits: the batch's labels and logits_only where the stage reads labels (a `lowrank-embed`
    boundary's tokens); nothing otherwise, so the hot path concatenates no labels it does not use."""
    if not worker.module.reads_labels:
        return ()
    labels, _ = _concat(worker, [cast(torch.Tensor, r.labels) for r in requests])  # the last stage's: checked
    return labels, True


def _spans(offsets: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def _one_by_one(fn, requests: list[StageRequest]) -> list[Reply | Exception]:
    return [_guarded(lambda r=r: fn(r)) for r in requests]


def _guarded(call) -> Reply | Exception:
    """A request's outcome: its reply, or the protocol error its caller gets (others in the call go on)."""
    try:
        return call()
    except ProtocolError as exc:
        return exc


def probe_samples_per_s(worker: StageWorker, cfg: RunConfig, compute: ComputeDevice) -> float:
    """A first throughput estimate (fwd+bwd ~ 3x a forward) in samples per CPU second, like the
    capacity meter's, which replaces it once it has measured enough samples. Timed in CPU, not wall
    time: under a CPU quota beside other starting servers, wall time read identical stage-0 servers
    at 33 to 506 samples/s (bench/rebalance_live.py)."""
    t, m, spec = cfg.training, cfg.model, worker.spec
    ids = int(worker.io_has_ids)  # after a subspace boundary: a last column of token ids (0 is one)
    width = m.wire_dim + ids
    shape = (t.micro_batch_size, m.seq_len) if spec.is_first else (t.micro_batch_size, m.seq_len, width)
    sample = torch.zeros(shape, dtype=torch.long) if spec.is_first else torch.randn(shape)
    if ids:
        sample[..., -1] = 0
    sample = compute.to_device(sample)
    # the last stage's logits, with labels where a boundary reads them (model/boundary.py)
    labels = torch.zeros((t.micro_batch_size, m.seq_len), dtype=torch.long)
    args = (compute.to_device(labels), True) if worker.module.reads_labels else ()
    repeats = 3
    with torch.no_grad(), compute.autocast():
        worker.module(sample, *args)
        start_s = busy_clock_s(compute.device)  # the capacity meter's clock (model/device.py)
        for _ in range(repeats):
            worker.module(sample, *args)
        elapsed_s = busy_clock_s(compute.device) - start_s
    return t.micro_batch_size * repeats / max(3 * elapsed_s, 1e-6)
