"""What a replica has heard of its steps: the closes and gradient sums kept per step, or refused.

Messages come from trainers (`close`) and stage peers (`grads`) over the network, so each is checked
before it is kept (runtime/server/stage_steps.py's docstring has the rules): a close only for this
replica's next step to apply or the one after (`close_window`), from at most `MAX_CLOSES_PER_STEP`
senders per step; gradient sums from live replicas of the stage, or from a few peers the view lacks,
which are pinged at once (`StageMembers.check_unknown`). What is kept is only a candidate: the step
loop (`StepCoordinator`) decides which close, if any, it acts on and whose sums count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch

from swarmtrain.planner.catch_up import KEEP_STEPS_AHEAD, SwarmAhead
from swarmtrain.planner.step_decision import Close, StepDecision, close_refusal, unknown_members
from swarmtrain.runtime.server.stage_members import LiveReplicas, StageMembers, Verify
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

MAX_CLOSES_PER_STEP = 64  # distinct senders of closes kept per step (an honest run has one per trainer)
MAX_HELD_GRADS = 4  # per step: sums kept from peers our view of the stage lacks (pinged meanwhile)
MAX_TRUSTED_SENDERS = 256  # senders of closes found true, the latest kept (an honest run: its trainers)


@dataclass
class PendingStep:
    step: int
    closes: dict[str, Close] = field(default_factory=dict)  # by sender: its latest close of the step
    decision: StepDecision | None = None  # set once the step is closed
    reached_s: float | None = None  # when this replica's step loop reached this step
    held_s: float | None = None  # when the step loop first saw samples of this step held here
    # no trainer's close will come: apply the samples held (planner/held_step.py, `apply_held`)
    held: StepDecision | None = None
    received: dict[str, tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    # peers seen as live replicas of the stage while this step was pending here (when their sums came,
    # or whenever the step loop looked): members of this step's closes even after the view drops them
    # (a member cut off mid-step whose DHT records lapsed)
    known: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


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
    refused_closes: int = 0  # closes not kept: an applied step, too far ahead, or too many senders
    unknown_member_closes: int = 0  # closes naming peers that are not live replicas of the stage
    ignored_grads: int = 0  # gradients from a peer that is no live replica, no member, or a wrong count
    disagreeing_closes: int = 0  # steps decided by a close whose count for this replica was not its own
    lenient_steps: int = 0  # no close passed the checks in time: acted on one as before them
    held_steps: int = 0  # no close came at all, the other stages went on: applied the samples held


class StepInbox:
    def __init__(
        self,
        epoch: Callable[[], int],
        peer_id: str,
        counters: StepCounters,
        live_replicas: LiveReplicas | None = None,
        verify: Verify | None = None,
        close_window: int = 1,
        on_left_behind: Callable[[], None] = lambda: None,
    ) -> None:
        """`epoch`: the next step this replica applies; `live_replicas`: the stage's live replicas from
        the DHT (None: not checked, tests); `verify`: a direct check of a peer the view lacks (None: only
        the view counts); `close_window`: 1 + max_staleness (see `close_refusal`); `on_left_behind()`:
        a close came further past this replica's epoch than any before (requests held here look again,
        planner/catch_up.py's `trails_stage`)."""
        self._epoch, self.peer_id, self.counters = epoch, peer_id, counters
        self.members = StageMembers(live_replicas, verify, on_change=self.wake)
        self.close_window = close_window
        self.on_left_behind = on_left_behind
        self.pending: dict[int, PendingStep] = {}
        # how far the closes say the stage went (planner/catch_up.py: the catch-up reads it)
        self.ahead = SwarmAhead()
        # senders whose closes this replica applied and found true (`vouched_senders`), oldest first:
        # only theirs may decide a step no data confirms (`decide_step`'s `trusted`)
        self.trusted: dict[str, None] = {}

    def on_close(
        self, step: int, shard: int, shard_count: int, members: dict, participants: list, sender: str = ""
    ) -> bool:
        """A trainer's close (fields checked by net/protocol.py's `validate_close`); False if not kept.
        Kept closes are only candidates: the step loop decides which one, if any, it acts on."""
        refusal = close_refusal(step, self._epoch(), self.close_window)
        far, newest = step > self._epoch() + self.close_window, step > self.ahead.newest_step
        self.ahead = self.ahead.heard(step, time.monotonic(), far, sender in self.trusted)
        if far and newest:
            # whoever ran it is a peer to catch up from: one the view lacks is checked now
            named = [peer for peer, n in members.items() if int(n) > 0]
            self.members.check_unknown(unknown_members(named, self.peer_id, self.live()))
            self.on_left_behind()
        state = self.state(step) if refusal is None else None
        if state is not None and sender not in state.closes and len(state.closes) >= MAX_CLOSES_PER_STEP:
            refusal = f"already {len(state.closes)} senders closed step {step}"
        if state is None or refusal is not None:
            self.counters.refused_closes += 1
            # while this replica catches up, every trainer's close of a step ahead is refused: a few a second
            level = logging.DEBUG if step < self._epoch() else logging.WARNING
            log_repeated(logger, level, "close of step %d from %s ignored: %s", step, short(sender), refusal)
            return False
        kept = {peer: int(n) for peer, n in members.items() if int(n) > 0}
        unknown = unknown_members(kept, self.peer_id, self.view_of(state))
        if unknown:
            self.counters.unknown_member_closes += 1
            logger.info(
                "close of step %d from %s names %s, not in this replica's view of the stage: pinging them",
                step,
                short(sender),
                [short(p) for p in unknown[:4]],
            )
            self.members.check_unknown(unknown)
        state.closes[sender] = Close(
            sender, shard, shard_count, kept, frozenset(participants), time.monotonic()
        )
        state.changed.set()
        return True

    def on_grads(self, peer: str, step: int, samples: int, sums: list[torch.Tensor]) -> bool:
        """A stage peer's gradient sums of a step; kept from a live replica of the stage, or (a few per
        step) from a peer our view lacks, which is then pinged (a replica that joined, or our view expired
        while this replica was frozen). They count only if the step's decided close names `peer`, which
        must then be a live replica (or one seen live while the step was pending: `view_of`), with
        exactly `samples`. False if not kept."""
        live, state = self.live(), self.state(step)
        if state is None:
            return False
        if live is not None and peer not in live and peer not in state.received:
            held = sum(1 for p in state.received if p not in live and p not in state.known)
            if held >= MAX_HELD_GRADS:
                self.counters.ignored_grads += 1
                log_repeated(
                    logger,
                    logging.WARNING,
                    "gradients of step %d from %s ignored: not a live replica of this stage",
                    step,
                    short(peer),
                )
                return False
            self.members.check_unknown([peer])
        elif live is not None and peer in live:
            state.known.add(peer)
        state.received[peer] = (samples, sums)
        state.changed.set()
        return True

    def state(self, step: int) -> PendingStep | None:
        """The step's entry; None for an applied step or one so far ahead that this replica will
        resync anyway."""
        if not self._epoch() <= step <= self._epoch() + KEEP_STEPS_AHEAD:
            return None
        return self.pending.setdefault(step, PendingStep(step))

    def closing(self, step: int) -> bool:
        """A trainer's close or a peer's gradients for `step` arrived. The step loop keeps an empty
        entry for the step it waits on, so being in `pending` says nothing (a restored replica held
        back by that entry never adopted the other stages' step after a whole-swarm crash)."""
        state = self.pending.get(step)
        return state is not None and (bool(state.closes) or bool(state.received))

    def has_close(self, step: int) -> bool:
        """A trainer's close of `step` arrived (a peer's gradients alone do not count)."""
        state = self.pending.get(step)
        return state is not None and bool(state.closes)

    def vouch(self, senders: Iterable[str]) -> None:
        """`senders`' closes were found true: trust them, forgetting the longest unheard of beyond
        `MAX_TRUSTED_SENDERS` (a sender gets in only by a close found true)."""
        for sender in senders:
            self.trusted.pop(sender, None)
            self.trusted[sender] = None
        while len(self.trusted) > MAX_TRUSTED_SENDERS:
            del self.trusted[next(iter(self.trusted))]

    def live(self) -> AbstractSet[str] | None:
        """The stage's live replicas as this replica knows them (None: not checked)."""
        return self.members.current()

    def view_of(self, state: PendingStep) -> AbstractSet[str] | None:
        """Who may be a member of `state`'s step: the live replicas, and the peers seen live while the
        step was pending (`PendingStep.known`). A close naming them was a candidate then, so keeping it
        one admits no stranger; a peer never seen live (sums or names from anyone) adds nobody."""
        live = self.live()
        if live is None:
            return None
        state.known |= live
        return frozenset(state.known)

    def wake(self) -> None:
        """Waiting steps look again (the stage's members changed)."""
        for state in self.pending.values():
            state.changed.set()


def short(peer: str) -> str:
    """A peer id as logs show it."""
    return peer[-8:] if peer else "?"
