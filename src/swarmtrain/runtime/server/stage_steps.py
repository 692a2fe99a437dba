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
runtime/server/stage_sync.py then resyncs the one with the larger id. A member that is frozen (SIGSTOP, a
partition: nothing answers, no connection error) is not waited for that long: once its sums are
`probe_after_s` late, a ping its event loop would answer at once (`alive`) tells it from a slow one, and
a silent member is left out like an unreachable one.

Why not hivemind's `DecentralizedAverager` for this: its matchmaking took 0.2-1.2 s per round on
this machine (DHT-based group formation with a minimum matchmaking time), several times longer
than a global batch of `tiny` takes, so rounds merged several global batches into one step. The
replicas of a stage are few and known here (trainers name them), so a direct exchange takes one
RPC (~10 ms on loopback). hivemind's averager is still what serves and downloads the stage state.

Everything here runs on the server's asyncio loop; tensor work goes to the compute thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from swarmtrain.net.robust import robust_mean
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.server.compute import PRIORITY_SYNC, ComputeWorker
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# (peer, step, samples, gradient sums) -> False when the peer is unreachable (gone)
GradSender = Callable[[str, int, int, list[torch.Tensor]], Awaitable[bool]]
OnStep = Callable[[int, list[float] | None], None]  # (epoch, parameter fingerprint or None)
Alive = Callable[[str], Awaitable[bool]]  # does this peer's event loop answer a ping?
KEEP_STEPS_AHEAD = 4  # closes/grads this far ahead are kept; a replica further behind resyncs
# The mean gradients of recent steps are kept for replicas that missed them (`replay`): at least
# `KEPT_STEP_MEANS` steps, more while they fit in `KEPT_MEANS_BYTES`. Three were too few for a moved
# server: its state download took long enough that `tiny` stepped 4-7 times meanwhile, so it downloaded
# the whole state again, fell behind again and served little for 10-20 s (bench/rebalance_live.py). A
# big stage steps slowly, so its three steps cover a download's duration too.
KEPT_STEP_MEANS = 3
KEPT_MEANS_BYTES = 64 * 2**20
MAX_REPLAY_STEPS = 64  # a replica further behind downloads the state instead


@dataclass
class StepSettings:
    close_timeout_s: float = 10.0
    exchange_timeout_s: float = 30.0
    poll_s: float = 0.5  # how often a waiting step re-checks for a resync that moved the epoch
    # a member's sums this late: ping it (a frozen member is left out instead of waited for); an honest
    # exchange takes ~10 ms on a LAN and a few seconds for a big stage over a slow link, but a slow
    # member still answers a ping, so this only decides how soon a frozen one is noticed
    probe_after_s: float = 1.0


@dataclass
class PendingStep:
    step: int
    shard_count: int = 1
    shards: set[int] = field(default_factory=set)
    members: dict[str, int] = field(default_factory=dict)  # peer -> samples trainers saw it accumulate
    participants: set[str] = field(default_factory=set)
    first_close_s: float | None = None
    received: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def closed(self, now_s: float, close_timeout_s: float) -> bool:
        if self.first_close_s is None:
            return False
        return len(self.shards) >= self.shard_count or now_s - self.first_close_s >= close_timeout_s


