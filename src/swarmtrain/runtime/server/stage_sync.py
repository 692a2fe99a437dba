"""Keeping a stage's replicas in line: join, resync (state download), adoption of the other stages'
step, divergence checks, progress records.

Steps themselves are closed and exchanged on the server's event loop (runtime/server/stage_steps.py). This
module runs on its own threads and works from shared state in the DHT:
- each replica publishes `{epoch, samples, serving, fp_epoch, fp}` under `{run}.stage{i}.progress`
  (fp: a fingerprint of its parameters at step fp_epoch);
- a replica joining a stage whose replicas have already stepped downloads their parameters and
  optimizer state (`load_state_from_peers`) before serving;
- every sync tick, the catch-up part decides what a replica behind its stage does (replay, resync,
  adopt, wait: runtime/server/stage_catch_up.py, its rule planner/catch_up.py); resyncs and adoptions
  are carried out here. A resync stops serving, drops the unapplied buckets (recorded as lost) and
  downloads the state;
- replicas compare parameter fingerprints taken at the same step; on a mismatch (a member's gradients
  reached one replica but not another, at that step or any before) the one with the larger id resyncs,
  once a peer it diverged from answers a ping (it serves its own state meanwhile);
- at start, the state comes from live replicas, else the stage's newest checkpoint, else initial
  weights, which are refused once the swarm has stepped (planner/restore.py decides); a replica left
  behind the other stages adopts their step after a grace period: a short one when it was restored
  from an older checkpoint, a request timeout when it has stepped with the swarm (its step's update was
  applied only by a replica that died).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from swarmtrain.config.errors import UserError
from swarmtrain.net.protocol import ProtocolError
from swarmtrain.planner.catch_up import LagRule
from swarmtrain.planner.download_deadline import (
    DEFAULT_RULE,
    DownloadRule,
    describe,
    donor_deadline_s,
    state_bytes,
)
from swarmtrain.planner.restore import (
    RECENT_STEPS,
    Line,
    behind_other_stages,
    choose_start,
    follows_on_mismatch,
    recent_skipped,
    swarm_restarting,
    with_skip,
)
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.server.compute import PRIORITY_SYNC, ComputeWorker
from swarmtrain.runtime.server.held_steps import HeldStepClock
from swarmtrain.runtime.server.stage_catch_up import DETACHED, StageCatchUp, StepsPort
from swarmtrain.runtime.server.stage_worker import StageWorker, import_keeping_step
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


class Fingerprint(NamedTuple):
    """The parameters' fingerprint at `step`, and the samples of its own the replica trained in the
    recent steps as of then (`planner/restore.Line`): both published together, so two replicas compare
    the same numbers."""

    step: int
    values: list[float]
    own_samples: int = 0


def _fingerprint_record(fp: Fingerprint | None) -> dict:
    """The progress record's fingerprint fields, from one read of it: a step may replace it meanwhile,
    and its parts must agree."""
    if fp is None:
        return {"fp_epoch": None, "fp": None, "fp_own": None}
    return {"fp_epoch": fp.step, "fp": fp.values, "fp_own": fp.own_samples}


def _follows_diverged(ours: Fingerprint, peer_id: str, skipped: int, peer: str, record: dict) -> bool:
    """Peer `peer`'s progress `record` shows other parameters than `ours` at the same step, and this
    replica is the one of the pair that follows (`planner/restore.follows_on_mismatch`)."""
    theirs, their_own = record.get("fp"), record.get("fp_own")
    if record.get("fp_epoch") != ours.step or not isinstance(theirs, list) or len(theirs) != 2:
        return False
    own = their_own if isinstance(their_own, int) else None  # None: a peer that does not publish it
    if not follows_on_mismatch(
        Line(peer_id, skipped, ours.own_samples), Line(peer, _skipped_steps(record), own)
    ):
        return False
    return any(
        abs(a - b) > FINGERPRINT_RTOL * (abs(a) + abs(b) + 1e-12)
        for a, b in zip(theirs, ours.values, strict=True)
    )


def _skipped_steps(record: dict) -> int:
    """A peer's recently skipped updates, from its progress record (a stranger's: anything may be there);
    a peer of an earlier version publishes only whether it skipped any."""
    count = record.get("skipped_steps")
    if isinstance(count, int) and not isinstance(count, bool):
        return max(0, count)
    return 1 if record.get("skipped") is True else 0


# Replicas on the same kind of device hold bitwise-equal parameters; one step applied from different
# contributions changes the sums by ~1e-4 relative and more. Replicas on different hardware would drift
# apart by rounding and resync now and then.
FINGERPRINT_RTOL = 1e-6
JOIN_RETRY_S = 1.0
JOIN_RETRIES = 2


@dataclass
class SyncSettings:
    tick_s: float = 0.5
    heartbeat_s: float = 1.0
    progress_ttl_s: float = 4.0
    lag_grace_s: float = 3.0
    # how long a trainer's close past the close window shows the stage ahead
    # (planner/catch_up.evidence_ttl_s: two steps' worth of the swarm's timeouts)
    evidence_ttl_s: float = 120.0
    # a state download's deadline follows the stage's state size (planner/download_deadline.py): a
    # billion-parameter stage's state with Adam is ~12 GB, minutes even at 1 Gbit/s; the server's own
    # (--state-download-min-mbit, --state-download-base-s), not the run's
    download_rule: DownloadRule = DEFAULT_RULE
    compute_timeout_s: float = 120.0
    num_stages: int = 1
    allow_fresh: bool = False  # --fresh-start: initial weights even when the swarm has stepped
    # how long a joiner reads again while the swarm has stepped and no serving replica of its stage shows:
    # two progress record lifetimes (a live replica's record can lapse, see `_stage_epochs`)
    missing_replica_wait_s: float = 8.0
    # how long a replica that has stepped with the swarm waits behind the other stages before it adopts
    # their step (planner/restore.behind_other_stages): the swarm's request timeout
    stranded_grace_s: float = 30.0
    # how long the step loop waits for a trainer's close that has not come (the swarm's request timeout)
    close_timeout_s: float = 10.0


class RestoreRefused(UserError):
    """A replica would serve initial weights to a swarm that has already trained."""


@dataclass
class SyncCounters:
    resyncs: int = 0
    lost_samples: int = 0
    downloaded_bytes: int = 0  # stage states downloaded from peers (joining, resyncs)
    extra: dict = field(default_factory=dict)


def untrained_refusal(stage: int, other_step: int) -> str:
    """Why a replica holding untrained initial weights stops when the other stages have stepped."""
    return (
        f"stage {stage} holds untrained initial weights but the other stages are at step "
        f"{other_step}: refusing to serve (that would silently reset this stage). Restart it with "
        "--checkpoint-dir pointing at its checkpoints, or with --fresh-start on purpose"
    )


class StageSynchronizer:
    def __init__(
        self,
        worker: StageWorker,
        compute: ComputeWorker,
        averager,
        records,
        peer_id: str,
        digest: str,
        settings: SyncSettings,
        ledger: Ledger | None = None,
        checkpoints=None,
        on_fatal: Callable[[str], None] | None = None,
        steps: StepsPort = DETACHED,
    ) -> None:
        """`checkpoints`: a StageCheckpointer to restore from (None: no checkpoints); `on_fatal`: stop
        the server with this message (a replica that must not serve); `steps`: the step exchange as this
        object's threads reach it (runtime/server/stage_catch_up.py; DETACHED: none)."""
        self.worker, self.compute, self.averager, self.records = worker, compute, averager, records
        self.peer_id, self.digest, self.settings = peer_id, digest, settings
        self.stage = worker.spec.index
        self.ledger = ledger or Ledger(None)
        self.checkpoints, self.on_fatal, self.steps = checkpoints, on_fatal, steps
        self.untrained = True  # initial weights: never stepped, downloaded or restored
        self.restored = False  # state from a checkpoint (or --fresh-start), no step applied since
        # (the step moved to, the steps moved over) for each time our parameters skipped updates the stage
        # applied: an adoption of the other stages' step, a restore from an older checkpoint (a peer that
        # skipped fewer recently wins a fingerprint mismatch, and donors that skipped none are preferred)
        self._skips: list[tuple[int, int]] = []
        self._other_ahead_since_s: float | None = None
        # what the running adoption clock is for (`check_other_stages`): giving a close up or not, at which epoch
        self._adoption: tuple[bool, int] | None = None
        self.held_step = HeldStepClock(worker, steps, peer_id, settings.close_timeout_s)  # nobody closes
        self.counters = SyncCounters()
        self.serving = threading.Event()
        self.stop_event = threading.Event()
        self._fp: Fingerprint | None = None
        self._own_recent: deque[int] = deque(maxlen=RECENT_STEPS)  # own samples of the last steps applied
        rule = LagRule(
            settings.lag_grace_s,
            settings.evidence_ttl_s,
            steps.window,
            close_timeout_s=settings.close_timeout_s,
        )
        self.catch_up = StageCatchUp(worker, steps, rule)  # what a replica behind its stage does
        self._publish_now = threading.Event()
        self._threads: list[threading.Thread] = []

    # life cycle ---------------------------------------------------------------------------------
    def join(self) -> None:
        """Before serving: take the state from live replicas, a checkpoint, or initial weights."""
        self._start_thread(self._publish_loop, "stage-progress")
        self.publish()
        rule = self.settings.download_rule  # printed before any download: what the joiner will wait
        logger.info("stage %d state downloads: %s", self.stage, describe(self._state_bytes(), rule))
        found = self.checkpoints.load_newest(self.worker.names) if self.checkpoints is not None else None
        checkpoint_step = None if found is None else found[0].step
        swarm_step = self._other_stages_step()
        peer_epochs = self._stage_epochs(swarm_step, checkpoint_step)
        start = choose_start(peer_epochs, checkpoint_step, swarm_step, self.settings.allow_fresh)
        if start.source == "peers" and not self._joined_from_peers():
            # no donor delivered within the deadline, or the replicas died meanwhile: as if there were none
            start = choose_start([], checkpoint_step, swarm_step, self.settings.allow_fresh)
            if start.source == "checkpoint":
                logger.warning(
                    "stage %d: no donor completed the state download within its deadline (%.0f s); "
                    "resuming from this stage's checkpoint at step %d",
                    self.stage,
                    self._download_deadline_s()[1],
                    checkpoint_step,
                )
        # state_step: every step before it is in the state this replica starts from (the accounting
        # counts dead replicas' steps before it as applied)
        state_step = {"peers": self.worker.epoch, "checkpoint": checkpoint_step or 0}.get(start.source, 0)
        self.ledger.write(
            "restore",
            source=start.source,
            epoch=start.epoch,
            lost_steps=start.lost_steps,
            state_step=state_step,
        )
        if start.source == "refuse":
            raise RestoreRefused(f"stage {self.stage}: {start.reason}")
        if start.source == "checkpoint":
            checkpoint, meta, tensors = found
            self._on_compute(lambda: self.worker.import_state(meta, tensors))
            logger.info("stage %d restored from %s", self.stage, checkpoint.tensors_path)
        self.untrained = start.source == "fresh"
        self.restored = start.source == "checkpoint" or (start.source == "fresh" and start.epoch > 0)
        if start.epoch > self.worker.epoch:
            self._skips = with_skip(self._skips, start.epoch, start.epoch - self.worker.epoch)
            self._on_compute(lambda: self.worker.advance_to(start.epoch))
        self._refresh_fingerprint()
        log = logger.warning if start.lost_steps else logger.info
        log("stage %d starts at step %d from %s: %s", self.stage, start.epoch, start.source, start.reason)
        self.averager.state_sharing_priority = self._sharing_priority()
        self.serving.set()
        self.publish()

    def _joined_from_peers(self) -> bool:
        """Downloads the state from the stage's replicas, all tries within one download's deadline
        (planner/download_deadline.py): a failed download from replicas that are still there (a busy
        donor) is tried again with the donors that still fit in it. True when a download succeeded."""
        donor_s, total_s = self._download_deadline_s()
        ends_s = time.monotonic() + total_s
        self.resync("joining a stage that has already trained", joining=True)
        for _ in range(JOIN_RETRIES):
            donors = int((ends_s - time.monotonic() - JOIN_RETRY_S) // donor_s)
            if not (self.untrained and donors >= 1 and self.recorded_peers()):
                break
            time.sleep(JOIN_RETRY_S)
            self.resync(
                "joining: the last download failed and the stage's replicas are still there",
                donors,
                joining=True,
            )
        return not self.untrained

    def _download_deadline_s(self) -> tuple[float, float]:
        """(one donor's deadline, the whole download's) for this stage's state."""
        rule = self.settings.download_rule
        donor_s = donor_deadline_s(self._state_bytes(), rule)
        return donor_s, rule.max_donors * donor_s

    def _state_bytes(self) -> float:
        """The stage's state as the download rule counts it: parameters and Adam's two moments."""
        return state_bytes(sum(p.numel() for p in self.worker.params))

    def start(self) -> None:
        self._start_thread(self._loop, "stage-sync")

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        self._publish_now.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _loop(self) -> None:
        while not self.stop_event.wait(self.settings.tick_s):
            try:
                self.tick()
            except Exception:  # keep checking; a bug here must not silently stop training
                logger.exception("stage sync tick failed")

    # checks -------------------------------------------------------------------------------------
    def step_applied(self, epoch: int, fingerprint: list[float] | None, own_samples: int = 0) -> None:
        """Called after every applied step (from the event loop), with the samples of its own the step
        applied (0 for a replay). Not published at once: a DHT store per step per replica cost CPU the
        stage needs (several steps per second on `tiny`); the heartbeat carries the epoch and its
        fingerprint together."""
        self._own_recent.append(own_samples)
        if fingerprint is not None:  # None: a local step (swarm.local_steps), replicas differ until the round
            self._fp = Fingerprint(epoch, fingerprint, sum(self._own_recent))
        self.untrained = self.restored = False
        self.averager.state_sharing_priority = self._sharing_priority()

    def tick(self) -> None:
        self.catch_up.tick(self)

    # the catch-up's port (stage_catch_up.SyncPort) ------------------------------------------------
    @property
    def fresh_state(self) -> bool:
        return self.restored or self.untrained

    def stop_adopting(self) -> None:
        self._other_ahead_since_s = None

    def check_other_stages(
        self,
        epoch: int,
        now_s: float,
        stranded_grace_s: float | None = None,
        abandon_close: bool = False,
        at_least: int = 0,
    ) -> None:
        """No replica of this stage is ahead: are the other stages, for longer than a step takes?
        `stranded_grace_s`: instead of the settings' (no replica that answers is ahead); `abandon_close`:
        neither a close of this replica's step nor the samples it holds of it hold it back, and it adopts
        at least `at_least`, and at least the step after its own (a vouched close says the stage ran the
        step; those who hold it are silent). The clock restarts when the epoch moves: a replica that
        stepped meanwhile is not the one that waited."""
        other = self._other_stages_step()
        target = max(other, epoch + 1, at_least) if abandon_close else other
        if target <= epoch or (abandon_close, epoch) != self._adoption:
            # the clock of one kind of adoption is not the other's: a close is given up only after
            # its holders were silent for the whole grace
            self._other_ahead_since_s, self._adoption = None, (abandon_close, epoch)
        if target <= epoch:
            return
        since = self._other_ahead_since_s = self._other_ahead_since_s or now_s
        action = behind_other_stages(
            epoch,
            target,
            self.worker.unapplied_samples,
            now_s - since,
            self.settings.lag_grace_s,
            self.untrained,
            self.settings.allow_fresh,
            self.steps.closing(),
            self.restored,
            self.settings.stranded_grace_s if stranded_grace_s is None else stranded_grace_s,
            abandon_close,
            self.steps.finishing(),
        )
        if self.worker.epoch != epoch:
            # inputs read across an apply (the DHT read is slow; the apply moves the epoch, then drops
            # the bucket, and `untrained` is cleared after it): they describe no state, decide nothing
            return
        if action == "wait":
            self.held_step.check(epoch, other, now_s - since, now_s, self.recorded_peers)
        elif action == "advance":
            closed = f"step {epoch} was closed here or further on, and no replica that can finish it answers"
            self._advance(
                epoch, target, now_s - since, closed if target > other else f"the other stages at {other}"
            )
        elif action == "refuse":
            self.serving.clear()
            self.publish()
            if self.on_fatal is not None:
                self.on_fatal(untrained_refusal(self.stage, other))

    def _advance(self, epoch: int, target: int, behind_s: float, why: str) -> None:
        """Adopt step `target` without this stage's updates of the steps between (`skipped`: the replica
        follows a peer that applied them when their parameters differ); nothing if the step loop stepped
        since the rule decided (it decides anew: the samples it saw are no longer the ones held)."""

        def advance() -> tuple[int, list[str]] | None:
            return None if self.worker.epoch != epoch else self.worker.advance_to(target)

        moved = self._on_compute(advance)
        if moved is None:
            return
        self.steps.epoch_moved()  # at once: the step loop reaches the new step before a close of it comes
        lost_samples, lost_ids = moved
        if lost_ids:  # samples accumulated for the steps given up: the ledger's accounts name them
            self.ledger.write("lost", mbs=lost_ids, n=lost_samples, reason="advance")
        logger.warning(
            "stage %d was at step %d, %s for %.0f s%s: adopting step %d (this stage's updates of %d "
            "step(s) are lost)",
            self.stage,
            epoch,
            why,
            behind_s,
            "" if self.restored or self.untrained else " and no replica of this stage is ahead",
            target,
            target - epoch,
        )
        self.ledger.write("advance", epoch=target, skipped=target - epoch, lost=lost_samples)
        self._skips = with_skip(self._skips, target, target - epoch)
        self.averager.state_sharing_priority = self._sharing_priority()
        self._refresh_fingerprint()
        self._other_ahead_since_s = None
        self.publish()

    def _other_stages_step(self) -> int:
        """The highest step a live replica of another stage of this run reports (a DHT read per stage)."""
        epochs = [v["epoch"] for v in self._other_stage_records() if isinstance(v.get("epoch"), int)]
        return max(epochs, default=0)

    def _other_stage_records(self) -> Iterator[dict]:
        """The progress records of the other stages' replicas of this run (a DHT read per stage)."""
        for stage in range(self.settings.num_stages):
            if stage != self.stage:
                for value in self.records.stage_progress(stage).values():
                    if value.get("digest") == self.digest:
                        yield value

    def resync(self, reason: str, max_donors: int | None = None, joining: bool = False) -> None:
        """Stop serving, drop unapplied buckets, download the stage state from peers (trying at most
        `max_donors`, by default the download rule's), serve again. `joining`: the join decides what a
        failed download leads to (a retry, the checkpoint) and says so itself."""
        logger.warning("resync of stage %d replica: %s", self.stage, reason)
        self.serving.clear()
        self.averager.state_sharing_priority = -1.0  # never be picked as a donor while stale
        self.publish()
        donor_s = self._download_deadline_s()[0]
        loaded = self.averager.download_state(donor_s, max_donors or self.settings.download_rule.max_donors)
        imported = None
        if loaded is not None:
            self.counters.downloaded_bytes += sum(t.numel() * t.element_size() for t in loaded[1])
            try:
                imported = self._on_compute(
                    lambda: import_keeping_step(self.worker, *loaded, self.steps.means_of)
                )
            except ProtocolError as exc:  # e.g. the donor died mid-stream: a truncated state
                logger.error("downloaded stage state refused: %s", exc)
        if imported is None and joining:
            logger.info("state download failed (%s)", reason)
        elif imported is None:
            logger.error("state download failed; serving the local state and retrying later")
        else:
            lost_samples, lost_ids = imported
            self.untrained = self.restored = False
            self._skips.clear()
            self.counters.resyncs += 1
            if lost_ids:
                self.counters.lost_samples += lost_samples
                self.ledger.write("lost", mbs=lost_ids, n=lost_samples, reason=reason)
            self.ledger.write("resync", epoch=self.worker.epoch, reason=reason)
            self.steps.epoch_moved()
        self._refresh_fingerprint()
        self.averager.state_sharing_priority = self._sharing_priority()
        self.serving.set()
        self.publish()

    def _stage_epochs(self, swarm_step: int, checkpoint_step: int | None = None) -> list[int]:
        """The steps the stage's serving replicas are at. A live replica's record can lapse for seconds (a
        donor busy sending its state), so while the other stages have stepped and none shows, read again
        for a while; not while the swarm restarts from checkpoints (`swarm_restarting`)."""
        deadline_s = time.monotonic() + self.settings.missing_replica_wait_s
        while True:
            epochs = [
                v["epoch"]
                for v in self.recorded_peers().values()
                if v.get("serving", True) and isinstance(v.get("epoch"), int)
            ]
            if epochs or swarm_step == 0 or time.monotonic() >= deadline_s:
                return epochs
            others = self._other_stage_records
            if checkpoint_step is not None and swarm_restarting(others(), swarm_step, checkpoint_step):
                return epochs
            time.sleep(JOIN_RETRY_S)

    def recorded_peers(self) -> dict[str, dict]:
        """Progress of the stage's other replicas with our config (a DHT read)."""
        progress = self.records.stage_progress(self.stage)
        return {p: v for p, v in progress.items() if p != self.peer_id and v.get("digest") == self.digest}

    def diverged_from(self, others: dict[str, dict]) -> frozenset[str]:
        """The peers we follow (`planner/restore.follows_on_mismatch`) that had other parameters than ours
        at the same step."""
        if self._fp is None:
            return frozenset()
        return frozenset(
            p for p, v in others.items() if _follows_diverged(self._fp, self.peer_id, self.skipped, p, v)
        )

    @property
    def skipped(self) -> int:
        """This stage's updates our state lacks among the last RECENT_STEPS steps (`recent_skipped`)."""
        return recent_skipped(self._skips, self.worker.epoch)

    def _sharing_priority(self) -> float:
        """Donors are picked by the highest priority: the step, a state that skipped steps half a step
        lower than one at the same step that did not."""
        return self.worker.epoch - (0.5 if self.skipped else 0.0)

    @property
    def fingerprint(self) -> list | None:
        return None if self._fp is None else [self._fp.step, list(self._fp.values)]

    def _refresh_fingerprint(self) -> None:
        """After the state changed other than by a step (download, restore): fingerprint it as it is. The
        samples it trained before are no longer on its line."""
        self._own_recent.clear()
        self._fp = Fingerprint(
            *self._on_compute(lambda: (self.worker.epoch, self.worker.param_fingerprint()))
        )

    def _on_compute(self, fn):
        return self.compute.submit(fn, PRIORITY_SYNC).result(timeout=self.settings.compute_timeout_s)

    # progress records ---------------------------------------------------------------------------
    def publish(self) -> None:
        """Ask the publisher thread to store our progress now (DHT latency stays off the step path)."""
        self._publish_now.set()

    def _publish_loop(self) -> None:
        while not self.stop_event.is_set():
            self._publish_now.wait(self.settings.heartbeat_s)
            self._publish_now.clear()
            if self.stop_event.is_set():
                break
            skipped = self.skipped
            value = {
                "epoch": self.worker.epoch,
                "samples": self.worker.unapplied_samples,
                "digest": self.digest,
                "serving": self.serving.is_set(),
                **_fingerprint_record(self._fp),
                "skipped": skipped > 0,  # what an earlier version reads
                "skipped_steps": skipped,
                "restored": self.restored,  # from a checkpoint, no step since (`swarm_restarting`)
            }
            try:
                self.records.publish_progress(self.stage, self.peer_id, value, self.settings.progress_ttl_s)
            except Exception:
                logger.exception("publishing stage progress failed")
