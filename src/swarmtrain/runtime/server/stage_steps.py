"""One global step across a stage's replicas: close, exchange, apply, in step order.

A trainer numbers its micro-batches by global step (runtime/trainer/step_tracker.py). When every micro-batch
of step k has finished this stage's backward, it sends every replica of the stage it knows a
`close` naming the replicas that accumulated them (`members`, with samples) and the replicas it
told (`participants`). With N trainers (shards) a replica waits for N closes, or for
`close_timeout_s` after the first one (a trainer died mid-step).

Then each member sends its sealed gradient sums of step k straight to the other participants
(`grads` messages over the stage's own RPC transport), every participant adds the members' sums,
divides by their samples and applies the optimizer step. All replicas therefore apply the same
gradient of exactly the step's samples. Only the listed members count, so every replica sums the
same set; a member that cannot be reached (connection error) or whose sums do not come within
`exchange_timeout_s` is left out, which can make replicas differ: the fingerprint check in
runtime/server/stage_sync.py then resyncs the one with the larger id (once a peer it diverged from
answers). A member that is frozen (SIGSTOP, a partition: nothing answers, no connection error) is not
waited for that long: once its sums are `probe_after_s` late, a ping its event loop would answer at once
(`alive`) tells it from a slow one, and a silent member is left out like an unreachable one.

Why not hivemind's `DecentralizedAverager` for this: its matchmaking took 0.2-1.2 s per round on
this machine (DHT-based group formation with a minimum matchmaking time), several times longer
than a global batch of `tiny` takes, so rounds merged several global batches into one step. The
replicas of a stage are few and known here (trainers name them), so a direct exchange takes one
RPC (~10 ms on loopback). hivemind's averager is still what serves and downloads the stage state.

A step is decided by what the stage knows, not by one message: in an open run (no run key) anyone can
send a `close` or `grads`, so each is checked against this replica's own state and the stage's live
replicas (planner/step_decision.py, pure functions): a close is kept only for this
replica's next step to apply or the one after (`close_window`: 1 + max_staleness), and acted on only
at its own step; its members must be live replicas of this stage (or this replica, or a peer seen
live while the step was pending: a member cut off mid-step still counts); the samples it
attributes to this replica must equal what this replica accumulated for the step, each close for
exactly the samples of its sender's micro-batches (`backed_by_origin`: a stranger reading the public
count speaks for none of them), unless another
member's gradients confirm the close exactly (then this replica's samples are left out as
`unconfirmed`); a replica the close does not name, or a close naming nobody, needs such a confirmation.
A close naming this replica short of its samples (the trainer missed a reply) decides after a grace,
but only when its sender's closes were found true here before (`StepInbox.trusted`): a stranger's
short close needs no knowledge of the replica, and time alone does not tell it from a trainer's.
`grads` come only from live replicas and count only from a member of the decided close whose sample
count equals the close's. A close that fails these checks is logged and not acted on, and the honest
close, when it comes, decides. Only when no close passes for `close_timeout_s` after one became due (a
trainer died mid-step, or all of a step's micro-batches failed) does the replica act on the best
remaining one as before these checks (`lenient`): a stage must not stall. Not on a close nobody can
verify, though: the fallback needs samples of its own or gradients from a live replica of the stage
(forged closes to an idle open swarm moved a replica's epoch that way). When no close of the step comes
at all (its trainer died before closing, or gave a close up) and the other stages went on, the
synchronizer has the samples held applied the same way (`apply_held`, planner/held_step.py).

The live replicas are what the DHT last showed (`LiveReplicas`, refreshed every announce period) plus
every peer that answered a direct stage ping (`verify`): a close naming a peer the view lacks (a replica
that just joined or moved here) starts that ping at once, so an honest close waits one round trip, not a
DHT refresh or the lenient fallback (which made a 2-replica test run 250 s instead of 32 s in an earlier
version of these checks).

Everything here runs on the server's asyncio loop; tensor work goes to the compute thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from swarmtrain.net.robust import robust_mean
from swarmtrain.planner.catch_up import MAX_REPLAY_STEPS
from swarmtrain.planner.held_step import held_step_decision
from swarmtrain.planner.step_decision import (
    StepDecision,
    decide_step,
    settle_step,
    short_close_grace_s,
    step_candidates,
    step_contributions,
    vouched_senders,
)
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.server.compute import PRIORITY_SYNC, ComputeWorker
from swarmtrain.runtime.server.stage_members import LiveReplicas, Verify
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.runtime.server.step_inbox import PendingStep, StepCounters, StepInbox, short
from swarmtrain.runtime.server.step_outbox import Alive, GradSender, SumsOut
from swarmtrain.runtime.server.step_rate import StepRate
from swarmtrain.runtime.server.step_versions import VersionGate
from swarmtrain.runtime.server.sums_codec import SumsCodec, WireSums
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# (epoch, parameter fingerprint or None, live): `live` is False for a step replayed from a peer's means
# after a step: the new epoch, the new parameters' fingerprint (None: a local step), whether the step was
# this replica's own (False: a replay from a peer's means), and the samples of its own it applied
OnStep = Callable[[int, list[float] | None, bool, int], None]
# The mean gradients of recent steps are kept for replicas that missed them (`replay`): at least
# `KEPT_STEP_MEANS` steps, more while they fit in `KEPT_MEANS_BYTES`. Three alone are too few for a
# moved server: `tiny` steps 4-7 times during its state download, so it would download the whole state
# again, fall behind again and serve little for 10-20 s (bench/rebalance_live.py). A big stage steps
# slowly, so its three steps cover a download's duration too.
KEPT_STEP_MEANS = 3
KEPT_MEANS_BYTES = 64 * 2**20


@dataclass
class StepSettings:
    close_timeout_s: float = 10.0
    exchange_timeout_s: float = 30.0
    poll_s: float = 0.5  # how often a waiting step re-checks for a resync that moved the epoch
    # a member's sums this late: ping it (a frozen member is left out instead of waited for); an honest
    # exchange takes ~10 ms on a LAN and a few seconds for a big stage over a slow link, but a slow
    # member still answers a ping, so this only decides how soon a frozen one is noticed
    probe_after_s: float = 1.0
    short_close_grace_s: float = 1.0  # at least this long before acting on a close short of our samples


class StepCoordinator:
    def __init__(
        self,
        worker: StageWorker,
        compute: ComputeWorker,
        peer_id: str,
        send_grads: GradSender,
        settings: StepSettings,
        ledger: Ledger | None = None,
        on_step: OnStep | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        alive: Alive | None = None,
        live_replicas: LiveReplicas | None = None,
        verify: Verify | None = None,
        close_window: int = 1,
        sums_codec: SumsCodec | None = None,
    ) -> None:
        """`live_replicas`: the stage's live replicas from the DHT (None: not checked, tests); `verify`:
        a direct check of a peer the view lacks (None: only the view counts); `close_window`:
        1 + max_staleness (see `close_refusal`); `sums_codec`: how this replica's sums go to its stage
        peers (None: uncompressed)."""
        self.worker, self.compute, self.peer_id = worker, compute, peer_id
        self._close_wait_s: float | None = None  # moving average: reaching a step -> deciding it
        self.settings = settings
        self.sums_codec = sums_codec or SumsCodec()
        self.sums_out = SumsOut(peer_id, send_grads, alive, settings.probe_after_s)
        self.ledger = ledger or Ledger(None)
        self.on_step = on_step  # after every step (applied or skipped) with the new parameters' fingerprint
        self.counters = StepCounters()
        self.step_rate = StepRate()  # the swarm's samples/s as the steps applied here show it (announced)
        # the closes and sums heard, by step (`on_close`, `on_grads`): what the step loop decides on
        self.inbox = StepInbox(
            lambda: self.worker.epoch,
            peer_id,
            self.counters,
            live_replicas,
            verify,
            close_window,
            on_left_behind=lambda: self.versions.changed(),
        )
        self.pending = self.inbox.pending
        # the mean gradients of the last steps applied here, for replicas that missed them (`replay`);
        # none with local steps: every replica stepped on its own gradient, there is no shared mean
        # (decided here once: a worker's outer optimizer and parameters are fixed when it is built)
        self.kept_means = KeptMeans(worker.params) if worker.outer is None else None
        self._replaying = False
        self.finishing: int | None = None  # the step `_finish` works on (no replay of it meanwhile)
        # what forwards wait on; the loop is the server's (made before serving) or a test's
        self.versions = VersionGate(lambda: self.worker.epoch, loop or asyncio.get_running_loop())

    # the step loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            step = self.worker.epoch
            for old in [s for s in self.pending if s < step]:  # applied, replayed or skipped by a resync
                del self.pending[old]
            try:
                if await self._wait(step, self._decided):
                    await self._finish(step)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep stepping; a bug here must not silently stop the stage
                logger.exception("step %d failed", step)
                await asyncio.sleep(self.settings.poll_s)

    async def _wait(self, step: int, ready: Callable[[PendingStep], bool], timeout_s: float | None = None):
        """Until `ready(state)`; False if the epoch moved (resync) or `timeout_s` passed."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while self.worker.epoch == step:
            state = self.pending.setdefault(step, PendingStep(step))
            if ready(state):
                return True
            wait_s = self.settings.poll_s
            if deadline_s is not None:
                wait_s = min(wait_s, deadline_s - time.monotonic())
                if wait_s <= 0:
                    return False
            state.changed.clear()
            try:
                await asyncio.wait_for(state.changed.wait(), wait_s)
            except TimeoutError:
                pass
        return False

    def _decided(self, state: PendingStep) -> bool:
        """Whether this replica closes its step now (`decide_step`); keeps the candidate it starts with."""
        if state.reached_s is None:
            state.reached_s = time.monotonic()
        if self._replaying or not (state.closes or state.held):
            return False
        if not state.closes:  # no trainer's close came, the other stages went on (`apply_held`)
            state.decision = state.held
            return True
        bucket = self.worker.buckets.get(state.step)
        own = bucket.samples if bucket is not None else 0
        by_origin = dict(bucket.by_origin) if bucket is not None else {}
        if own and state.held_s is None:
            state.held_s = time.monotonic()
        live = self.inbox.view_of(state)
        heard_peers = any(live is None or peer in live for peer in state.received)
        state.decision = decide_step(
            self._candidates(state),
            self.peer_id,
            own,
            _counts(state),
            time.monotonic(),
            self.settings.close_timeout_s,
            confirm=self.worker.outer is None,
            reached_s=state.reached_s,
            held_s=state.held_s,
            short_grace_s=self._short_grace_s(),
            heard_peers=heard_peers,
            trusted=self.inbox.trusted.keys(),
            by_origin=by_origin,
        )
        if state.decision is not None and not state.decision.lenient:
            took_s = time.monotonic() - state.reached_s
            self._close_wait_s = (
                took_s if self._close_wait_s is None else 0.8 * self._close_wait_s + 0.2 * took_s
            )
        return state.decision is not None

    def _short_grace_s(self) -> float:
        s = self.settings
        return short_close_grace_s(self._close_wait_s, s.short_close_grace_s, s.close_timeout_s)

    def _candidates(self, state: PendingStep, due: bool = False) -> list[StepDecision]:
        candidates = step_candidates(
            state.closes.values(), self.peer_id, self.inbox.view_of(state), self.settings.close_timeout_s
        )
        now_s = time.monotonic()
        return [c for c in candidates if c.due_s <= now_s] if due else candidates

    def apply_held(self, step: int, members: Mapping[str, int]) -> bool:
        """Apply the samples held of `step` with `members`, no close having come (planner/held_step.py);
        False when it left the step, is finishing or replaying one, or a close came (that decides)."""
        held = self.worker.buckets.get(step)
        if self.finishing is not None or self._replaying or self.worker.epoch != step or not held:
            return False
        state = self.pending.setdefault(step, PendingStep(step))
        if state.closes or not held.samples:
            return False
        state.held = held_step_decision(members, self.peer_id, time.monotonic())
        state.changed.set()
        return True

    # steps missed: replayed from a peer's means ---------------------------------------------------
    def means_of(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        """(samples, mean gradients) of a recent step applied here; None when not kept."""
        return None if self.kept_means is None else self.kept_means.get(step)

    def _keep_means(self, step: int, samples: int, means: list[torch.Tensor] | None) -> None:
        if self.kept_means is not None:
            self.kept_means.keep(step, samples, means)

    async def replay(self, step: int, samples: int, means: list[torch.Tensor] | None) -> bool:
        """Apply step `step` as its participants did, from one participant's mean gradients: a replica
        that was no participant (it joined or resynced while the step was closed) catches up with the
        same optimizer math on the same state instead of downloading the whole state again, which takes
        longer than a step at a CPU quota and never catches up (bench/rebalance_live.py). False when
        this replica is not at `step` or holds samples of its own (a resync handles those)."""
        busy = self._replaying or self.finishing == step
        if self.worker.epoch != step or self.worker.unapplied_samples or busy:
            return False
        self._replaying = True
        try:

            def apply() -> tuple[bool, list[float]]:
                applied = self.worker.apply_step(step, means, samples)  # leaves `means` as they are
                self._keep_means(step, samples, means)  # in the job, as a step's (`_apply`)
                return applied, self.worker.param_fingerprint()

            applied, fingerprint = await self._on_compute(apply)
        finally:
            self._replaying = False
        replayed = self.pending.pop(step, None)
        if replayed is not None:  # the step loop, waiting on this step, looks at the next one now
            replayed.changed.set()
        self.versions.changed()
        self.counters.replayed_steps += 1
        self.ledger.write("replay", step=step, n=samples, applied=applied)
        if self.on_step is not None:
            self.on_step(step + 1, fingerprint, False, 0)
        return True

    async def _finish(self, step: int) -> None:
        self.finishing = step
        try:
            await self._finish_step(step)
        finally:
            self.finishing = None

    async def _finish_step(self, step: int) -> None:
        state, start_s = self.pending[step], time.monotonic()
        start = state.decision
        assert start is not None  # set by `_decided`
        if start.lenient:
            _say_fallback(step, start, self.worker.buckets.get(step), self.counters, self.settings)
        bucket = await self._on_compute(lambda: self.worker.seal(step))
        if self.worker.outer is not None:
            await self._finish_local(state, start, bucket, start_s)
            self.step_rate.applied(sum(start.members.values()), time.monotonic())
            return
        peers = bool((start.participants | set(start.members)) - {self.peer_id})
        sums = await self._on_compute(lambda: _encoded(self.sums_codec, bucket.grad_sums, peers))
        answered, final = await self._exchange(state, start, bucket.samples, sums, bucket.by_origin)
        if self.worker.epoch != step:
            return  # a resync moved us on meanwhile
        contributions, missing = self._contributions(state, final, bucket, sums)
        if not answered or missing:
            self.counters.partial_exchanges += 1
            logger.warning("step %d: no gradients from %s; stepping without them", step, list(missing))
        await self._apply(step, contributions, bucket.micro_batch_ids, start_s)
        # the close's count: the whole swarm's samples of the step, whoever of this stage sent sums
        self.step_rate.applied(sum(final.members.values()), time.monotonic())

    async def _exchange(
        self, state: PendingStep, start: StepDecision, own: int, sums: WireSums, origins: dict[str, int]
    ) -> tuple[bool, StepDecision]:
        """Send our sums and wait for the members'; (whether all came, the close finally acted on).
        `origins`: our sealed samples by whose micro-batches they are (`Bucket.by_origin`)."""
        if start.lenient:  # as before the checks: named members count with whatever they send
            if own and self.peer_id in start.members:
                self.sums_out.send(state, start.participants | set(start.members), own, sums)
            return await self._wait_for_sums(state, set(start.members) - {self.peer_id}), start
        sent: set[str] = set()  # the exchange decides which close is applied (`settle_step`)

        def settled(s: PendingStep) -> bool:
            due = self._candidates(s, due=True)
            self.sums_out.send_where_named(s, due, own, sums, sent)
            s.decision = settle_step(due, self.peer_id, own, _counts(s), s.unreachable, by_origin=origins)
            return s.decision is not None

        answered = await self._wait_for_sums(state, set(), settled)
        if self.worker.epoch == state.step and not answered:
            candidates = self._candidates(state, due=True)
            state.decision = settle_step(candidates, self.peer_id, own, _counts(state), set(), True, origins)
        return answered, state.decision or start

    def _contributions(
        self, state: PendingStep, final: StepDecision, bucket, sums: WireSums
    ) -> tuple[dict, tuple[str, ...]]:
        """The sums this replica adds for the step, by peer in peer order, and the members whose sums do
        not count (`step_contributions`); our own are `sums` as the peers decode them."""
        step, own = state.step, bucket.samples
        if not final.complete:
            self.counters.timed_out_closes += 1
            logger.warning("step %d: the closes of %d trainer(s) came, not of all", step, final.closes)
        mine = final.members.get(self.peer_id, 0)
        chosen = step_contributions(final, self.peer_id, own, _counts(state))
        self.inbox.vouch(vouched_senders(final, self.peer_id, own, _counts(state), bucket.by_origin))
        if mine and own != mine:
            self.counters.disagreeing_closes += 1
            verdict = "all counted" if chosen.own else "left out"
            logger.warning(
                "step %d: this replica holds %d samples, the close of %s says %d: %s",
                step,
                own,
                [short(p) for p in sorted(final.senders)],
                mine,
                verdict,
            )
        if own and not chosen.own:  # the trainers do not confirm these: the others cannot count them
            self.counters.unconfirmed_samples += own
            self.ledger.write("lost", mbs=bucket.micro_batch_ids, n=own, reason="unconfirmed")
        for peer in chosen.ignored:
            self.counters.ignored_grads += 1
            logger.warning(
                "step %d: %s sent gradients of %d samples, the close says %d: left out",
                step,
                short(peer),
                state.received[peer][0],
                final.members[peer],
            )
        # fp32 addition is not associative: every replica must add the same sums in the same order
        # (with our own sums appended last, 3 replicas drifted apart by rounding, ~1e-9 per run)
        contributions = {peer: state.received[peer] for peer in chosen.peers}
        if chosen.own:
            contributions[self.peer_id] = (own, sums.tensors)
        return dict(sorted(contributions.items())), chosen.missing

    async def _finish_local(self, state: PendingStep, decision: StepDecision, bucket, start_s: float) -> None:
        """swarm.local_steps > 1: step on this replica's own gradient; at every H-th step, average the
        pseudo-gradients (weighted by samples since the last round) with the step's participants in
        peer order and take the outer step, so all end the round with the same parameters."""
        step = state.step
        self.inbox.vouch(
            vouched_senders(decision, self.peer_id, bucket.samples, _counts(state), bucket.by_origin)
        )
        own = {self.peer_id: (bucket.samples, bucket.grad_sums)} if bucket.samples else {}
        sync = self.worker.is_sync_step(step)
        await self._apply(step, own, bucket.micro_batch_ids, start_s, hold_epoch=sync)
        if not sync or self.worker.epoch != step:
            return
        samples, raw_delta = await self._on_compute(self.worker.pseudo_gradient)
        delta = await self._on_compute(lambda: self.sums_codec.encode(raw_delta))
        others = (decision.participants | set(decision.members)) - {self.peer_id}
        self.sums_out.send(state, others, samples, delta)
        complete = await self._wait_for_sums(state, others)
        if self.worker.epoch != step:
            return  # a resync moved us on meanwhile
        contributions = {p: state.received[p] for p in sorted(others) if p in state.received}
        contributions[self.peer_id] = (samples, delta.tensors)
        contributions = {p: c for p, c in sorted(contributions.items()) if c[0] > 0}
        if not complete:
            self.counters.partial_exchanges += 1
            logger.warning("step %d: outer round without %s", step, sorted(others - set(state.received)))

        def finish() -> list[float]:  # combined on the compute thread, as a step's gradients are
            # pseudo-gradients are per-sample means: weight them back into sums first
            sums = {p: (n, [t * n for t in delta]) for p, (n, delta) in contributions.items()}
            mean = self._combine(step, sums) if len(contributions) > 1 else None
            self.worker.finish_sync(step, mean)
            return self.worker.param_fingerprint()

        fingerprint = await self._on_compute(finish)
        self.pending.pop(step, None)
        self.versions.changed()
        self.counters.last_group_size = len(contributions)
        self.ledger.write("sync", step=step, group={p: n for p, (n, _) in contributions.items()})
        if self.on_step is not None:  # its samples were counted by the local steps that trained them
            self.on_step(step + 1, fingerprint, True, 0)

    async def _wait_for_sums(
        self, state: PendingStep, others: AbstractSet[str], ready: Callable[[PendingStep], bool] | None = None
    ) -> bool:
        """Until every one of `others` sent its sums or is left out (unreachable, or silent when pinged),
        or until `ready(state)` when given (then the members of the due candidates are the ones pinged);
        False if the epoch moved or `exchange_timeout_s` passed."""
        if ready is None:
            ready = lambda s: others <= set(s.received) | s.unreachable  # noqa: E731
            awaited = lambda: others  # noqa: E731
        else:
            awaited = lambda: set().union(*(c.members for c in self._candidates(state, due=True)))  # noqa: E731
        prober = (
            asyncio.create_task(self.sums_out.probe_late(state, awaited)) if self.sums_out.alive else None
        )
        try:
            return await self._wait(state.step, ready, self.settings.exchange_timeout_s)
        finally:
            if prober is not None:
                prober.cancel()

    async def _apply(
        self, step: int, contributions: dict, own_ids: list[str], start_s: float, hold_epoch: bool = False
    ) -> None:
        samples = sum(n for n, _ in contributions.values())
        # between outer rounds (local steps) replicas legitimately differ: no fingerprint to compare
        local_step = self.worker.outer is not None

        def apply() -> tuple[bool, list[float] | None] | None:
            if self.worker.epoch != step:  # the sync thread adopted the other stages' step meanwhile
                return None
            # combined here, not on the event loop: parameter-sized arithmetic (and on CUDA, waits for the
            # device) that would keep the loop from answering pings. Sorted by peer: the same order on
            # every replica; None when every micro-batch of the step failed here (nothing to apply)
            means = self._combine(step, contributions)
            # kept for replays on the host, as applied (the update leaves them unchanged: clipping makes
            # new tensors); on the compute thread, which a copy from the device would hold anyway
            kept = None if means is None else [m.to("cpu") for m in means]
            applied = self.worker.apply_step(step, means, samples, hold_epoch)
            if not hold_epoch:  # kept in the same compute job: a resync's next one may re-apply it
                self._keep_means(step, samples, kept)
            return applied, None if local_step else self.worker.param_fingerprint()

        result = await self._on_compute(apply)
        if result is None:
            logger.info("step %d: this replica left the step meanwhile; not applied", step)
            return
        applied, fingerprint = result
        if not hold_epoch:
            self.pending.pop(step, None)
            self.versions.changed()
        c = self.counters
        c.steps += 1
        c.solo_steps += len(contributions) <= 1
        c.last_group_size = len(contributions)
        c.last_exchange_s = time.monotonic() - start_s
        group = {p: n for p, (n, _) in contributions.items()}
        self.ledger.write(
            "step",
            step=step,
            mbs=own_ids if self.peer_id in group else [],
            n=group.get(self.peer_id, 0),
            group=group,
            applied=applied,
            exchange_s=round(c.last_exchange_s, 4),
        )
        if self.on_step is not None and not hold_epoch:
            self.on_step(step + 1, fingerprint, True, group.get(self.peer_id, 0))

    def _combine(self, step: int, contributions: dict) -> list[torch.Tensor] | None:
        means, clipped = robust_mean(_on_one_device(contributions, self.peer_id, self.worker.compute.device))
        if clipped:
            self.counters.clipped_contributions += len(clipped)
            logger.warning("step %d: gradients of %s clipped (far larger than the others')", step, clipped)
        return means

    async def _on_compute(self, fn):
        return await self.compute.run(fn, PRIORITY_SYNC)


class KeptMeans:
    """The mean gradients of the last steps applied here: at least `KEPT_STEP_MEANS` steps, more while
    they fit in `KEPT_MEANS_BYTES`, never more than `MAX_REPLAY_STEPS`."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        # the means have the parameters' shapes and dtypes
        self._step_bytes = max(sum(p.numel() * p.element_size() for p in params), 1)
        self.steps: OrderedDict[int, tuple[int, list[torch.Tensor] | None]] = OrderedDict()

    def keep(self, step: int, samples: int, means: list[torch.Tensor] | None) -> None:
        self.steps[step] = (samples, means)
        keep = max(KEPT_STEP_MEANS, min(MAX_REPLAY_STEPS, KEPT_MEANS_BYTES // self._step_bytes))
        while len(self.steps) > keep:
            self.steps.popitem(last=False)

    def get(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        return self.steps.get(step)


def _encoded(sums_codec: SumsCodec, grad_sums: list[torch.Tensor], for_peers: bool) -> WireSums:
    """On the compute thread: a step's sums as the peers get them, their bytes made here when the step
    names peers (a copy from the device: not on the event loop, which sends them)."""
    sums = sums_codec.encode(grad_sums)
    if for_peers:
        sums.encoded  # noqa: B018 (computed once and kept by WireSums)
    return sums


def _on_one_device(contributions: dict, own_peer: str, compute_device: torch.device) -> dict:
    """The contributions where ours are: the peers' sums arrive decoded on the host; ours stay where they
    were made (the compute device for gradients, the host for a round's pseudo-gradients)."""
    own = contributions.get(own_peer)
    device = own[1][0].device if own and own[1] else compute_device
    return {p: (n, [t.to(device) for t in sums]) for p, (n, sums) in contributions.items()}


def _say_fallback(
    step: int, start: StepDecision, bucket, counters: StepCounters, settings: StepSettings
) -> None:
    """A step decided without a close that passed the checks (`lenient`): counted and said once."""
    # samples of a peer that sent no close: a trainer that died, or an older server's hand-off (it
    # names no trainer: `micro_batch_origin`), whose steps always end here
    origins = {short(p): n for p, n in (bucket.by_origin if bucket else {}).items()}
    members = {short(p): n for p, n in start.members.items()}
    if start.held:  # `apply_held`
        counters.held_steps += 1
        logger.warning(
            "step %d: no trainer's close came for the samples held here (by origin %s) and the other "
            "stages went on; applying them with %s",
            step,
            origins,
            members,
        )
        return
    counters.lenient_steps += 1
    logger.warning(
        "step %d: no close agreed with this replica's samples (by origin %s) or was confirmed by a "
        "member's within %.0f s; acting on %s as before the checks",
        step,
        origins,
        settings.close_timeout_s,
        members,
    )


def _counts(state: PendingStep) -> dict[str, int]:
    return {peer: samples for peer, (samples, _) in state.received.items()}