@dataclass
class StepCounters:
    steps: int = 0
    partial_exchanges: int = 0  # a member's sums never came
    solo_steps: int = 0  # no other member: nothing to exchange
    timed_out_closes: int = 0  # fewer closes than trainers
    unconfirmed_samples: int = 0  # accumulated here, but no trainer listed this replica
    last_group_size: int = 0
    last_exchange_s: float = 0.0
    clipped_contributions: int = 0  # a replica's sums far above the others' (net/robust.py)
    replayed_steps: int = 0  # steps this replica missed and applied from a peer's mean gradients


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
    ) -> None:
        self.worker, self.compute, self.peer_id = worker, compute, peer_id
        self.send_grads, self.settings = send_grads, settings
        self.ledger = ledger or Ledger(None)
        self.on_step = on_step  # after every step (applied or skipped) with the new parameters' fingerprint
        self.alive = alive  # None: late members are waited for until exchange_timeout_s
        self.counters = StepCounters()
        self.pending: dict[int, PendingStep] = {}
        # the mean gradients of the last steps applied here, for replicas that missed them (`replay`)
        self.recent_means: OrderedDict[int, tuple[int, list[torch.Tensor] | None]] = OrderedDict()
        self._replaying = False
        self._version_changed = asyncio.Event()
        self._sending: set[asyncio.Task] = set()
        # the loop this coordinator runs on: a server makes it before serving, tests run in one
        self._loop = loop or asyncio.get_running_loop()

    # messages -----------------------------------------------------------------------------------
    def on_close(self, step: int, shard: int, shard_count: int, members: dict, participants: list) -> None:
        state = self._pending(step)
        if state is None:
            return
        state.shard_count = max(state.shard_count, shard_count)
        state.shards.add(shard)
        for peer, samples in members.items():
            state.members[peer] = state.members.get(peer, 0) + int(samples)
        state.participants.update(participants)
        if state.first_close_s is None:
            state.first_close_s = time.monotonic()
        state.changed.set()

    def on_grads(self, peer: str, step: int, samples: int, sums: list[torch.Tensor]) -> None:
        state = self._pending(step)
        if state is not None:
            state.received[peer] = (samples, sums)
            state.changed.set()

    def _pending(self, step: int) -> PendingStep | None:
        if not self.worker.epoch <= step <= self.worker.epoch + KEEP_STEPS_AHEAD:
            return None  # already applied, or so far ahead that this replica will resync anyway
        return self.pending.setdefault(step, PendingStep(step))

    def closing(self, step: int) -> bool:
        """A trainer's close or a peer's gradients for `step` arrived. The step loop keeps an empty
        entry for the step it waits on, so being in `pending` says nothing (a restored replica held
        back by that entry never adopted the other stages' step after a whole-swarm crash)."""
        state = self.pending.get(step)
        return state is not None and (state.first_close_s is not None or bool(state.received))

    # waiting for a parameter version ------------------------------------------------------------
    async def wait_for_version(self, version: int, deadline_s: float, abandon=lambda: False) -> bool:
        """Until the parameters have reached `version` (a step's forwards wait for the previous
        step); False at the deadline (a time.monotonic() value), or once `abandon()` is true when the
        version changes (call `version_changed` to make waiters check it)."""
        while self.worker.epoch < version:
            if abandon():
                return False
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                return False
            try:
                await asyncio.wait_for(self._version_changed.wait(), remaining_s)
            except TimeoutError:
                return False
        return True

    def version_changed(self) -> None:
        event, self._version_changed = self._version_changed, asyncio.Event()
        event.set()

    def version_changed_threadsafe(self) -> None:
        """After a resync (on another thread) moved the epoch."""
        self._loop.call_soon_threadsafe(self.version_changed)

    # the step loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            step = self.worker.epoch
            try:
                if await self._wait(step, self._is_closed):
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

    def _is_closed(self, state: PendingStep) -> bool:
        return not self._replaying and state.closed(time.monotonic(), self.settings.close_timeout_s)

    # steps missed: replayed from a peer's means ---------------------------------------------------
    def means_of(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        """(samples, mean gradients) of a recent step applied here; None when not kept."""
        return self.recent_means.get(step)

    def _keep_means(self, step: int, samples: int, means: list[torch.Tensor] | None) -> None:
        if self.worker.outer is not None:
            return  # local steps: every replica stepped on its own gradient, there is no shared mean
        self.recent_means[step] = (samples, means)
        # the means have the parameters' shapes and dtypes
        step_bytes = sum(p.numel() * p.element_size() for p in self.worker.params)
        keep = max(KEPT_STEP_MEANS, min(MAX_REPLAY_STEPS, KEPT_MEANS_BYTES // max(step_bytes, 1)))
        while len(self.recent_means) > keep:
            self.recent_means.popitem(last=False)

    async def replay(self, step: int, samples: int, means: list[torch.Tensor] | None) -> bool:
        """Apply step `step` as its participants did, from one participant's mean gradients: a replica
        that was no participant (it joined or resynced while the step was closed) catches up with the
        same optimizer math on the same state instead of downloading the whole state again, which took
        longer than a step at a CPU quota and never caught up (bench/rebalance_live.py). False when
        this replica is not at `step` or holds samples of its own (a resync handles those)."""
        if self.worker.epoch != step or self.worker.unapplied_samples or self._replaying:
            return False
        self._replaying = True
        try:
            kept = None if means is None else [m.clone() for m in means]  # clipping scales in place

            def apply() -> tuple[bool, list[float]]:
                return self.worker.apply_step(step, means, samples), self.worker.param_fingerprint()

            applied, fingerprint = await self._on_compute(apply)
        finally:
            self._replaying = False
        self._keep_means(step, samples, kept)
        self.pending.pop(step, None)
        self.version_changed()
        self.counters.replayed_steps += 1
        self.ledger.write("replay", step=step, n=samples, applied=applied)
        if self.on_step is not None:
            self.on_step(step + 1, fingerprint)
        return True

    async def _finish(self, step: int) -> None:
        state, start_s = self.pending[step], time.monotonic()
        if len(state.shards) < state.shard_count:
            self.counters.timed_out_closes += 1
            logger.warning("step %d: %d of %d trainers closed it", step, len(state.shards), state.shard_count)
        bucket = await self._on_compute(lambda: self.worker.seal(step))
        if self.worker.outer is not None:
            await self._finish_local(state, bucket, start_s)
            return
        listed = {p for p, n in state.members.items() if n > 0}
        if bucket.samples and self.peer_id in listed:
            await self._send(state, bucket.samples, bucket.grad_sums)
        elif bucket.samples:  # no trainer saw us accumulate these: the others cannot count them
            self.counters.unconfirmed_samples += bucket.samples
            self.ledger.write("lost", mbs=bucket.micro_batch_ids, n=bucket.samples, reason="unconfirmed")
        others = listed - {self.peer_id}
        complete = await self._wait_for_sums(state, others)
        if self.worker.epoch != step:
            return  # a resync moved us on meanwhile
        contributions = {p: state.received[p] for p in others if p in state.received}
        if self.peer_id in listed and bucket.samples:
            contributions[self.peer_id] = (bucket.samples, bucket.grad_sums)
        # fp32 addition is not associative: every replica must add the same sums in the same order
        # (with our own sums appended last, 3 replicas drifted apart by rounding, ~1e-9 per run)
        contributions = dict(sorted(contributions.items()))
        if not complete or len(contributions) < len(listed):
            self.counters.partial_exchanges += 1
            missing = sorted(listed - set(contributions))
            logger.warning("step %d: no gradients from %s; stepping without them", step, missing)
        await self._apply(step, contributions, bucket.micro_batch_ids, start_s)

    async def _finish_local(self, state: PendingStep, bucket, start_s: float) -> None:
        """swarm.local_steps > 1: step on this replica's own gradient; at every H-th step, average the
        pseudo-gradients (weighted by samples since the last round) with the step's participants in
        peer order and take the outer step, so all end the round with the same parameters."""
        step = state.step
        own = {self.peer_id: (bucket.samples, bucket.grad_sums)} if bucket.samples else {}
        sync = self.worker.is_sync_step(step)
        await self._apply(step, own, bucket.micro_batch_ids, start_s, hold_epoch=sync)
        if not sync or self.worker.epoch != step:
            return
        samples, delta = await self._on_compute(self.worker.pseudo_gradient)
        await self._send(state, samples, delta)
        others = (state.participants | set(state.members)) - {self.peer_id}
        complete = await self._wait_for_sums(state, others)
        if self.worker.epoch != step:
            return  # a resync moved us on meanwhile
        contributions = {p: state.received[p] for p in sorted(others) if p in state.received}
        contributions[self.peer_id] = (samples, delta)
        contributions = {p: c for p, c in sorted(contributions.items()) if c[0] > 0}
        if not complete:
            self.counters.partial_exchanges += 1
            logger.warning("step %d: outer round without %s", step, sorted(others - set(state.received)))
        # pseudo-gradients are per-sample means: weight them back into sums first
        sums = {p: (n, [t * n for t in delta]) for p, (n, delta) in contributions.items()}
        mean = self._combine(step, sums) if len(contributions) > 1 else None

        def finish() -> list[float]:
            self.worker.finish_sync(step, mean)
            return self.worker.param_fingerprint()

        fingerprint = await self._on_compute(finish)
        self.pending.pop(step, None)
        self.version_changed()
        self.counters.last_group_size = len(contributions)
        self.ledger.write("sync", step=step, group={p: n for p, (n, _) in contributions.items()})
        if self.on_step is not None:
            self.on_step(step + 1, fingerprint)

    async def _wait_for_sums(self, state: PendingStep, others: set[str]) -> bool:
        """Until every one of `others` sent its sums or is left out (unreachable, or silent when pinged);
        False if the epoch moved or `exchange_timeout_s` passed."""
        prober = asyncio.create_task(self._probe_late(state, others)) if self.alive is not None else None
        try:
            return await self._wait(
                state.step,
                lambda s: others <= set(s.received) | s.unreachable,
                self.settings.exchange_timeout_s,
            )
        finally:
            if prober is not None:
                prober.cancel()

    async def _probe_late(self, state: PendingStep, others: set[str]) -> None:
        """Every `probe_after_s`, ping the members whose sums have not come: a silent one is left out."""
        assert self.alive is not None
        while True:
            await asyncio.sleep(self.settings.probe_after_s)
            late = sorted(others - set(state.received) - state.unreachable)
            answers = await asyncio.gather(*(self.alive(peer) for peer in late))
            silent = [peer for peer, ok in zip(late, answers, strict=True) if not ok]
            if silent:
                logger.warning("step %d: %s do not answer a ping; stepping without them", state.step, silent)
                state.unreachable.update(silent)
                state.changed.set()

    async def _send(self, state: PendingStep, samples: int, sums: list[torch.Tensor]) -> None:
        """Send our sums to every other participant in the background: the step waits for the other
        members' sums, never for a send (a hung participant must not stall the stage)."""
        for peer in sorted((state.participants | set(state.members)) - {self.peer_id}):
            task = asyncio.create_task(self.send_grads(peer, state.step, samples, sums))
            self._sending.add(task)
            task.add_done_callback(lambda t, p=peer: self._sent(state, p, t))

    def _sent(self, state: PendingStep, peer: str, task: asyncio.Task) -> None:
        self._sending.discard(task)
        if task.cancelled() or task.exception() is not None or task.result() is False:
            state.unreachable.add(peer)  # a member we cannot reach will not send us its sums either
            state.changed.set()

    async def _apply(
        self, step: int, contributions: dict, own_ids: list[str], start_s: float, hold_epoch: bool = False
    ) -> None:
        samples = sum(n for n, _ in contributions.values())
        # sorted by peer: the same order on every replica; None when every micro-batch of the step
        # failed here (nothing to apply)
        means = self._combine(step, contributions)

        # between outer rounds (local steps) replicas legitimately differ: no fingerprint to compare
        local_step = self.worker.outer is not None

        def apply() -> tuple[bool, list[float] | None]:
            applied = self.worker.apply_step(step, means, samples, hold_epoch)
            return applied, None if local_step else self.worker.param_fingerprint()

        kept = None if means is None else [m.clone() for m in means]  # clipping scales in place
        applied, fingerprint = await self._on_compute(apply)
        if not hold_epoch:
            self._keep_means(step, samples, kept)
        if not hold_epoch:
            self.pending.pop(step, None)
            self.version_changed()
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
            self.on_step(step + 1, fingerprint)

    def _combine(self, step: int, contributions: dict) -> list[torch.Tensor] | None:
        means, clipped = robust_mean(contributions)
        if clipped:
            self.counters.clipped_contributions += len(clipped)
            logger.warning("step %d: gradients of %s clipped (far larger than the others')", step, clipped)
        return means

    async def _on_compute(self, fn):
        return await self.compute.run(fn, PRIORITY_SYNC)
