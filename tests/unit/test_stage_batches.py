"""Request batching (runtime/server/stage_batches.py, the compute queue in runtime/server/compute.py): a
batched call returns, per request, what the request alone returns (outputs, losses and input gradients
bitwise in fp32 on CPU), records every micro-batch exactly once, and leaves the step's gradient sum equal
to the one-at-a-time sum up to rounding; retries, late and non-finite micro-batches are decided alone."""

import asyncio
import dataclasses
import threading

import pytest
import torch

from swarmtrain.net.protocol import ProtocolError, StageRequest
from swarmtrain.runtime.server.compute import PRIORITY_FORWARD, ComputeWorker
from swarmtrain.runtime.server.stage_batches import (
    backwards_left,
    batch_item,
    run_backwards,
    run_forwards,
)
from swarmtrain.runtime.server.stage_worker import StageWorker

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]
TRAINERS = 4


@pytest.fixture
def cfg(tiny_cfg):
    return tiny_cfg.replace(training=dataclasses.replace(tiny_cfg.training, micro_batch_size=2))


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (2, 65), generator=generator) for _ in range(TRAINERS)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _req(kind, mb, x, step=0, **kw):
    return StageRequest(kind, mb, "none", x, step=step, **kw)


def _pipeline(cfg, data, batched: bool):
    """Every trainer's micro-batch through 2 stages: forwards of stage 0, fused last stage, backwards of
    stage 0, each kind as one batched call or one call per request."""
    w0, w1 = (StageWorker(cfg, spec) for spec in cfg.stages())

    def run(fn_many, fn_one, requests):
        if batched:
            outcomes = fn_many(requests)
        else:
            outcomes = [fn_one(r) for r in requests]
        assert not any(isinstance(o, Exception) for o in outcomes)
        return outcomes

    forwards = [_req("forward", f"m{i}", x) for i, (x, _) in enumerate(data)]
    hidden = run(lambda rs: run_forwards(w0, rs), w0.forward, forwards)
    fused = [
        _req("forward_backward", f"m{i}", h.tensor("outputs"), labels=y)
        for i, (h, (_, y)) in enumerate(zip(hidden, data, strict=True))
    ]
    last = run(lambda rs: run_forwards(w1, rs), w1.forward, fused)
    backwards = [
        _req("backward", f"m{i}", x, grad_outputs=r.tensor("grad_inputs"))
        for i, ((x, _), r) in enumerate(zip(data, last, strict=True))
    ]
    back = run(lambda rs: run_backwards(w0, rs), w0.backward, backwards)
    return (w0, w1), hidden, last, back


def test_batched_calls_equal_one_request_at_a_time(cfg, data):
    (b0, b1), hidden_b, last_b, back_b = _pipeline(cfg, data, batched=True)
    (s0, s1), hidden_s, last_s, back_s = _pipeline(cfg, data, batched=False)
    for b, s in zip(hidden_b, hidden_s, strict=True):
        assert torch.equal(b.tensor("outputs"), s.tensor("outputs"))
    for b, s in zip(last_b, last_s, strict=True):
        assert b.header["loss"] == s.header["loss"] and b.header["acc"] == s.header["acc"] == 2
        assert torch.equal(b.tensor("grad_inputs"), s.tensor("grad_inputs"))
    for b, s in zip(back_b, back_s, strict=True):
        assert b.header["acc"] == s.header["acc"] == 2
    # the group's graph served every backward: nothing recomputed, nothing left cached
    assert b0.counters.recomputed == 0 and not b0.cache and b0.counters.padded_samples == 0
    for batched, alone in ((b0, s0), (b1, s1)):
        assert batched.buckets[0].samples == alone.buckets[0].samples == 2 * TRAINERS
        assert sorted(batched.buckets[0].micro_batch_ids) == sorted(alone.buckets[0].micro_batch_ids)
        for g_b, g_s in zip(batched.buckets[0].grad_sums, alone.buckets[0].grad_sums, strict=True):
            torch.testing.assert_close(g_b, g_s, rtol=1e-5, atol=1e-6)  # one sum vs four: rounding only
        for key in ("forward", "backward", "fused", "samples_forward"):
            assert getattr(batched.counters, key) == getattr(alone.counters, key), key


