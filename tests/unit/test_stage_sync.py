"""Keeping replicas in line (runtime/server/stage_sync.py), on fakes of the DHT records and of the averager."""

import logging
import time

import pytest
import torch

from swarmtrain.net.protocol import StageRequest
from swarmtrain.planner.catch_up import Heard, SwarmAhead
from swarmtrain.runtime.ledger import Ledger, read_ledger
from swarmtrain.runtime.server.stage_catch_up import Detached, Replay
from swarmtrain.runtime.server.stage_sync import (
    Fingerprint,
    StageSynchronizer,
    SyncSettings,
    _follows_diverged,
)
from swarmtrain.runtime.server.stage_worker import StageWorker

pytestmark = pytest.mark.unit


class FakeRecords:
    def __init__(self):
        self.progress = {}

    def stage_progress(self, stage):
        return {peer: dict(value) for peer, value in self.progress.items()}

    def publish_progress(self, stage, peer, value, ttl_s):
        self.progress[peer] = dict(value)
        return True


class FakeAverager:
    """Serves a donor's state to `download_state` and records the calls."""

    def __init__(self, donor_state=None):
        self.state_sharing_priority = 0.0
        self.calls, self.donor_state = [], donor_state

    def download_state(self, donor_deadline_s, max_donors):
        self.calls.append(("download",))
        return self.donor_state


class CutAverager(FakeAverager):
    """Every donor trickles and is cut at its deadline: each download takes all its donors' time."""

    def download_state(self, donor_deadline_s, max_donors):
        self.calls.append(("download", donor_deadline_s, max_donors))
        time.sleep(donor_deadline_s * max_donors)


class FakeSteps(Detached):
    """The step exchange as the synchronizer reaches it (stage_catch_up.StepsPort): `replay(peer, start,
    end)` answers replays; `answers()` the stage peers' pinged epochs (None: asking failed); `left_behind`:
    a trainer's close came far past this replica's epoch a moment ago, from a vouched sender (`vouched`)."""

    def __init__(self, replay=lambda peer, start, end: Replay.FAILED, answers=lambda: None):
        self._replay, self._answers = replay, answers
        self.left_behind, self.vouched, self.asked = False, True, 0
        self.means = {}  # step -> (samples, means) applied here

    def means_of(self, step):
        return self.means.get(step)

    def swarm_ahead(self):
        if not self.left_behind:
            return SwarmAhead()
        close = Heard(10**6, time.monotonic())
        return SwarmAhead(close.step, close, close if self.vouched else None)

    def peer_epochs(self):
        self.asked += 1
        return self._answers()

    def replay(self, peer, start, end):
        return self._replay(peer, start, end)


@pytest.fixture
def make_sync(tiny_cfg, start_compute):
    def make(peer="B", averager=None, lag_grace_s=3.0, steps=None):
        """`steps`: the synchronizer's port to the step exchange (None: detached)."""
        worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
        records, averager = FakeRecords(), averager or FakeAverager()
        settings = SyncSettings(lag_grace_s=lag_grace_s)
        sync = StageSynchronizer(
            worker, start_compute(), averager, records, peer, "d", settings, steps=steps or FakeSteps()
        )
        return sync, worker, records, averager

    return make


def _train(worker, count, step=0):
    for i in range(count):
        x = torch.randn(8, 64, 64)
        y = torch.randint(0, 256, (8, 64))
        request = StageRequest("forward_backward", f"m{step}-{i}", "none", x, labels=y, step=step)
        worker.forward(request)


def _apply(worker):
    bucket = worker.seal(worker.epoch)
    worker.apply_step(worker.epoch, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)


def _peer(epoch, fp=None, fp_epoch=None, fp_own=None):
    fp_epoch = epoch if fp_epoch is None else fp_epoch
    return {"epoch": epoch, "samples": 0, "digest": "d", "fp_epoch": fp_epoch, "fp": fp, "fp_own": fp_own}


class HandClock:
    """The times a test gives `check_other_stages`, which reads no clock but the one it is given: moved on
    by hand (`wait`), so a grace passes without waiting for it."""

    def __init__(self):
        self.now_s = time.monotonic()  # not 0: the synchronizer takes a zero start of its clock for none

    def __call__(self):
        return self.now_s

    def wait(self, seconds):
        self.now_s += seconds


def test_a_replica_far_behind_drops_its_work_and_downloads(make_sync, tiny_cfg):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    for step in range(6):
        _train(donor, 4, step)
        _apply(donor)
    sync, worker, records, averager = make_sync(averager=FakeAverager(donor_state=donor.export_state()))
    _train(worker, 2)
    records.progress["A"] = _peer(6)
    sync.tick()
    assert ("download",) in averager.calls
    assert worker.epoch == 6 and worker.unapplied_samples == 0 and sync.counters.lost_samples == 16
    assert all(torch.equal(a, b) for a, b in zip(worker.params, donor.params, strict=True))
    assert sync.serving.is_set()


def test_one_step_behind_is_normal_for_a_moment_but_not_for_long(make_sync, tiny_cfg):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    _train(donor, 4)
    _apply(donor)
    sync, worker, records, averager = make_sync(
        averager=FakeAverager(donor_state=donor.export_state()), lag_grace_s=0.2
    )
    records.progress["A"] = _peer(1)
    sync.tick()  # the peer finished the step's exchange a moment before us: no resync
    assert averager.calls == [] and worker.epoch == 0
    import time

    time.sleep(0.25)
    sync.tick()  # still behind after the grace period: we missed the step
    assert averager.calls == [("download",)] and worker.epoch == 1


