"""What a replica sends its stage peers during a step's exchange: its gradient sums, in the background,
and the pings that find members whose sums are late because they froze (runtime/server/stage_steps.py's
step loop waits for the other members' sums, never for a send)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet

from swarmtrain.planner.step_decision import StepDecision
from swarmtrain.runtime.server.step_inbox import PendingStep
from swarmtrain.runtime.server.sums_codec import WireSums
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# (peer, step, samples, gradient sums as encoded once for every peer) -> False when the peer is
# unreachable (gone)
GradSender = Callable[[str, int, int, WireSums], Awaitable[bool]]
Alive = Callable[[str], Awaitable[bool]]  # does this peer's event loop answer a ping?


class SumsOut:
    """A replica's gradient sums on their way to its stage peers, in the background (the step waits
    for the other members' sums, never for a send), and the pings that find members whose sums are
    late because they froze (they are then left out)."""

    def __init__(
        self, peer_id: str, send_grads: GradSender, alive: Alive | None, probe_after_s: float
    ) -> None:
        """`alive`: None when late members are waited for until the exchange timeout."""
        self.peer_id, self.send_grads = peer_id, send_grads
        self.alive, self.probe_after_s = alive, probe_after_s
        self._tasks: set[asyncio.Task] = set()

    def send_where_named(
        self, state: PendingStep, due: list[StepDecision], own: int, sums: WireSums, sent: set[str]
    ) -> None:
        """Our sealed sums, with their real count, to the participants of every `due` candidate naming us:
        where the count is what the candidate says they confirm it, elsewhere they tell its members at
        once to leave us out (instead of waiting for the exchange timeout)."""
        if not own:
            return
        peers: set[str] = set()
        for candidate in due:
            if self.peer_id in candidate.members:
                peers |= candidate.participants | set(candidate.members)
        peers -= sent | {self.peer_id}
        if peers:
            sent |= peers
            self.send(state, peers, own, sums)

    async def probe_late(self, state: PendingStep, awaited: Callable[[], AbstractSet[str]]) -> None:
        """Every `probe_after_s`, ping the members whose sums have not come: a silent one is left out."""
        assert self.alive is not None
        while True:
            await asyncio.sleep(self.probe_after_s)
            late = sorted(awaited() - {self.peer_id} - set(state.received) - state.unreachable)
            answers = await asyncio.gather(*(self.alive(peer) for peer in late))
            silent = [peer for peer, ok in zip(late, answers, strict=True) if not ok]
            if silent:
                logger.warning("step %d: %s do not answer a ping; stepping without them", state.step, silent)
                state.unreachable.update(silent)
                state.changed.set()

    def send(self, state: PendingStep, peers: AbstractSet[str], samples: int, sums: WireSums) -> None:
        """Send our sums to `peers` in the background: the step waits for the other members' sums, never
        for a send (a hung participant must not stall the stage)."""
        for peer in sorted(set(peers) - {self.peer_id}):
            task = asyncio.create_task(self.send_grads(peer, state.step, samples, sums))
            self._tasks.add(task)
            task.add_done_callback(lambda t, p=peer: self._sent(state, p, t))

    def _sent(self, state: PendingStep, peer: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug, not a failure of the peer
            logger.error(
                "step %d: sending gradients to %s failed: %r", state.step, peer[-8:], task.exception()
            )
        if task.cancelled() or task.exception() is not None or task.result() is False:
            state.unreachable.add(peer)  # a member we cannot reach will not send us its sums either
            state.changed.set()
