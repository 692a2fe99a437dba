"""A replica's catch-up with its stage: what happens when it falls behind.

The rule is planner/catch_up.py's `decide_catch_up` (replay, resync, adopt or wait); this part gathers
what it reads, asks what it needs, and acts, once per sync tick on the synchronizer's thread
(runtime/server/stage_sync.py):
- the evidence that the stage went on: trainers' closes past the close window, kept by the step inbox
  (`SwarmAhead`, runtime/server/step_inbox.py), which expire; a close of the replica's own step it has
  not applied (`Stuck`); a trainer's request parked for parameters past its epoch for the lag grace
  (`VersionGate.held_since`); the stage's progress records in the DHT; and, when that evidence shows the
  replica left behind, stuck or held back, or before it resyncs for diverged parameters, its stage
  peers' epochs, asked with a ping;
- a replay applies the missed steps from a peer's mean gradients (`StepCoordinator.replay` on the event
  loop, the means asked with `StagePeerLink.step_means`); a resync and an adoption of the other stages'
  step are the synchronizer's (`SyncPort`);
- on the event loop, a training request of a step this replica trails by more than a close can is
  refused at once (`trailing`, planner/catch_up.py's `trails_stage`): the caller tries another replica.

The part reaches the step exchange through one port, `StepsPort` (the event loop's side:
`StepsBridge`; none before the stage serves: `DETACHED`), and the synchronizer through `SyncPort`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from swarmtrain.planner.catch_up import (
    ADOPT,
    ASK,
    KEEP_STEPS_AHEAD,
    READ,
    REPLAY,
    RESYNC,
    CatchUp,
    LagRule,
    LagView,
    Stuck,
    SwarmAhead,
    decide_catch_up,
    trails_stage,
)
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.utils.logging import get_logger, log_repeated
from swarmtrain.utils.silence import PeerSilent

if TYPE_CHECKING:
    import torch

    from swarmtrain.runtime.server.stage_exchange import StagePeerLink
    from swarmtrain.runtime.server.stage_steps import StepCoordinator

logger = get_logger(__name__)

T = TypeVar("T")

# how often the sync thread looks whether the event loop still runs while it waits for an ask or a
# replay there: each ends by itself (every ping and call in it has its own deadline)
LOOP_CHECK_S = 1.0
# steps a replay follows its donor past the epoch the donor answered (it went on meanwhile)
FOLLOW_STEPS = 2 * KEEP_STEPS_AHEAD


class Replay(enum.Enum):
    """How a replay of missed steps from a peer's mean gradients ended."""

    DONE = "done"  # every step applied
    FAILED = "failed"  # the donor refused or broke off: the state is downloaded instead
    DONOR_SILENT = "donor silent"  # the donor stopped answering pings: the next tick decides again
    STOPPED = "stopped"  # the event loop stopped (the service closes): nothing more is done


class LoopStopped(RuntimeError):
    """The event loop stopped while the sync thread waited on it: the service is closing."""