def test_evaluations_batched_equal_alone(cfg, data):
    w0, w1 = (StageWorker(cfg, spec) for spec in cfg.stages())
    evals = [_req("evaluate", f"e{i}", x) for i, (x, _) in enumerate(data)]
    batched = run_forwards(w0, evals)
    alone = [w0.forward(r) for r in evals]
    for b, s in zip(batched, alone, strict=True):
        assert torch.equal(b.tensor("outputs"), s.tensor("outputs"))
    last = [
        _req("evaluate", f"e{i}", h.tensor("outputs"), labels=y)
        for i, (h, (_, y)) in enumerate(zip(alone, data, strict=True))
    ]
    assert [m.header["loss"] for m in run_forwards(w1, last)] == [w1.forward(r).header["loss"] for r in last]
    assert not w0.cache and not w0.buckets and not w1.buckets


def test_a_retry_in_a_batch_is_not_accumulated_twice(cfg, data):
    """A micro-batch the stage already holds shares no call: it runs alone and accumulates nothing. Its
    reply still reports the samples this replica holds of it (the first reply was lost), so the trainer's
    close names what the replica holds; once the step is sealed it reports none."""
    w1 = StageWorker(cfg, cfg.stages()[1])
    hidden = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
    first = _req("forward_backward", "m0", hidden, labels=data[0][1])
    w1.forward(first)
    again = [first, _req("forward_backward", "m1", hidden, labels=data[1][1])]
    replies = run_forwards(w1, again)
    assert [r.header["acc"] for r in replies] == [2, 2]
    assert w1.buckets[0].micro_batch_ids == ["m0", "m1"] and w1.counters.duplicates == 1
    assert w1.buckets[0].samples == 4
    w1.seal(0)
    assert w1.forward(first).header["acc"] == 0 and w1.buckets[0].samples == 4


def test_a_non_finite_micro_batch_is_refused_alone(cfg, data):
    """One request with non-finite gradients makes the batched call re-run one by one: only it fails."""
    w1 = StageWorker(cfg, cfg.stages()[1])
    good = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
    bad = good.clone()
    bad[0, 0, 0] = float("inf")
    requests = [
        _req("forward_backward", "good", good, labels=data[0][1]),
        _req("forward_backward", "bad", bad, labels=data[1][1]),
    ]
    outcomes = run_forwards(w1, requests)
    assert outcomes[0].header["acc"] == 2 and isinstance(outcomes[1], ProtocolError)
    assert w1.buckets[0].micro_batch_ids == ["good"] and w1.buckets[0].samples == 2
    assert all(torch.isfinite(g).all() for g in w1.buckets[0].grad_sums)


def test_backwards_that_come_back_one_by_one_use_their_groups_graph(cfg, data):
    """Backwards of a batched forward's micro-batches that come back one at a time each run through the
    group's graph (zero gradient on the others' rows): what each returns alone, counted once, nothing
    recomputed, and the graph released with the last one."""
    w0 = StageWorker(cfg, cfg.stages()[0])
    alone = StageWorker(cfg, cfg.stages()[0])
    forwards = [_req("forward", f"m{i}", x) for i, (x, _) in enumerate(data[:3])]
    run_forwards(w0, forwards)
    for request in forwards:
        alone.forward(request)
    grads = [
        torch.randn(2, cfg.model.seq_len, cfg.model.d_model, generator=torch.Generator().manual_seed(i))
        for i in range(3)
    ]
    backwards = [_req("backward", f"m{i}", data[i][0], grad_outputs=grads[i]) for i in range(3)]
    group = w0.cache["m0"].group
    assert backwards_left(w0, "m1") == 3  # what a backward tells the compute queue to wait for
    replies = [run_backwards(w0, [backwards[i]])[0] for i in (2, 0)]
    assert backwards_left(w0, "m1") == 1 and backwards_left(w0, "m2") == 1  # m2's entry is gone
    replies += run_backwards(w0, [backwards[1]])
    reference = [alone.backward(backwards[i]) for i in (2, 0, 1)]
    assert [r.header["acc"] for r in replies] == [r.header["acc"] for r in reference] == [2, 2, 2]
    assert w0.counters.recomputed == 0 and not w0.cache and not group.pending
    # each backward back-propagated the group's 6 samples, 4 of them with zero gradient: what it cost
    assert w0.counters.padded_samples == 3 * 4
    assert sorted(w0.buckets[0].micro_batch_ids) == ["m0", "m1", "m2"] and w0.buckets[0].samples == 6
    for g_b, g_s in zip(w0.buckets[0].grad_sums, alone.buckets[0].grad_sums, strict=True):
        torch.testing.assert_close(g_b, g_s, rtol=1e-5, atol=1e-6)