def test_diverged_replica_with_larger_id_resyncs(make_sync):
    sync, worker, records, averager = make_sync(peer="B", steps=FakeSteps(answers=lambda: {"A": 0}))
    sync._fp = Fingerprint(0, [1.0, 2.0])
    records.progress["A"] = _peer(0, fp=[1.0, 2.5])
    sync.tick()
    assert ("download",) in averager.calls  # A < B: B follows A
    sync2, _, records2, averager2 = make_sync(peer="0", steps=FakeSteps(answers=lambda: {"A": 0}))
    sync2._fp = Fingerprint(0, [1.0, 2.0])
    records2.progress["A"] = _peer(0, fp=[1.0, 2.5])
    sync2.tick()
    assert ("download",) not in averager2.calls


@pytest.mark.parametrize("answers", [lambda: {"A": None}, lambda: None], ids=["silent", "asking failed"])
def test_a_diverged_replica_whose_peers_are_unreachable_keeps_serving(make_sync, answers):
    """Netbed chaos, seed 0: the only stage-0 replica the trainers reached resynced for diverged
    parameters while its peers were cut off, and refused every request for the download's 15 s."""
    steps = FakeSteps(answers=answers)
    sync, worker, records, averager = make_sync(peer="B", steps=steps)
    sync._fp = Fingerprint(0, [1.0, 2.0])
    records.progress["A"] = _peer(0, fp=[1.0, 2.5])
    sync.tick()
    assert steps.asked == 1 and averager.calls == []


def test_of_a_diverged_pair_the_one_that_trained_its_samples_keeps_its_line(make_sync):
    """Netbed chaos, seed 2: settled by id, the replica that had computed every gradient of 50 steps
    resynced from a follower of those exchanges, and the loss after the whole-swarm restart was 5% worse.
    The samples of its own each trained in the recent steps, published with the fingerprint, decide."""
    # the fingerprints of three steps at the replicas' epoch 0 (what matters: the samples each trained)
    trained, _, records, averager = make_sync(peer="B", steps=FakeSteps(answers=lambda: {"A": 0}))
    for _ in range(3):
        trained.step_applied(0, [1.0, 2.0], own_samples=8)  # the larger id, but its own samples
    records.progress["A"] = _peer(0, fp=[1.0, 2.5], fp_own=0)
    trained.tick()
    assert averager.calls == []  # it keeps its line
    follower, _, records2, averager2 = make_sync(peer="A", steps=FakeSteps(answers=lambda: {"B": 0}))
    for _ in range(3):
        follower.step_applied(0, [1.0, 2.5], own_samples=0)
    records2.progress["B"] = _peer(0, fp=[1.0, 2.0], fp_own=24)
    follower.tick()
    assert ("download",) in averager2.calls  # the smaller id follows the one that trained
    assert trained._fp.own_samples == 24 and follower._fp.own_samples == 0


def test_fingerprints_of_different_steps_are_not_compared(make_sync):
    sync, _, records, averager = make_sync(peer="B")
    sync._fp = Fingerprint(3, [1.0, 2.0])
    records.progress["A"] = _peer(4, fp=[1.0, 2.5], fp_epoch=4)  # one step further: not comparable
    sync.tick()
    assert averager.calls == []


def test_a_divergence_shows_in_the_parameter_fingerprint_steps_later(tiny_cfg):
    """Two replicas that applied one step from different contributions, then the same later steps:
    a gradient fingerprint of the last step would agree; the parameter fingerprint does not."""
    a, b = (StageWorker(tiny_cfg, tiny_cfg.stages()[1]) for _ in range(2))
    assert a.param_fingerprint() == b.param_fingerprint()
    _train(a, 2)
    _train(b, 1)
    _apply(a)
    _apply(b)  # step 0: a applied 16 samples, b only 8 of them
    for step in (1, 2):
        for worker in (a, b):
            torch.manual_seed(step)
            _train(worker, 1, step)
        grads = a.seal(step).grad_sums
        b.seal(step)
        for worker in (a, b):  # the same averaged gradient on both, as after a full exchange
            worker.apply_step(step, [g / 8 for g in grads], 8)
    fa, fb = a.param_fingerprint(), b.param_fingerprint()
    assert any(abs(x - y) > 1e-6 * (abs(x) + abs(y)) for x, y in zip(fa, fb, strict=True)), (fa, fb)


# start-up: live replicas, checkpoint or refusal; a stage left behind the others ------------------------
class StagedRecords(FakeRecords):
    """Progress per stage (the tests above need only one)."""

    def __init__(self):
        super().__init__()
        self.by_stage = {}

    def stage_progress(self, stage):
        source = self.progress if stage == 1 else self.by_stage.get(stage, {})
        return {peer: dict(value) for peer, value in source.items()}


@pytest.fixture
def make_joiner(tiny_cfg, start_compute, tmp_path):
    from swarmtrain.runtime.server.stage_checkpoint import CheckpointSettings, StageCheckpointer

    made = []

    def make(
        checkpoint_from=None,
        averager=None,
        allow_fresh=False,
        lag_grace_s=3.0,
        wait_s=0.0,
        stranded_s=30.0,
        steps=None,
        rule=None,
    ):
        worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
        identity = {"run_id": "r", "digest": tiny_cfg.digest()}
        directory = tmp_path / f"checkpoints{len(made)}"  # each replica its own
        made.append(directory)
        checkpointer = StageCheckpointer(CheckpointSettings(directory), 1, identity, worker.export_state)
        if checkpoint_from is not None:
            donor_checkpointer = StageCheckpointer(
                CheckpointSettings(directory), 1, identity, checkpoint_from.export_state
            )
            donor_checkpointer.save(checkpoint_from.epoch).result(timeout=30)
        fatal = []
        settings = SyncSettings(
            num_stages=2,
            allow_fresh=allow_fresh,
            lag_grace_s=lag_grace_s,
            missing_replica_wait_s=wait_s,
            stranded_grace_s=stranded_s,
            download_rule=rule or SyncSettings().download_rule,
        )
        records, averager = StagedRecords(), averager or FakeAverager()
        sync = StageSynchronizer(
            worker,
            start_compute(),
            averager,
            records,
            "B",
            "d",
            settings,
            checkpoints=checkpointer,
            on_fatal=fatal.append,
            steps=steps or FakeSteps(),
        )
        return sync, worker, records, fatal

    return make