class StepsPort(Protocol):
    """What the catch-up and the synchronizer need of the step exchange, from the sync thread."""

    @property
    def window(self) -> int:
        """The close window: how far past its epoch a replica keeps closes."""
        ...

    def swarm_ahead(self) -> SwarmAhead:
        """What the closes heard so far say of how far the stage went."""
        ...

    def closing(self) -> bool:
        """The step this replica is at has a close or gradients pending (it must not adopt another)."""
        ...

    def has_close(self) -> bool:
        """The step this replica is at has a trainer's close (a peer's gradients alone do not count)."""
        ...

    def apply_held(self, step: int, members: Mapping[str, int]) -> bool:
        """Apply step `step` with the samples held of it and no close (planner/held_step.py), exchanging
        with `members`; False when the step loop could not take it (it moved on, or a close came)."""
        ...

    def stuck(self) -> Stuck | None:
        """The step this replica is at has a vouched trainer's close it has not applied: since when."""
        ...

    def held_since(self) -> float | None:
        """Since when a training request has waited for parameters past this replica's epoch."""
        ...

    def next_held(self) -> int | None:
        """The lowest step past this replica's epoch it holds samples or a close of (None: none)."""
        ...

    def finishing(self) -> bool:
        """The step loop is closing, exchanging or applying the step this replica is at."""
        ...

    def epoch_moved(self) -> None:
        """A download, restore or adoption moved the epoch: requests held for a step, and the step loop,
        look again."""
        ...

    def peer_epochs(self) -> dict[str, int | None] | None:
        """The epoch each stage peer answers a ping with (None: silent); None when asking failed."""
        ...

    def replay(self, peer: str, start: int, end: int) -> Replay:
        """Apply steps start..end-1 from `peer`'s mean gradients."""
        ...

    def means_of(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        """(samples, mean gradients) this replica applied step `step` with; None when not kept. Read on
        the compute thread."""
        ...


class SyncPort(Protocol):
    """What the catch-up asks of the synchronizer (runtime/server/stage_sync.py's StageSynchronizer)."""

    @property
    def fresh_state(self) -> bool:
        """Restored from a checkpoint, or initial weights, with no step applied since."""
        ...

    @property
    def stopping(self) -> bool:
        """The service closes: nothing more is started (a download during the close raced its checkpoint)."""
        ...

    def recorded_peers(self) -> dict[str, dict]: ...  # the stage peers' progress records (a DHT read)

    def diverged_from(self, others: dict[str, dict]) -> frozenset[str]: ...

    def resync(self, reason: str) -> None: ...

    def check_other_stages(
        self,
        epoch: int,
        now_s: float,
        stranded_grace_s: float | None = None,
        abandon_close: bool = False,
        at_least: int = 0,
    ) -> None: ...

    def stop_adopting(self) -> None: ...  # not behind the other stages: their clock starts again

    def publish(self) -> None: ...


class Detached:
    """The port of a synchronizer with no step exchange (joining, tests): no closes, nobody to ask."""

    window = KEEP_STEPS_AHEAD

    def swarm_ahead(self) -> SwarmAhead:
        return SwarmAhead()

    def closing(self) -> bool:
        return False

    def has_close(self) -> bool:
        return False

    def apply_held(self, step: int, members: Mapping[str, int]) -> bool:
        return False

    def stuck(self) -> Stuck | None:
        return None

    def held_since(self) -> float | None:
        return None

    def next_held(self) -> int | None:
        return None

    def finishing(self) -> bool:
        return False

    def epoch_moved(self) -> None:
        pass

    def peer_epochs(self) -> dict[str, int | None] | None:
        return None

    def replay(self, peer: str, start: int, end: int) -> Replay:
        return Replay.FAILED

    def means_of(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        return None


DETACHED = Detached()


class StepsBridge:
    """The step exchange as the sync thread reaches it: the inbox is read where it is, the pings and
    a replay run on the event loop, each bounded there by the deadlines of its calls."""

    def __init__(self, steps: StepCoordinator, link: StagePeerLink, loop: asyncio.AbstractEventLoop) -> None:
        self.steps, self.link, self.loop = steps, link, loop

    @property
    def window(self) -> int:
        return self.steps.inbox.close_window

    def swarm_ahead(self) -> SwarmAhead:
        return self.steps.inbox.ahead

    def closing(self) -> bool:
        return self.steps.inbox.closing(self.steps.worker.epoch)

    def has_close(self) -> bool:
        return self.steps.inbox.has_close(self.steps.worker.epoch)

    def apply_held(self, step: int, members: Mapping[str, int]) -> bool:
        async def apply() -> bool:
            return self.steps.apply_held(step, members)

        try:
            return self._on_loop(apply())
        except LoopStopped:
            return False

    def stuck(self) -> Stuck | None:
        # with local steps (DiLoCo) replicas keep no means to replay and an outer round holds its step
        # open by design: the lag rule's other evidence only
        if self.steps.worker.outer is not None:
            return None
        # read from the sync thread while the loop may add a close: a copy that a change interrupted
        # is taken again at the next tick
        state = self.steps.pending.get(self.steps.worker.epoch)
        try:
            closes = tuple(state.closes.values()) if state is not None else ()
        except RuntimeError:
            return None
        trusted = self.steps.inbox.trusted
        vouched = [c for c in closes if c.sender in trusted]
        if state is None or not vouched:
            return None
        arrived_s = [c.arrived_s for c in vouched]
        since_s = max(min(arrived_s), state.reached_s or float("-inf"))
        members = frozenset(p for c in vouched for p in c.members) - {self.steps.peer_id}
        return Stuck(since_s, max(arrived_s), members)

    def held_since(self) -> float | None:
        # with local steps (DiLoCo) there are no means to replay: as for `stuck`
        if self.steps.worker.outer is not None:
            return None
        return self.steps.versions.held_since(self.steps.worker.epoch + self.window)

    def next_held(self) -> int | None:
        # read from the sync thread while the loop adds buckets and closes: copies of the keys
        epoch = self.steps.worker.epoch
        held = [s for s in list(self.steps.worker.buckets) if s > epoch]
        held += [s for s, state in list(self.steps.pending.items()) if s > epoch and state.closes]
        return min(held, default=None)

    def finishing(self) -> bool:
        # any step, not only the current epoch's: `_finish` holds it until the apply's `on_step` has run,
        # while the epoch moves inside the apply (a tick between them reads a replica that seems to
        # have stepped nowhere: still untrained, the step's samples gone)
        return self.steps.finishing is not None

    def means_of(self, step: int) -> tuple[int, list[torch.Tensor] | None] | None:
        return self.steps.means_of(step)  # kept on the compute thread, where this is read

    def epoch_moved(self) -> None:
        self.steps.versions.changed_threadsafe()
        # the step loop, waiting on the step it left, looks at the new one now, not at its next poll:
        # the step is reached when the epoch moved (netbed chaos, seed 2: a trainer's empty close came
        # 0.16 s after an adoption, before the loop's poll reached the step, so it was taken for a close
        # sent ahead of the step and waited a second close timeout)
        self.loop.call_soon_threadsafe(self.steps.inbox.wake)

    def peer_epochs(self) -> dict[str, int | None] | None:
        if self.link.client is None:
            return None
        try:
            return self._on_loop(self._peer_epochs())
        except Exception as exc:  # the loop is shutting down
            logger.info("asking the stage peers' epochs failed: %r", exc)
            return None

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """`coroutine`'s result, run on the event loop; waited for as long as the loop runs. A fixed bound
        cut an ask whose pings' deadlines (sized by a slow link's exchanges) were longer, and a replay
        in the middle of applying a step; each ends by itself."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        # waited on, not `result(timeout)`: its own TimeoutError (a silent donor) is no reason to wait on
        while not concurrent.futures.wait([future], timeout=LOOP_CHECK_S).done:
            if not self.loop.is_running():
                future.cancel()
                raise LoopStopped("the event loop stopped")
        return future.result()

    async def _peer_epochs(self) -> dict[str, int | None]:
        """Each peer's answer, None for one silent until its own deadline. The ask waits for every
        deadline: with one fixed bound for all, a frozen peer whose deadline was longer (a slow link)
        failed the whole ask and threw the live peers' answers away (netbed chaos, docs/LOG.md), and
        cutting its ping short would count a slow peer as silent."""
        peers = sorted(set(self.steps.inbox.live() or ()) - {self.steps.peer_id})
        answers = await asyncio.gather(*(self.link.epoch_of(p) for p in peers), return_exceptions=True)
        epochs: dict[str, int | None] = {}
        for peer, answer in zip(peers, answers, strict=True):
            if isinstance(answer, BaseException):
                log_repeated(logger, logging.WARNING, "asking %s its epoch failed: %r", peer[-8:], answer)
                answer = None
            epochs[peer] = answer
        return epochs

    def replay(self, peer: str, start: int, end: int) -> Replay:
        if self.link.client is None:
            return Replay.FAILED
        try:
            return self._on_loop(self._replay_from(peer, start, end))
        except LoopStopped:
            return Replay.STOPPED  # no download for a service that closes
        except Exception as exc:  # unreachable donor, a step it no longer keeps, a malformed answer
            logger.info("replaying steps %d-%d from %s failed: %r", start, end - 1, peer[-8:], exc)
            return Replay.DONOR_SILENT if isinstance(exc, PeerSilent) else Replay.FAILED

    async def _replay_from(self, peer: str, start: int, end: int) -> Replay:
        for step in range(start, end):
            if not await self._replay_step(peer, step):
                return Replay.FAILED
        await self._follow(peer, end)
        return Replay.DONE

    async def _replay_step(self, peer: str, step: int) -> bool:
        if self.steps.worker.epoch != step or self.steps.finishing == step:
            return False  # the step loop applied it, or applies it: no means to fetch for nothing
        samples, means = await self.link.step_means(peer, step)
        return await self.steps.replay(step, samples, means)

    async def _follow(self, peer: str, step: int) -> None:
        """After a replay up to `step`, the steps the donor applied meanwhile too, up to FOLLOW_STEPS:
        a replica that stopped where the donor was when asked trails it by the steps the trainers ran
        during the replay and holds their requests of the next step, which the donor alone can bring
        it to (netbed chaos, seed 2: a joiner replayed to 825 while its peer reached 829, the peer was
        cut off 2 s later, and the trainers waited 30 s). Anything that stops it stops only the
        following: the steps asked for are applied."""
        last = step + FOLLOW_STEPS
        try:
            while step < last:
                donor_epoch = await self.link.epoch_of(peer)
                if donor_epoch is None or donor_epoch <= step:
                    return
                while step < min(donor_epoch, last):
                    if not await self._replay_step(peer, step):
                        return
                    step += 1
        except Exception as exc:  # the donor went silent or broke off: the steps asked for are applied
            logger.info("following %s past step %d stopped: %r", peer[-8:], step, exc)


class StageCatchUp:
    """A replica's catch-up: the lag clock and the last epoch seen, one decision per tick."""

    def __init__(self, worker: StageWorker, steps: StepsPort, rule: LagRule) -> None:
        self.worker, self.steps, self.rule = worker, steps, rule
        self.stage = worker.spec.index
        self._behind_since_s: float | None = None  # since when the records have shown a peer ahead
        # the epoch the last read of the records saw, and since when: how long it has gone without a step
        self._seen_epoch: tuple[int, float] = (-1, time.monotonic())
        # the donor that went silent during a replay at this epoch, and whether it answered an ask since
        self._silent_donor: tuple[str, int, bool] | None = None
        self._ask_first = False  # the tick after a silent replay asks the peers before deciding

    def tick(self, sync: SyncPort) -> None:
        """(sync thread) Decide, asking the peers or reading the records when the rule needs them, and act."""
        view = self._view(self.steps.swarm_ahead(), self.steps.stuck(), held_since_s=self.steps.held_since())
        view = self._asked_after_a_silent_replay(view)
        decision = decide_catch_up(view, self.rule)
        while decision.action in (ASK, READ):
            view = self._asked(view) if decision.action == ASK else self._read(view, sync)
            decision = decide_catch_up(view, self.rule)
        self._behind_since_s = decision.behind_since_s
        if view.asked is not None or view.ask_failed:
            self._log_asked(view, decision)
        self._act(decision, view, sync)

    def _log_asked(self, view: LagView, decision: CatchUp) -> None:
        """One line (repeats counted) for each tick that asked the stage peers: what it had to go on, what
        they answered, and what it decided; the chaos bench's stalls are read from these."""
        evidence = [
            name
            for name, shown in (
                ("stuck", view.stuck is not None),
                ("held", view.held_since_s is not None),
                ("diverged", bool(view.diverged)),
                ("no records", view.recorded is not None and not view.recorded),
                ("a donor went silent", self._silent_donor is not None),
            )
            if shown
        ]
        answers = "asking failed" if view.ask_failed else {p[-8:]: e for p, e in (view.asked or {}).items()}
        log_repeated(
            logger,
            logging.INFO,
            "stage %d at step %d (%s): stage peers answer %s; %s%s",
            self.stage,
            view.epoch,
            ", ".join(evidence) or "a close ahead",
            answers,
            decision.action,
            " (giving its close up)" if decision.abandon_close else "",
            key=("catch-up asked", view.epoch, decision.action),
        )

    def trailing(self, step: int) -> str | None:
        """(event loop) Why a training request of `step` is refused at once: this replica trails its
        stage (`trails_stage`); None when it may hold it."""
        newest, epoch = self.steps.swarm_ahead().newest_step, self.worker.epoch
        if not trails_stage(step, epoch, newest, self.steps.window):
            return None
        return (
            f"this replica is at step {epoch}, behind its stage (step {newest} was closed): "
            f"catching up, step {step} cannot run here yet; try another"
        )

    def _view(self, ahead: SwarmAhead, stuck: Stuck | None, **known) -> LagView:
        """The view at this moment; `ahead` and `stuck` are the evidence this tick goes on (read once at
        its start: a tick whose ask failed must not ask again)."""
        return LagView(
            self.worker.epoch,
            self.worker.unapplied_samples,
            time.monotonic(),
            ahead,
            behind_since_s=self._behind_since_s,
            stuck=stuck,
            next_held=self.steps.next_held(),
            **known,
        )

    def _refreshed(self, view: LagView, **changes) -> LagView:
        """`view` at this moment (epoch, own samples, clock), with what this tick read and asked kept."""
        return dataclasses.replace(
            view,
            epoch=self.worker.epoch,
            own_samples=self.worker.unapplied_samples,
            now_s=time.monotonic(),
            **changes,
        )

    def _asked(self, view: LagView) -> LagView:
        asked = self.steps.peer_epochs()
        # asking failed: this tick acts on nothing that needed the answers
        fresh = self._refreshed(view, asked=asked, ask_failed=asked is None)
        if fresh.epoch == view.epoch:
            return fresh  # records read before the ask (before a resync for diverged parameters) still hold
        # the step loop moved on meanwhile: the evidence and the records were of the step it left
        return self._view(view.ahead, None, asked=asked, ask_failed=asked is None)

    def _read(self, view: LagView, sync: SyncPort) -> LagView:
        others = sync.recorded_peers()
        now_s = time.monotonic()
        if self.worker.epoch != self._seen_epoch[0]:
            self._seen_epoch = (self.worker.epoch, now_s)
        return self._refreshed(
            view,
            recorded={peer: value["epoch"] for peer, value in others.items()},
            diverged=sync.diverged_from(others),
            fresh_state=sync.fresh_state,
            epoch_since_s=self._seen_epoch[1],
        )

    def _replayed(self, donor: str, start: int, end: int) -> Replay:
        """`StepsPort.replay`; a donor silent during a replay again, at the same epoch, although it
        answered the ask in between, counts as failed: its pings queue behind its reply (a slow link), and
        the state is downloaded instead of trying it every tick."""
        replay = self.steps.replay(donor, start, end)
        again = self._silent_donor == (donor, start, True)
        self._silent_donor = (donor, start, False) if replay is Replay.DONOR_SILENT else None
        self._ask_first = replay is Replay.DONOR_SILENT
        if replay is Replay.DONOR_SILENT and again:
            self._silent_donor, self._ask_first = None, False
            return Replay.FAILED
        return replay

    def _asked_after_a_silent_replay(self, view: LagView) -> LagView:
        """The tick after a replay whose donor went silent asks first: the rule then counts the donor out
        while it is silent (planner/catch_up.py), and a donor that answers is marked as having answered
        (`_replayed`). A replica that moved on since forgets the donor."""
        if self._silent_donor is not None and self._silent_donor[1] != view.epoch:
            self._silent_donor, self._ask_first = None, False
        if not self._ask_first or self._silent_donor is None:
            return view
        self._ask_first = False
        view = self._asked(view)
        donor, epoch, _ = self._silent_donor
        if (view.asked or {}).get(donor) is not None:
            self._silent_donor = (donor, epoch, True)
        return view

    def _act(self, decision: CatchUp, view: LagView, sync: SyncPort) -> None:
        if sync.stopping:
            return
        if decision.action == REPLAY:
            replay = self._replayed(decision.donor, view.epoch, decision.end)
            if replay is Replay.DONE:
                logger.info(
                    "stage %d: replayed steps %d-%d from %s",
                    self.stage,
                    view.epoch,
                    self.worker.epoch - 1,
                    decision.donor[-8:],
                )
                sync.publish()
                return
            if self.worker.epoch != view.epoch:
                sync.publish()  # some of the steps came before it stopped
            # no download: from a donor that froze (no donor for one either: the next tick asks the peers
            # again and replays from another, or adopts the step), for a service that closes, or for a
            # step the step loop applied or is applying
            moved = self.worker.epoch != view.epoch or self.steps.finishing()
            if replay in (Replay.DONOR_SILENT, Replay.STOPPED) or moved:
                return
            sync.resync(decision.reason)
        elif decision.action == RESYNC:
            if self.worker.epoch == view.epoch:  # else the step loop overtook the view: decide anew
                sync.resync(decision.reason)
        elif decision.action == ADOPT:
            sync.check_other_stages(
                view.epoch, view.now_s, decision.grace_s, decision.abandon_close, decision.end
            )
        else:
            sync.stop_adopting()