def test_a_backward_whose_graph_is_gone_recomputes(cfg, data):
    """No cached graph (evicted, or the forward ran on another replica): recomputed, counted once."""
    w0 = StageWorker(cfg, cfg.stages()[0])
    grad = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
    replies = run_backwards(w0, [_req("backward", f"m{i}", data[i][0], grad_outputs=grad) for i in (0, 1)])
    assert [r.header["acc"] for r in replies] == [2, 2]
    assert w0.counters.recomputed == 2 and w0.buckets[0].samples == 4


def test_the_compute_queue_joins_requests_of_one_key_up_to_the_token_bound(cfg, data):
    """Queued while the thread is busy, four forwards of one step run as calls of at most 2 requests
    (the token bound), forwards of another step never with them; every caller gets its own reply."""
    w0 = StageWorker(cfg, cfg.stages()[0])
    tokens_per_request = 2 * cfg.model.seq_len
    compute = ComputeWorker(max_batch_tokens=2 * tokens_per_request)
    compute.start()
    gate = threading.Event()
    try:

        async def main():
            blocker = compute.submit(lambda: gate.wait(30), 0)  # holds the thread while requests queue
            items = [_req("forward", f"m{i}", x, step=0) for i, (x, _) in enumerate(data)]
            items.append(_req("forward", "other-step", data[0][0], step=1))
            calls = [compute.run_batchable(batch_item(w0, r), PRIORITY_FORWARD) for r in items]
            tasks = [asyncio.ensure_future(c) for c in calls]
            await asyncio.sleep(0.2)  # every request queued behind the blocker
            gate.set()
            results = await asyncio.gather(*tasks)
            await asyncio.wrap_future(blocker)
            return results

        results = asyncio.run(main())
    finally:
        gate.set()
        compute.stop()
    assert [reply.header["mb"] for reply, _ in results] == ["m0", "m1", "m2", "m3", "other-step"]
    assert compute.tasks_done == 6 and compute.calls == 4  # blocker, 2 + 2 of step 0, step 1 alone
    assert all(share_s >= 0 for _, share_s in results)


def test_batching_off_runs_every_request_alone(cfg, data):
    w1 = StageWorker(cfg, cfg.stages()[1])
    compute = ComputeWorker(max_batch_tokens=0)
    compute.start()
    try:
        hidden = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
        requests = [_req("forward_backward", f"m{i}", hidden, labels=y) for i, (_, y) in enumerate(data)]
        futures = [compute.submit(None, PRIORITY_FORWARD, None, batch_item(w1, r)) for r in requests]
        replies = [f.result(timeout=60)[0] for f in futures]
    finally:
        compute.stop()
    assert compute.calls == len(requests) and [r.header["acc"] for r in replies] == [2] * len(requests)


def test_backward_items_key_on_their_kind(cfg, data):
    w0 = StageWorker(cfg, cfg.stages()[0])
    x = data[0][0]
    forward = batch_item(w0, _req("forward", "m0", x))
    backward = batch_item(w0, _req("backward", "m0", x, grad_outputs=torch.zeros(1)))
    assert forward.key != backward.key and forward.tokens == backward.tokens == x.numel()


def test_backwards_of_two_groups_mixed_in_one_call_use_both_graphs(cfg, data):
    """Backwards of two batched forwards' micro-batches that come back mixed (one of each group) run
    through each group's graph; each is accumulated once and returns what it returns alone."""
    w0 = StageWorker(cfg, cfg.stages()[0])
    alone = StageWorker(cfg, cfg.stages()[0])
    run_forwards(w0, [_req("forward", f"m{i}", x) for i, (x, _) in enumerate(data[:2])])
    run_forwards(w0, [_req("forward", f"m{i + 2}", x) for i, (x, _) in enumerate(data[2:4])])
    grad = torch.randn(2, cfg.model.seq_len, cfg.model.d_model, generator=torch.Generator().manual_seed(3))
    mixed = [
        _req("backward", "m0", data[0][0], grad_outputs=grad),
        _req("backward", "m2", data[2][0], grad_outputs=grad),
    ]
    replies = run_backwards(w0, mixed)
    reference = [alone.backward(r) for r in mixed]
    assert [r.header["acc"] for r in replies] == [r.header["acc"] for r in reference] == [2, 2]
    assert w0.counters.recomputed == 0 and set(w0.cache) == {"m1", "m3"}
    assert w0.counters.padded_samples == 2 + 2  # m1's and m3's rows, zero in their groups' backwards
    assert sorted(w0.buckets[0].micro_batch_ids) == ["m0", "m2"] and w0.buckets[0].samples == 4
    for g_b, g_s in zip(w0.buckets[0].grad_sums, alone.buckets[0].grad_sums, strict=True):
        torch.testing.assert_close(g_b, g_s, rtol=1e-5, atol=1e-6)
