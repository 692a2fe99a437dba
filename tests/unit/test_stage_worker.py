"""The tensor side of a stage server, without network: local parity of a global step, at-most-once
accumulation, cached graphs across a step, the global-batch cut, state export/import."""

import dataclasses

import pytest
import torch

from swarmtrain.model import build_model
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr
from swarmtrain.net.protocol import StageRequest
from swarmtrain.runtime.stage_worker import StageWorker

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: thread start-up and contention on a shared machine cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batches():
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (8, 65), generator=generator) for _ in range(8)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _local_step(cfg, batches):
    """The local baseline's step (runtime/local.py), on the whole model."""
    model = build_model(cfg.model, seed=cfg.training.seed)
    optimizer = build_optimizer(model, cfg.training)
    set_lr(optimizer, lr_at(0, cfg.training))
    for x, y in batches:
        (model(x, y) / len(batches)).backward()
    optimizer.step()
    return dict(model.named_parameters())


def _micro_batch(workers, mb, x, y):
    """Trainer logic in-process: forward stage 0, fused last stage, backward stage 0."""
    h = workers[0].forward(StageRequest("forward", mb, "none", x)).tensor("outputs")
    reply = workers[1].forward(StageRequest("forward", mb, "none", h, labels=y, fused_backward=True))
    grad = reply.tensor("grad_inputs")
    workers[0].backward(StageRequest("backward", mb, "none", x, grad_outputs=grad))
    return reply.header["loss"], grad


def _step(worker):
    snap = worker.take_round_snapshot()
    worker.apply_update([g / snap.samples for g in snap.grad_sums], snap.samples)


def test_one_global_step_equals_local_training(tiny_cfg, batches):
    cfg = tiny_cfg.replace(training=dataclasses.replace(tiny_cfg.training, grad_clip_norm=0.0))
    workers = [StageWorker(cfg, spec) for spec in cfg.stages()]
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch(workers, f"m{i}", x, y)
    assert workers[0].frozen is not None and workers[0].frozen.samples == 32  # cut at the global batch
    for w in workers:
        _step(w)
    local_params = _local_step(cfg, batches[:4])
    for w in workers:
        assert w.epoch == 1 and w.samples_seen == 32
        for name, p in zip(w.names, w.params, strict=True):
            torch.testing.assert_close(p, local_params[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_retried_backward_is_never_applied_twice(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    _, grad = _micro_batch(workers, "m0", x, y)
    sums = [g.clone() for g in workers[0].grad_sums]
    again = workers[0].backward(StageRequest("backward", "m0", "none", x, grad_outputs=grad))
    assert workers[0].pending_samples == 8 and workers[0].counters["duplicates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(sums, workers[0].grad_sums, strict=True))
    assert again.kind == "result"
    fused = workers[1].forward(
        StageRequest("forward", "m0", "none", torch.randn(8, 64, 64), labels=y, fused_backward=True)
    )
    assert workers[1].pending_samples == 8 and "grad_inputs" in fused.tensors  # answered, not re-applied


def test_cached_graph_survives_an_optimizer_step(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    h = workers[0].forward(StageRequest("forward", "late", "none", x)).tensor("outputs")
    for i, (xb, yb) in enumerate(batches[1:5]):  # a full global batch passes, stage 0 steps
        _micro_batch(workers, f"m{i}", xb, yb)
    _step(workers[0])
    assert workers[0].epoch == 1
    grad = (
        workers[1]
        .forward(StageRequest("forward", "late", "none", h, labels=y, fused_backward=True))
        .tensor("grad_inputs")
    )
    workers[0].backward(StageRequest("backward", "late", "none", x, grad_outputs=grad))
    assert workers[0].counters["recomputed"] == 0 and workers[0].pending_samples == 8


def test_backward_on_another_replica_recomputes(tiny_cfg, batches):
    a, b = (StageWorker(tiny_cfg, tiny_cfg.stages()[0]) for _ in range(2))
    last = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    x, y = batches[0]
    h = a.forward(StageRequest("forward", "m", "none", x)).tensor("outputs")
    grad = last.forward(StageRequest("forward", "m", "none", h, labels=y, fused_backward=True)).tensor(
        "grad_inputs"
    )
    a.backward(StageRequest("backward", "m", "none", x, grad_outputs=grad))
    b.backward(StageRequest("backward", "m2", "none", x, grad_outputs=grad))
    assert b.counters["recomputed"] == 1
    for ga, gb in zip(a.grad_sums, b.grad_sums, strict=True):
        torch.testing.assert_close(ga, gb)


def test_a_retry_after_a_silent_replica_returns_gradients_without_accumulating(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    h = workers[0].forward(StageRequest("forward", "m", "none", x)).tensor("outputs")
    full = workers[1].forward(StageRequest("forward", "m", "none", h, labels=y, fused_backward=True))
    other = StageWorker(tiny_cfg, tiny_cfg.stages()[1])  # the replica the retry went to
    retry = other.forward(
        StageRequest("forward", "m", "none", h, labels=y, fused_backward=True, accumulate=False)
    )
    torch.testing.assert_close(retry.tensor("grad_inputs"), full.tensor("grad_inputs"))
    assert retry.header["loss"] == pytest.approx(full.header["loss"])
    assert other.pending_samples == 0 and other.counters["not_accumulated"] == 1
    assert all(not g.any() for g in other.grad_sums)
    spare = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    back = spare.backward(
        StageRequest("backward", "m", "none", x, grad_outputs=full.tensor("grad_inputs"), accumulate=False)
    )
    assert back.kind == "result" and spare.pending_samples == 0 and "m" not in spare.accumulated_ids


def test_failed_round_puts_the_snapshot_back(tiny_cfg, batches):
    w = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    last = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    _micro_batch([w, last], "m0", *batches[0])
    before = [g.clone() for g in w.grad_sums]
    snap = w.take_round_snapshot()
    assert w.pending_samples == 0 and w.unapplied_samples == 0
    w.restore_snapshot(snap)
    assert w.pending_samples == 8 and w.pending_ids == ["m0"]
    assert all(torch.equal(a, b) for a, b in zip(before, w.grad_sums, strict=True))
    lost, ids = w.drop_pending()
    assert lost == 8 and ids == ["m0"] and w.unapplied_samples == 0


def test_state_export_import_round_trip(tiny_cfg, batches):
    a = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    last = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch([a, last], f"m{i}", x, y)
    _step(a)
    b = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    b.import_state(*a.export_state())
    assert (b.epoch, b.samples_seen) == (a.epoch, a.samples_seen) == (1, 32)
    for pa, pb in zip(a.params, b.params, strict=True):
        assert torch.equal(pa, pb)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[pa][key], b.optimizer.state[pb][key])
    other_stage = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    with pytest.raises(ValueError):
        other_stage.import_state(*a.export_state())
