"""The tensor side of a stage server, without network: local parity of a global step, at-most-once
accumulation per step, cached graphs across a step, late and non-finite work, state export/import."""

import dataclasses

import pytest
import torch

from swarmtrain.model import build_model
from swarmtrain.model.optim import build_optimizer, lr_at, set_lr
from swarmtrain.net.protocol import ProtocolError, StageRequest
from swarmtrain.runtime.server import stage_worker
from swarmtrain.runtime.server.stage_worker import StageWorker, import_keeping_step

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


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


def _req(kind, mb, x, step=0, **kw):
    return StageRequest(kind, mb, "none", x, step=step, **kw)


def _micro_batch(workers, mb, x, y, step=0):
    """Trainer logic in-process: forward stage 0, fused last stage, backward stage 0."""
    h = workers[0].forward(_req("forward", mb, x, step)).tensor("outputs")
    reply = workers[1].forward(_req("forward_backward", mb, h, step, labels=y))
    grad = reply.tensor("grad_inputs")
    back = workers[0].backward(_req("backward", mb, x, step, grad_outputs=grad))
    return reply.header["loss"], grad, back


def _step(worker, step=None):
    """What the stage's replicas do once the step is closed (runtime/server/stage_steps.py), one replica."""
    step = worker.epoch if step is None else step
    bucket = worker.seal(step)
    return worker.apply_step(step, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)