def _donor(tiny_cfg, steps):
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    for step in range(steps):
        _train(donor, 2, step)
        _apply(donor)
    return donor


def test_join_restores_the_checkpoint_at_the_swarm_step(make_joiner, tiny_cfg):
    donor = _donor(tiny_cfg, 5)
    sync, worker, records, _ = make_joiner(checkpoint_from=donor)
    records.by_stage[0] = {"X": _peer(7)}  # stage 0 lives at step 7
    sync.join()
    assert worker.epoch == 7 and worker.samples_seen == donor.samples_seen and not sync.untrained
    assert sync.skipped == 2  # the checkpoint's step 5 to the swarm's 7: this stage's updates of 2 lost
    assert all(torch.equal(a, b) for a, b in zip(worker.params, donor.params, strict=True))
    sync.stop()


def test_join_refuses_initial_weights_in_a_swarm_that_stepped(make_joiner):
    from swarmtrain.runtime.server.stage_sync import RestoreRefused

    sync, worker, records, _ = make_joiner()
    records.by_stage[0] = {"X": _peer(7)}
    with pytest.raises(RestoreRefused, match="no live replica and no checkpoint"):
        sync.join()
    sync.stop()
    fresh, worker, records, _ = make_joiner(allow_fresh=True)
    records.by_stage[0] = {"X": _peer(7)}
    fresh.join()
    assert worker.epoch == 7 and fresh.serving.is_set()
    fresh.stop()


def test_a_joiner_that_sees_only_another_joiner_waits_for_the_stage_replicas_record(
    make_joiner, tiny_cfg, monkeypatch
):
    """Found live: two servers moved into a stage together while its one replica, busy sending its
    state at a CPU quota, missed its heartbeats. The second saw only the first (joining, step 0) and
    started from initial weights as if the run were new. A joiner's record says nothing about the
    stage's state: the second now reads again until the replica's record is back, and downloads."""
    import threading

    from swarmtrain.runtime.server import stage_sync

    monkeypatch.setattr(stage_sync, "JOIN_RETRY_S", 0.1)  # reads again every 0.1 s, not every second
    donor = _donor(tiny_cfg, 3)
    averager = FakeAverager(donor_state=donor.export_state())
    sync, worker, records, _ = make_joiner(averager=averager, wait_s=10.0)
    records.by_stage[0] = {"X": _peer(3)}  # the other stage has stepped
    records.progress["J"] = dict(_peer(0), serving=False)  # the first mover, still downloading
    # several reads after the first one (without the wait, the join refuses: no live replica, no checkpoint)
    threading.Timer(0.5, lambda: records.progress.update(Z=dict(_peer(3), serving=True))).start()
    sync.join()
    assert ("download",) in averager.calls and worker.epoch == 3 and not sync.untrained
    assert all(torch.equal(a, b) for a, b in zip(worker.params, donor.params, strict=True))
    sync.stop()


def test_join_falls_back_to_the_checkpoint_when_the_replicas_died(make_joiner, tiny_cfg, monkeypatch):
    from swarmtrain.runtime.server import stage_sync

    # the record stays, so the join tries the download again (JOIN_RETRIES), 0.1 s apart, not a second
    monkeypatch.setattr(stage_sync, "JOIN_RETRY_S", 0.1)
    donor = _donor(tiny_cfg, 3)
    sync, worker, records, _ = make_joiner(checkpoint_from=donor, averager=FakeAverager(donor_state=None))
    records.progress["A"] = _peer(4)  # a record of a replica that is gone: its download fails
    sync.join()
    assert len(sync.averager.calls) == 1 + stage_sync.JOIN_RETRIES  # tried again while the record stayed
    assert worker.epoch == 3 and not sync.untrained
    sync.stop()