def test_one_global_step_equals_local_training(tiny_cfg, batches):
    cfg = tiny_cfg.replace(training=dataclasses.replace(tiny_cfg.training, grad_clip_norm=0.0))
    workers = [StageWorker(cfg, spec) for spec in cfg.stages()]
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch(workers, f"m{i}", x, y)
    assert workers[0].buckets[0].samples == 32 and workers[0].unapplied_samples == 32
    for w in workers:
        assert _step(w)
    local_params = _local_step(cfg, batches[:4])
    for w in workers:
        assert w.epoch == 1 and w.samples_seen == 32 and not w.buckets
        for name, p in zip(w.names, w.params, strict=True):
            torch.testing.assert_close(p, local_params[name], rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_of_the_next_step_never_mix_into_this_one(tiny_cfg, batches):
    """With 8 in flight, step 1's gradients arrive before step 0 is applied: separate buckets."""
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    for i, (x, y) in enumerate(batches[:6]):
        _micro_batch(workers, f"m{i}", x, y, step=i // 4)
    assert [workers[0].buckets[s].samples for s in (0, 1)] == [32, 16]
    _step(workers[0])
    assert workers[0].epoch == 1 and workers[0].buckets[1].samples == 16 and workers[0].samples_seen == 32


def test_a_retried_backward_is_never_applied_twice(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    _, grad, _ = _micro_batch(workers, "m0", x, y)
    sums = [g.clone() for g in workers[0].buckets[0].grad_sums]
    again = workers[0].backward(_req("backward", "m0", x, grad_outputs=grad))
    assert workers[0].unapplied_samples == 8 and workers[0].counters.duplicates == 1
    assert all(torch.equal(a, b) for a, b in zip(sums, workers[0].buckets[0].grad_sums, strict=True))
    assert again.kind == "result" and again.header["acc"] == 8  # held here once: reported, not re-added
    fused = workers[1].forward(_req("forward_backward", "m0", torch.randn(8, 64, 64), labels=y))
    assert workers[1].unapplied_samples == 8 and "grad_inputs" in fused.tensors  # answered, not re-applied


def test_a_restarted_trainer_reusing_ids_is_not_dropped_and_ids_stay_bounded(tiny_cfg, batches):
    """On the old server a set of every accumulated id grew forever, and a trainer restarted with the
    same --trainer-id (ids from 0 again) had every gradient dropped as a duplicate."""
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    for step in range(3):
        for i, (x, y) in enumerate(batches[:4]):
            _, _, back = _micro_batch(workers, f"t-{i}", x, y, step=step)  # the same ids every step
            assert back.header["acc"] == 8
        for w in workers:
            _step(w)
    assert workers[0].counters.duplicates == 0 and workers[0].samples_seen == 96
    assert not workers[0].buckets  # nothing kept per micro-batch once a step is applied


def test_work_queued_before_a_resync_is_not_accumulated_into_the_new_state(tiny_cfg, batches):
    """A backward that waited in the compute queue while the replica downloaded a newer state ran on
    the old parameters and was accumulated into the new epoch; now its step is over: late."""
    donor = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch(donor, f"m{i}", x, y)
    _step(donor[0])
    lagging = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    x, y = batches[4]
    h = lagging.forward(_req("forward", "q", x)).tensor("outputs")
    grad = donor[1].forward(_req("forward_backward", "q", h, labels=y)).tensor("grad_inputs")
    lagging.import_state(*donor[0].export_state())  # the resync ran before the queued backward
    back = lagging.backward(_req("backward", "q", x, grad_outputs=grad))
    assert back.header["acc"] == 0 and back.kind == "result"
    assert lagging.counters.late == 1 and lagging.unapplied_samples == 0


def test_a_step_already_closed_takes_no_more_gradients(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    _micro_batch(workers, "m0", *batches[0])
    workers[0].seal(0)
    _, _, back = _micro_batch(workers, "m1", *batches[1])
    assert back.header["acc"] == 0 and workers[0].buckets[0].samples == 8


def test_non_finite_gradients_are_refused_and_a_non_finite_step_is_never_applied(tiny_cfg, batches):
    w = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    x, _ = batches[0]
    w.forward(_req("forward", "m", x))
    huge = torch.full((8, 64, 64), 3e38)  # finite in fp32, but the parameter gradients overflow
    with pytest.raises(ProtocolError, match="non-finite"):
        w.backward(_req("backward", "m", x, grad_outputs=huge))
    assert w.unapplied_samples == 0 and w.counters.rejected_nonfinite == 1
    before = [p.detach().clone() for p in w.params]
    nan = [torch.full_like(p, float("nan")) for p in w.params]
    assert not w.apply_step(0, nan, 32)  # an average that went bad is skipped, the step still counts
    assert w.epoch == 1 and w.counters.skipped_steps == 1
    assert all(torch.equal(a, b) and torch.isfinite(b).all() for a, b in zip(before, w.params, strict=True))


def test_cached_graph_survives_an_optimizer_step(tiny_cfg, batches):
    """With max_staleness = 1 a step's forward may run before the previous step is applied."""
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    h = workers[0].forward(_req("forward", "late", x, step=1)).tensor("outputs")
    for i, (xb, yb) in enumerate(batches[1:5]):  # a full global batch passes, stage 0 steps
        _micro_batch(workers, f"m{i}", xb, yb)
    _step(workers[0])
    assert workers[0].epoch == 1
    grad = workers[1].forward(_req("forward_backward", "late", h, 1, labels=y)).tensor("grad_inputs")
    workers[0].backward(_req("backward", "late", x, 1, grad_outputs=grad))
    assert workers[0].counters.recomputed == 0 and workers[0].buckets[1].samples == 8


def test_backward_on_another_replica_recomputes(tiny_cfg, batches):
    a, b = (StageWorker(tiny_cfg, tiny_cfg.stages()[0]) for _ in range(2))
    last = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    x, y = batches[0]
    h = a.forward(_req("forward", "m", x)).tensor("outputs")
    grad = last.forward(_req("forward_backward", "m", h, labels=y)).tensor("grad_inputs")
    a.backward(_req("backward", "m", x, grad_outputs=grad))
    b.backward(_req("backward", "m2", x, grad_outputs=grad))
    assert b.counters.recomputed == 1
    for ga, gb in zip(a.buckets[0].grad_sums, b.buckets[0].grad_sums, strict=True):
        torch.testing.assert_close(ga, gb)


def test_a_retry_after_a_silent_replica_returns_gradients_without_accumulating(tiny_cfg, batches):
    workers = [StageWorker(tiny_cfg, spec) for spec in tiny_cfg.stages()]
    x, y = batches[0]
    h = workers[0].forward(_req("forward", "m", x)).tensor("outputs")
    full = workers[1].forward(_req("forward_backward", "m", h, labels=y))
    other = StageWorker(tiny_cfg, tiny_cfg.stages()[1])  # the replica the retry went to
    retry = other.forward(_req("forward_backward", "m", h, labels=y, accumulate=False))
    torch.testing.assert_close(retry.tensor("grad_inputs"), full.tensor("grad_inputs"))
    assert retry.header["loss"] == pytest.approx(full.header["loss"])
    assert other.unapplied_samples == 0 and other.counters.not_accumulated == 1
    spare = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    back = spare.backward(_req("backward", "m", x, grad_outputs=full.tensor("grad_inputs"), accumulate=False))
    assert back.kind == "result" and back.header["acc"] == 0 and spare.unapplied_samples == 0


def test_state_export_import_round_trip(tiny_cfg, batches):
    a = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    last = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch([a, last], f"m{i}", x, y)
    _step(a)
    b = StageWorker(tiny_cfg, tiny_cfg.stages()[0])
    _micro_batch([b, last], "old", *batches[5])  # b's own unapplied step-0 work becomes obsolete
    lost_samples, lost_ids = b.import_state(*a.export_state())
    assert (lost_samples, lost_ids) == (8, ["old"]) and not b.buckets
    assert (b.epoch, b.samples_seen) == (a.epoch, a.samples_seen) == (1, 32)
    for pa, pb in zip(a.params, b.params, strict=True):
        assert torch.equal(pa, pb)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[pa][key], b.optimizer.state[pb][key])
    other_stage = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    with pytest.raises(ValueError):
        other_stage.import_state(*a.export_state())


def _train_and_close(worker, batches, step):
    """Samples of `step` accumulated and the step applied; returns the (samples, means) it applied."""
    for i, (x, _) in enumerate(batches):
        worker.forward(_req("forward", f"s{step}-{i}", x, step=step))
        worker.backward(_req("backward", f"s{step}-{i}", x, step=step, grad_outputs=torch.ones(8, 64, 64)))
    bucket = worker.seal(step)
    means = [g / bucket.samples for g in bucket.grad_sums]
    kept = (bucket.samples, [m.clone() for m in means])
    worker.apply_step(step, means, bucket.samples)
    return kept


def _one_sample_of(worker, batches, step):
    worker.forward(_req("forward", f"s{step}-0", batches[2][0], step=step))
    worker.backward(
        _req("backward", f"s{step}-0", batches[2][0], step=step, grad_outputs=torch.ones(8, 64, 64))
    )


def test_a_state_behind_the_step_closed_during_its_download_is_caught_up_with_the_replicas_own_means(
    tiny_cfg, batches, monkeypatch
):
    """A resync decided at step 1 downloads a donor's state of step 1 while the replica's step loop closes
    step 1: loaded alone it would set the replica back to 1, holding samples of step 2 its peers go on
    without. The donor's state is loaded and step 1 applied again with the means the replica applied it
    with, the epoch never lower than 2; the samples of step 2 stay."""
    donor, replica, expected = (StageWorker(tiny_cfg, tiny_cfg.stages()[0]) for _ in range(3))
    _train_and_close(donor, batches[3:5], 0)  # the donor's line differs from the replica's
    _train_and_close(replica, batches[:2], 0)
    kept = _train_and_close(replica, batches[:2], 1)
    _one_sample_of(replica, batches, 2)
    state = donor.export_state()
    expected.import_state(*state)
    expected.apply_step(1, [g.clone() for g in kept[1]], kept[0])
    seen = []
    step_once = stage_worker._step_parameters
    monkeypatch.setattr(
        stage_worker, "_step_parameters", lambda w, *a: seen.append(w.epoch) or step_once(w, *a)
    )
    lost = import_keeping_step(replica, *state, {1: kept}.get)
    assert lost == (0, []) and seen == [2] and replica.epoch == 2 and replica.unapplied_samples == 8
    assert replica.samples_seen == expected.samples_seen
    for a, b in zip(expected.params, replica.params, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(expected.optimizer.state[a]["exp_avg"], replica.optimizer.state[b]["exp_avg"])


def test_a_state_behind_with_a_mean_not_kept_drops_the_samples_the_replica_holds(tiny_cfg, batches):
    donor, replica = (StageWorker(tiny_cfg, tiny_cfg.stages()[0]) for _ in range(2))
    _train_and_close(replica, batches[:2], 0)
    _one_sample_of(replica, batches, 1)
    lost = import_keeping_step(replica, *donor.export_state(), lambda step: None)
    assert lost == (8, ["s1-0"]) and replica.epoch == 0 and not replica.buckets
    assert all(torch.equal(a, p) for a, p in zip(donor.params, replica.params, strict=True))


def test_an_update_that_clips_leaves_the_mean_gradients_it_was_given_as_they_were(tiny_cfg, batches):
    """Clipping makes new tensors (`stage_worker.clipped`), so a replica keeps the means it applied for
    replays without a copy of them; the parameters move exactly as with torch's in-place
    `clip_grad_norm_`. A norm under the bound leaves the very same tensors."""
    cfg = tiny_cfg.replace(training=dataclasses.replace(tiny_cfg.training, grad_clip_norm=1e-3))
    workers = [StageWorker(cfg, spec) for spec in cfg.stages()]
    for i, (x, y) in enumerate(batches[:4]):
        _micro_batch(workers, f"m{i}", x, y)
    worker, reference = workers[0], StageWorker(cfg, cfg.stages()[0])
    bucket = worker.seal(0)
    means = [g / bucket.samples for g in bucket.grad_sums]
    before = [m.clone() for m in means]
    for p, m in zip(reference.params, means, strict=True):
        p.grad = m.clone()
    torch.nn.utils.clip_grad_norm_(reference.params, cfg.training.grad_clip_norm)
    set_lr(reference.optimizer, lr_at(0, cfg.training))
    reference.optimizer.step()
    assert worker.apply_step(0, means, bucket.samples)
    assert all(torch.equal(m, b) for m, b in zip(means, before, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(worker.params, reference.params, strict=True))
    assert stage_worker.clipped(means, 1e9) is means