def test_a_joiner_whose_donors_never_complete_resumes_from_its_checkpoint_at_the_deadline(
    make_joiner, tiny_cfg, caplog
):
    """The donors are there but none delivers within its deadline: the joiner serves from its own
    checkpoint once the whole download's deadline has passed, and says so in one WARNING line."""
    from swarmtrain.planner.download_deadline import DownloadRule, describe, donor_deadline_s, state_bytes

    caplog.set_level(logging.INFO, logger="swarmtrain")
    rule = DownloadRule(base_s=0.3, min_rate_bytes_per_s=1e9, max_donors=2)  # the server's own (flags)
    donor = _donor(tiny_cfg, 3)
    sync, worker, records, _ = make_joiner(checkpoint_from=donor, averager=CutAverager(), rule=rule)
    records.progress["A"] = _peer(4)  # a live donor that trickles
    donor_s = donor_deadline_s(state_bytes(sum(p.numel() for p in worker.params)), rule)
    start_s = time.monotonic()
    sync.join()
    took_s = time.monotonic() - start_s
    # the whole download's deadline; no retry fits after it (a retry would cost at least a donor's)
    assert rule.max_donors * donor_s <= took_s < rule.max_donors * donor_s + donor_s, took_s
    assert sync.averager.calls == [("download", donor_s, rule.max_donors)]
    assert worker.epoch == 3 and sync.serving.is_set() and not sync.untrained
    warnings = [r.getMessage() for r in caplog.records if "no donor completed" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoint at step 3" in warnings[0], warnings
    # the rule it waited by, printed before the download (the start line of a server)
    printed = [r.getMessage() for r in caplog.records if "state downloads" in r.getMessage()]
    state = state_bytes(sum(p.numel() for p in worker.params))
    assert printed == [f"stage 1 state downloads: {describe(state, rule)}"], printed
    sync.stop()


def test_a_restored_stage_behind_the_others_adopts_their_step_an_untrained_one_refuses(make_joiner, tiny_cfg):
    import time

    sync, worker, records, fatal = make_joiner(checkpoint_from=_donor(tiny_cfg, 2), lag_grace_s=0.1)
    sync.join()
    records.by_stage[0] = {"X": _peer(9)}
    sync.tick()
    assert worker.epoch == 2  # a moment behind is normal
    time.sleep(0.15)
    sync.tick()
    assert worker.epoch == 9 and fatal == [] and sync.serving.is_set()
    sync.stop()

    untrained, worker, records, fatal = make_joiner(lag_grace_s=0.1)
    untrained.join()  # a new run: nobody has stepped
    records.by_stage[0] = {"X": _peer(9)}  # then the other stage shows up trained
    untrained.tick()
    time.sleep(0.15)
    untrained.tick()
    assert worker.epoch == 0 and not untrained.serving.is_set()
    assert len(fatal) == 1 and "untrained initial weights" in fatal[0]
    untrained.stop()


class StepDuringRead(StagedRecords):
    """Stage 0's records, read while the step loop applies this replica's step 0 (from another thread in a
    server; here inside the read): its epoch moves and its bucket empties before `step_applied` reaches the
    synchronizer, which still holds the epoch the tick began with."""

    def __init__(self, worker):
        super().__init__()
        self.worker, self.armed = worker, False

    def stage_progress(self, stage):
        if stage == 0 and self.armed and self.worker.epoch == 0:
            _apply(self.worker)
        return super().stage_progress(stage)


def test_an_untrained_replica_whose_step_applies_during_the_check_is_not_refused(make_joiner):
    """CI, tests/integration/test_nat.py: stage 1's close came late through the NAT; stage 0 had stepped.
    The tick read stage 1 at step 0 holding 128 samples, the close arrived, the step applied during the
    other stages' DHT read, and the rule saw a replica at step 0 with no samples, untrained and not
    finishing: it refused to serve and stopped a healthy server. The epoch moved: nothing is decided."""
    sync, worker, _, fatal = make_joiner(lag_grace_s=0.1)
    sync.join()
    records = sync.records = StepDuringRead(worker)
    _train(worker, 2)
    records.by_stage[0] = {"X": _peer(1)}
    clock = HandClock()
    sync.check_other_stages(0, clock.now_s)  # the clock starts
    clock.wait(0.2)
    records.armed = True
    sync.check_other_stages(0, clock.now_s)
    assert worker.epoch == 1 and fatal == [] and sync.serving.is_set()
    sync.stop()


def test_an_adoption_the_step_loop_overtook_is_dropped_not_applied(make_joiner):
    """The rule decided "advance" at epoch 0; the step loop applied step 0 before the adoption's compute
    job ran: the replica, now at 1 with samples of step 1, is not moved on to the target (those samples
    would be lost for a decision made on a state that no longer holds)."""
    sync, worker, records, _ = make_joiner(allow_fresh=True)
    sync.join()
    _train(worker, 1, 0)
    _apply(worker)
    _train(worker, 1, 1)
    sync._advance(0, 5, 10.0, "a test")
    assert worker.epoch == 1 and worker.unapplied_samples == 8
    sync.stop()


def test_a_replica_whose_stage_peer_died_with_a_step_adopts_the_other_stages_step(make_joiner, tiny_cfg):
    """The chaos test in CI: the only stage-0 replica that applied step 711 was killed; the ones left had
    downloaded their state at 711, held no samples, and waited while stage 1 was at 712: every
    micro-batch timed out at stage 0 until the run ended. Now they adopt step 712 after a request timeout
    (here 1 s), and not while they are still stepping."""
    import time

    donor = _donor(tiny_cfg, 3)
    sync, worker, records, fatal = make_joiner(
        averager=FakeAverager(donor_state=donor.export_state()), lag_grace_s=0.1, stranded_s=1.0
    )
    records.by_stage[0] = {"X": _peer(3)}
    records.progress["A"] = _peer(3)  # a live replica of this stage to download from
    sync.join()
    assert worker.epoch == 3 and not sync.restored and not sync.untrained
    del records.progress["A"]  # that replica applied step 3 and died
    records.by_stage[0] = {"X": _peer(4)}
    sync.step_applied(3, None)  # as if it had just stepped: the other stages are not read yet
    sync.tick()
    time.sleep(0.15)
    sync.tick()
    assert sync._other_ahead_since_s is not None and worker.epoch == 3  # behind, within the grace
    time.sleep(0.2)
    sync.tick()
    assert worker.epoch == 3  # a moment behind: a micro-batch of step 3 could still come
    time.sleep(1.0)
    sync.tick()
    assert worker.epoch == 4 and fatal == [] and sync.serving.is_set()
    sync.stop()


def test_a_replica_left_behind_whose_peers_ahead_are_silent_adopts_the_swarms_step_after_a_lag_grace(
    make_joiner, tiny_cfg
):
    """Netbed chaos, seed 0: a stage-1 replica woke 30 steps behind and the only replica ahead froze for
    26.6 s; the frozen one's progress record still showed it ahead, so the sync thread tried to replay
    from it and the stage stalled 33 s. Left behind (a trainer's close came far past its epoch) and with
    a peer that does not answer a ping and none that answers ahead of it, it adopts the other stages'
    step after the lag grace, not the request timeout, and tries no replay or download from the record
    of the silent peer. With every peer answering (a forged close), the wait stays a request timeout."""
    import time

    donor = _donor(tiny_cfg, 3)
    answers: dict = {"A": 3}  # left behind, and the peer answers at our step: a forged close?
    steps = FakeSteps(answers=lambda: answers)
    sync, worker, records, fatal = make_joiner(
        averager=FakeAverager(donor_state=donor.export_state()),
        lag_grace_s=0.1,
        stranded_s=60.0,
        steps=steps,
    )
    records.by_stage[0] = {"X": _peer(3)}
    records.progress["A"] = _peer(3)
    sync.join()
    steps.left_behind = True
    records.progress["A"] = _peer(33)  # the frozen replica's record, still there
    records.by_stage[0] = {"X": _peer(34)}
    answers["C"] = 3
    sync.tick()
    time.sleep(0.2)
    sync.tick()
    assert worker.epoch == 3  # every peer answers: a request timeout's grace, as without the close
    downloads = len(sync.averager.calls)  # (A's record sent those two ticks to download, as before)
    answers.update(A=None)  # A, the replica that ran the steps, froze
    sync._other_ahead_since_s = None
    sync.tick()
    assert worker.epoch == 3 and sync._other_ahead_since_s is not None  # within the grace
    time.sleep(0.2)
    sync.tick()
    assert worker.epoch == 34 and sync.skipped and fatal == [] and sync.serving.is_set()
    assert len(sync.averager.calls) == downloads  # nothing asked of the silent peer
    answers.clear()  # a view with no peer left (their records lapsed): adopted as soon
    records.by_stage[0] = {"X": _peer(40)}
    sync._other_ahead_since_s = None
    sync.tick()
    time.sleep(0.2)
    sync.tick()
    assert worker.epoch == 40
    sync.stop()


def test_a_strangers_close_far_ahead_makes_a_replica_ask_but_never_by_itself_leave_its_step(
    make_joiner, tiny_cfg
):
    """A close far past the replica's epoch from a sender it never found true (a forger's in an open
    run), its only peer silent: it asks, and adopts the other stages' step only after the request
    timeout, as without the close (a vouched close would have let it adopt after the lag grace)."""
    answers: dict = {"A": None}
    steps = FakeSteps(answers=lambda: answers)
    sync, worker, records, fatal = make_joiner(lag_grace_s=0.1, stranded_s=60.0, steps=steps)
    donor = _donor(tiny_cfg, 3)
    sync.averager.donor_state = donor.export_state()
    records.by_stage[0] = {"X": _peer(3)}
    records.progress["A"] = _peer(3)
    sync.join()
    del records.progress["A"]
    records.by_stage[0] = {"X": _peer(34)}
    steps.left_behind, steps.vouched = True, False
    sync.step_applied(3, None)  # stepping with the swarm: the other stages are read after a lag grace
    for _ in range(3):
        sync.tick()
        time.sleep(0.15)
    assert steps.asked == 3 and worker.epoch == 3  # asked every tick, stayed at its step
    steps.vouched = True
    sync.tick()
    time.sleep(0.15)
    sync.tick()
    assert worker.epoch == 34 and fatal == []
    sync.stop()


def test_a_truncated_download_is_refused_and_the_replica_serves_on(make_sync, tiny_cfg):
    """The chaos bench: a donor died mid-stream, the state had too few tensors; the tick raised and the
    replica never served again."""
    donor = _donor(tiny_cfg, 2)
    meta, tensors = donor.export_state()
    sync, worker, records, averager = make_sync(averager=FakeAverager(donor_state=(meta, tensors[:3])))
    records.progress["A"] = _peer(9)
    sync.tick()
    assert ("download",) in averager.calls and worker.epoch == 0 and sync.serving.is_set()


def test_a_replica_a_step_behind_replays_it_instead_of_downloading(tiny_cfg, start_compute):
    """No samples of its own and at most KEPT_STEP_MEANS behind: the missed steps come from a peer's
    mean gradients (`StepsPort.replay`); holding samples, or when the replay fails, it downloads."""
    replays = []

    def replay(peer, start, end):
        replays.append((peer, start, end))
        return Replay.DONE if ok else Replay.FAILED

    worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    records, averager = FakeRecords(), FakeAverager()
    settings = SyncSettings(lag_grace_s=0.0)
    sync = StageSynchronizer(
        worker, start_compute(), averager, records, "B", "d", settings, steps=FakeSteps(replay)
    )
    records.progress["A"], records.progress["C"] = _peer(2), _peer(1)
    ok = True
    sync.tick()
    assert replays == [("A", 0, 2)] and averager.calls == []  # from the most advanced peer
    ok = False
    sync.tick()
    assert replays[-1] == ("A", 0, 2) and averager.calls == [("download",)]
    _train(worker, 1)
    ok = True
    sync.tick()
    assert len(replays) == 2 and averager.calls == [("download",)] * 2  # its own samples: a resync


def test_a_donor_silent_during_a_replay_is_asked_first_and_given_up_only_if_it_answers(
    tiny_cfg, start_compute
):
    """A donor that goes silent during a replay is given up with no download (netbed chaos: a frozen
    donor). The next tick asks the peers first: while the donor stays silent it is no donor, whatever its
    record says; one that answers such an ask and then goes silent during the replay again (its pings
    queue behind its reply on a slow link) is no donor either, and the state is downloaded. A replay that
    ends otherwise starts the count afresh; a replay cut by the service's stop downloads nothing."""
    outcomes: list[Replay] = []
    answers: dict[str, int | None] = {}

    def replay(peer, start, end):
        return outcomes.pop(0)

    worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    records, averager = FakeRecords(), FakeAverager()
    steps = FakeSteps(replay, lambda: dict(answers))
    sync = StageSynchronizer(
        worker, start_compute(), averager, records, "B", "d", SyncSettings(lag_grace_s=0.0), steps=steps
    )
    records.progress["A"] = _peer(2)

    def tick(*replays: Replay) -> None:
        outcomes[:] = replays
        sync.tick()
        assert outcomes == []

    tick(Replay.DONOR_SILENT)
    assert averager.calls == [] and steps.asked == 0
    answers["A"] = None
    tick()  # asked first: A is silent, and nothing is tried with it whatever its record says
    assert averager.calls == [] and steps.asked == 1
    answers["A"] = 2
    tick(Replay.DONOR_SILENT)  # not asked this tick: silent once more, not counted
    assert averager.calls == [] and steps.asked == 1
    tick(Replay.DONOR_SILENT)  # asked first, A answers, then goes silent during the replay again
    assert averager.calls == [("download",)] and steps.asked == 2
    tick(Replay.DONOR_SILENT)
    tick(Replay.FAILED)  # it answered the ask, the replay failed otherwise: a download
    tick(Replay.DONOR_SILENT)  # counted afresh
    assert averager.calls == [("download",)] * 2
    tick(Replay.STOPPED)
    assert averager.calls == [("download",)] * 2


def test_a_closing_service_starts_no_replay_or_download(tiny_cfg, start_compute):
    """Once the synchronizer is told to stop, its last tick starts nothing: a download during the
    service's close raced its final checkpoint."""
    replays = []
    worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    records, averager = FakeRecords(), FakeAverager()
    steps = FakeSteps(lambda peer, start, end: replays.append(peer) or Replay.FAILED)
    sync = StageSynchronizer(
        worker, start_compute(), averager, records, "B", "d", SyncSettings(lag_grace_s=0.0), steps=steps
    )
    records.progress["A"] = _peer(2)
    sync.stop_event.set()
    sync.tick()
    assert replays == [] and averager.calls == []
    sync.stop_event.clear()
    sync.tick()
    assert replays == ["A"] and averager.calls == [("download",)]


def test_a_replica_far_behind_replays_at_once_while_its_peer_keeps_the_steps(tiny_cfg, start_compute):
    """A moved server whose download took several steps is more than KEEP_STEPS_AHEAD behind: it
    replays the missed steps at once (it used to download the whole state again, and fall behind again),
    and downloads only when the replay fails or the gap is beyond MAX_REPLAY_STEPS."""
    from swarmtrain.runtime.server.stage_steps import MAX_REPLAY_STEPS
    from swarmtrain.runtime.server.step_inbox import KEEP_STEPS_AHEAD

    replays, ok = [], True

    def replay(peer, start, end):
        replays.append((peer, start, end))
        return Replay.DONE if ok else Replay.FAILED

    worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    records, averager = FakeRecords(), FakeAverager()
    settings = SyncSettings(lag_grace_s=60.0)  # not lagging long enough to count: the gap alone decides
    sync = StageSynchronizer(
        worker, start_compute(), averager, records, "B", "d", settings, steps=FakeSteps(replay)
    )
    records.progress["A"] = _peer(KEEP_STEPS_AHEAD + 3)
    sync.tick()
    assert replays == [("A", 0, KEEP_STEPS_AHEAD + 3)] and averager.calls == []
    ok = False
    sync.tick()
    assert len(replays) == 2 and averager.calls == [("download",)]
    records.progress["A"] = _peer(MAX_REPLAY_STEPS + 1)
    ok = True
    sync.tick()
    assert len(replays) == 2 and averager.calls == [("download",)] * 2  # too far: not even tried


def test_a_replica_a_close_shows_far_behind_asks_its_peers_directly_when_the_dht_shows_nobody(make_sync):
    """Netbed chaos, seed 0: a stage-1 replica woke 23 steps behind while the progress records of its
    peer had lapsed (the DHT's stores timed out), and that peer froze before the records showed it. A
    close far past its epoch makes it ask its peers' epochs with a ping (`peer_epochs`) and replay from
    the furthest at once; a failed replay downloads; without such a close nothing is asked."""
    from swarmtrain.runtime.server.step_inbox import KEEP_STEPS_AHEAD

    replays, ok = [], True
    answers: dict[str, int] | None = None

    def replay(peer, start, end):
        replays.append((peer, start, end))
        return Replay.DONE if ok else Replay.FAILED

    steps = FakeSteps(replay, lambda: None if answers is None else dict(answers))
    sync, worker, records, averager = make_sync(lag_grace_s=60.0, steps=steps)
    sync.tick()  # no close showed it behind: nothing is asked, nothing happens
    assert replays == [] and averager.calls == [] and steps.asked == 0
    steps.left_behind = True
    sync.tick()  # asking failed: the records decide, and they show nobody ahead
    assert replays == [] and averager.calls == [] and steps.asked == 1
    answers = {"A": KEEP_STEPS_AHEAD + 5, "C": KEEP_STEPS_AHEAD + 2, "D": None}  # D: silent
    sync.tick()
    assert replays == [("A", 0, KEEP_STEPS_AHEAD + 5)] and averager.calls == []  # the furthest peer
    ok = False
    sync.tick()
    assert len(replays) == 2 and averager.calls == [("download",)]
    answers = {"A": KEEP_STEPS_AHEAD, "C": 1}  # within the window: the lag rules of the DHT path decide
    sync.tick()
    assert len(replays) == 2 and averager.calls == [("download",)]


def test_a_replica_that_skipped_steps_follows_its_peer_whatever_the_ids(make_sync, tiny_cfg):
    """chaos --netbed, seed 0: s1-10 woke from a freeze 36 steps behind while its only peer was frozen,
    adopted the other stages' step with its old parameters (behind_other_stages), and had the smaller id:
    by id alone its peer, which had applied those 36 steps, threw them away when it woke."""
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
    sync, worker, records, averager = make_sync(
        peer="0",
        averager=FakeAverager(donor_state=donor.export_state()),
        steps=FakeSteps(answers=lambda: {"A": 0}),
    )  # the smaller id
    sync._skips.append((0, 1))  # it adopted step 0 over one step
    sync._fp = Fingerprint(0, [1.0, 2.0])
    records.progress["A"] = _peer(0, fp=[1.0, 2.5])
    sync.tick()
    assert ("download",) in averager.calls and not sync.skipped  # it took the peer's state
    peer_sync, _, peer_records, peer_averager = make_sync(peer="B")  # the peer: larger id, did not skip
    peer_sync._fp = Fingerprint(0, [1.0, 2.5])
    peer_records.progress["A"] = dict(_peer(0, fp=[1.0, 2.0]), skipped=True)
    peer_sync.tick()
    assert peer_averager.calls == []
    assert peer_records.progress.get("B") is None or peer_records.progress["B"].get("skipped") is not True


def test_a_replica_whose_skip_is_long_past_keeps_its_line_against_one_restored_from_an_older_checkpoint(
    make_sync,
):
    """Netbed chaos, seed 0 (docs/LOG.md, twenty-third session): s0-7 had adopted step 387 over one step
    and applied every step since; s0-12 was restored from the checkpoint of step 400 at step 414 (14
    updates lost) and replayed 414-419. At 420 their parameters differed, and s0-7, flagged `skipped` for
    good, took s0-12's state: the stage lost those 14 updates. Counted within the recent steps, s0-7
    skipped none and s0-12 14: s0-12 follows."""
    sync, worker, records, averager = make_sync(peer="0", steps=FakeSteps(answers=lambda: {"A": 420}))
    worker.advance_to(420)
    sync._skips.append((387, 1))
    sync._fp = Fingerprint(420, [1.0, 2.0])
    records.progress["A"] = dict(_peer(420, fp=[1.0, 2.5]), skipped=True, skipped_steps=14)
    assert sync.skipped == 0 and sync.diverged_from(records.progress) == frozenset()
    sync.tick()
    assert averager.calls == []  # it keeps its line
    # the one restored from the checkpoint sees the same pair the other way round: it follows
    assert _follows_diverged(Fingerprint(420, [1.0, 2.5]), "A", 14, "0", dict(_peer(420, fp=[1.0, 2.0])))
    # a peer of an earlier version publishes only the flag: one skipped update
    older = dict(_peer(420, fp=[1.0, 2.5]), skipped=True)
    assert _follows_diverged(Fingerprint(420, [1.0, 2.0]), "0", 2, "A", older)
    assert not _follows_diverged(Fingerprint(420, [1.0, 2.0]), "0", 0, "A", older)


def test_a_replica_gives_up_its_steps_close_only_when_the_catch_up_abandons_it(make_joiner, tiny_cfg):
    """Netbed chaos, seed 0: a replica a step behind waited 32 s on closes naming only its frozen peer,
    because a step with a close is never left for the other stages' step. When the catch-up found the
    peers that ran it silent behind a vouched close (`abandon_close`), the close no longer holds it."""

    class Closing(FakeSteps):
        def closing(self):
            return True

    clock = HandClock()
    sync, worker, records, fatal = make_joiner(lag_grace_s=0.1, stranded_s=60.0, steps=Closing())
    donor = _donor(tiny_cfg, 3)
    sync.averager.donor_state = donor.export_state()
    records.by_stage[0] = {"X": _peer(3)}
    records.progress["A"] = _peer(3)
    sync.join()
    records.by_stage[0] = {"X": _peer(5)}
    for _ in range(2):
        sync.check_other_stages(3, clock(), 0.1)
        clock.wait(0.15)
    assert worker.epoch == 3  # its step has a close: held
    sync.check_other_stages(3, clock(), 0.1, abandon_close=True)
    assert worker.epoch == 3  # giving the close up has a clock of its own: the whole grace
    clock.wait(0.15)
    sync.check_other_stages(3, clock(), 0.1, abandon_close=True)
    assert worker.epoch == 5 and sync.skipped and fatal == []
    # netbed chaos, seed 0 (this session): the other stages were at the replica's own step, which only
    # its frozen peer had run: a vouched close of it lets the replica take the step after, not wait 27 s
    for _ in range(2):
        sync.check_other_stages(5, clock(), 0.1, abandon_close=True)
        clock.wait(0.15)
    assert worker.epoch == 6
    sync.check_other_stages(6, clock(), 0.1)
    clock.wait(0.15)
    sync.check_other_stages(6, clock(), 0.1)
    assert worker.epoch == 6  # without a close to abandon, nothing ahead of it: it stays
    # the step loop applied the step while the sync thread decided: no adoption, not marked skipped
    sync._skips.clear()
    worker.advance_to(7)
    for _ in range(2):
        sync.check_other_stages(6, clock(), 0.1, abandon_close=True)
        clock.wait(0.15)
    assert worker.epoch == 7 and not sync.skipped
    # netbed chaos, seed 0: the trainers had closed steps past it while the other stages' records were
    # stale; giving the close up takes it past the highest of them at once, not a step at a time
    for _ in range(2):
        sync.check_other_stages(7, clock(), 0.1, abandon_close=True, at_least=10)
        clock.wait(0.15)
    assert worker.epoch == 10 and sync.skipped
    # the step loop applied the step while the adoption's clock ran: a new epoch starts a new clock
    sync.check_other_stages(10, clock(), 0.1, abandon_close=True)
    clock.wait(0.15)
    worker.advance_to(11)
    sync.check_other_stages(11, clock(), 0.1, abandon_close=True)
    assert worker.epoch == 11
    clock.wait(0.15)
    sync.check_other_stages(11, clock(), 0.1, abandon_close=True)
    assert worker.epoch == 12
    sync.stop()


def test_a_replica_that_gives_its_steps_close_up_loses_the_samples_it_holds_of_it(make_sync, tmp_path):
    """Netbed chaos, seed 0: a stage-0 replica held 8 samples of its step, whose vouched close named
    only its cut-off peer; the catch-up gave the close up each tick for 21 s, and each time the held
    samples kept it at the step (with the trainers' requests of the next one). Now it adopts the next
    step, and the samples are lost, counted and written to the ledger."""

    class Closing(FakeSteps):
        def closing(self):
            return True

    clock = HandClock()
    sync, worker, records, _ = make_sync(lag_grace_s=0.1, steps=Closing())
    sync.ledger = Ledger(tmp_path / "ledger.jsonl")
    sync.untrained = sync.restored = False  # it has stepped with the swarm: the stranded grace applies
    _train(worker, 1, step=0)
    assert worker.unapplied_samples == 8
    for _ in range(2):
        sync.check_other_stages(0, clock(), 0.1)
        clock.wait(0.15)
    assert worker.epoch == 0  # no close given up: its samples and the close hold it
    for _ in range(2):
        sync.check_other_stages(0, clock(), 0.1, abandon_close=True)
        clock.wait(0.15)
    assert worker.epoch == 1 and worker.unapplied_samples == 0 and sync.skipped
    sync.ledger.close()
    lost = [entry for entry in read_ledger(tmp_path / "ledger.jsonl") if entry["e"] == "lost"]
    assert [(e["mbs"], e["n"], e["reason"]) for e in lost] == [(["m0-0"], 8, "advance")]


def test_a_stuck_replica_whose_ping_round_fails_ends_its_tick(make_sync):
    """Asking the peers can fail (the round outlived its timeout behind a silent peer); the tick then
    goes on as if nothing were stuck. It used to decide to ask again at once, for ever: the sync thread
    never left the tick (no adoption, no divergence check, no stop)."""
    import threading

    from swarmtrain.planner.catch_up import Stuck

    class StuckSteps(FakeSteps):
        def stuck(self):
            now = time.monotonic()
            return Stuck(now - 10.0, now - 10.0, frozenset({"A"}))

    steps = StuckSteps(answers=lambda: None)
    sync, worker, records, averager = make_sync(lag_grace_s=3.0, steps=steps)
    ticking = threading.Thread(target=sync.tick, daemon=True)
    ticking.start()
    ticking.join(timeout=10.0)
    assert not ticking.is_alive() and steps.asked == 1
    steps._answers = lambda: {"A": None}  # asked, the holder silent: adopt, giving the close up
    sync.tick()
    assert steps.asked == 2 and sync._adoption is not None and sync._adoption[0]


class SteppingAverager(FakeAverager):
    """The replica's step loop closes its step and takes samples of the next while the state downloads;
    `steps` keeps the mean it applied."""

    def __init__(self, donor_state, worker, steps):
        super().__init__(donor_state)
        self.worker, self.steps = worker, steps

    def download_state(self, donor_deadline_s, max_donors):
        step = self.worker.epoch
        _train(self.worker, 2, step)
        bucket = self.worker.seal(step)
        means = [g / bucket.samples for g in bucket.grad_sums]
        self.steps.means[step] = (bucket.samples, [m.clone() for m in means])
        self.worker.apply_step(step, means, bucket.samples)
        _train(self.worker, 1, step + 1)
        return super().download_state(donor_deadline_s, max_donors)


def test_a_resync_whose_replica_stepped_during_the_download_keeps_its_step_and_samples(make_sync, tiny_cfg):
    steps = FakeSteps()
    sync, worker, _, _ = make_sync(steps=steps)
    donor = StageWorker(tiny_cfg, tiny_cfg.stages()[1])  # the same initial state, at step 0
    sync.averager = SteppingAverager(donor.export_state(), worker, steps)
    sync.resync("parameters diverged from a peer after a partial exchange")
    assert worker.epoch == 1 and worker.unapplied_samples == 8 and sync.counters.lost_samples == 0
    assert sync.counters.resyncs == 1 and sync.serving.is_set()


def test_a_replica_holding_a_step_nobody_closes_applies_it_a_close_timeout_after_the_other_stages_went_on(
    make_joiner,
):
    """tests/integration/test_nat.py beside another swarm: the trainer gave up its close of step 0 to the
    stage-1 server behind the NAT, which held every sample of the step, never advanced (it holds samples)
    and never closed (no close came): stuck at step 0 for good. Now, once the other stages have been past
    the step and its samples unchanged for a close timeout, it has the step loop apply them, with the
    stage peers whose records show samples of the same step (planner/held_step.py)."""

    class Steps(FakeSteps):
        def __init__(self):
            super().__init__()
            self.applied, self.close = [], False

        def has_close(self):
            return self.close

        def apply_held(self, step, members):
            self.applied.append((step, dict(members)))
            return True

    clock, steps = HandClock(), Steps()
    sync, worker, records, fatal = make_joiner(lag_grace_s=0.1, steps=steps)
    sync.untrained = sync.restored = False  # it has stepped with the swarm
    timeout_s = sync.settings.close_timeout_s
    records.progress["A"] = {**_peer(0), "samples": 16}  # a stage peer holding samples of step 0 too
    records.progress["C"] = _peer(0)  # one holding none
    records.by_stage[0] = {"X": _peer(1)}  # the other stage went on
    _train(worker, 1, step=0)
    sync.check_other_stages(0, clock())
    clock.wait(timeout_s - 1.0)
    _train(worker, 2, step=0)  # another micro-batch still came (m0-1): the step was under way here
    assert worker.unapplied_samples == 16
    sync.check_other_stages(0, clock())
    clock.wait(2.0)
    sync.check_other_stages(0, clock())
    assert steps.applied == []  # behind for a close timeout, but its samples changed a second ago
    steps.close = True
    clock.wait(timeout_s)
    sync.check_other_stages(0, clock())
    assert steps.applied == []  # a close came: the step loop decides on it
    steps.close = False
    sync.check_other_stages(0, clock())
    assert steps.applied == [(0, {"A": 16, "B": 16})]
    assert worker.epoch == 0 and not sync.skipped and fatal == []  # the step loop applies it, not this


def test_a_peers_skipped_steps_are_read_from_what_its_record_holds():
    from swarmtrain.runtime.server.stage_sync import _skipped_steps

    assert _skipped_steps({"skipped": True, "skipped_steps": 14}) == 14
    assert _skipped_steps({"skipped": True}) == 1 and _skipped_steps({"skipped": False}) == 0
    # a stranger's record may hold anything: a count that is no count reads as the flag
    assert _skipped_steps({"skipped_steps": -3}) == 0 and _skipped_steps({"skipped_steps": True}) == 0
    assert _skipped_steps({"skipped_steps": "7", "skipped": True}) == 1 and _skipped_steps({}) == 0
