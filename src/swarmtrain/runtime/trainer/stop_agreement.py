"""Where a trainer stops on a time limit: at a step boundary, and with several shards at the same step.

`--duration-s` ends a trainer only between steps (every step is a whole global batch). With several
trainer shards each contributing part of every step, they must also stop at the same step: a step
missing one shard's micro-batches waits at the stages for the close timeout and is applied short.
So the first shard whose time is up proposes its next step in the DHT (`RunRecords.publish_stop`),
the others propose theirs as soon as they see it (`watch`), and all stop at the highest proposal once
every shard has proposed, or after a stage's close timeout without them (planner/stop_step.py decides).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from swarmtrain.net.dht_records import RunRecords
from swarmtrain.planner.stop_step import StopAction, StopDecision, agreed_stop
from swarmtrain.runtime.trainer.step_tracker import StepTracker
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

STOP_POLL_S = 0.5  # how often a trainer at its time limit reads the other shards' stop proposals
STOP_RECORD_FRESH_S = 60.0  # older stop proposals belong to an earlier launch of the run


@dataclass
class _Proposal:
    first_s: float  # when this trainer's time was up (time.monotonic())
    proposed: int  # our proposal: our next step then
    polled_s: float = float("-inf")
    others: dict[int, int] = field(default_factory=dict)  # shard -> its proposal
    announced: int | None = None  # the stop we logged


class StopAgreement:
    def __init__(
        self,
        records: RunRecords,
        tracker: StepTracker,
        shard_index: int,
        shard_count: int,
        duration_s: float | None,
        wait_s: float,
    ) -> None:
        """`duration_s`: this trainer's time limit (None: none); `wait_s`: how long a shard at its stop
        waits for the others to propose (as long as a stage waits for a step's missing closes)."""
        self.records, self.tracker = records, tracker
        self.shard_index, self.shard_count = shard_index, shard_count
        self.duration_s, self.wait_s = duration_s, wait_s
        self._proposal: _Proposal | None = None  # once our time is up

    def time_is_up(self, start_s: float) -> bool:
        """Our time limit is up, or another shard's was (then ours is taken as up: the run stops when the
        first shard's time is up, `watch`)."""
        limit_s = self.duration_s
        return self._proposal is not None or (limit_s is not None and time.monotonic() - start_s >= limit_s)

    async def decide(self) -> StopDecision:
        """Propose our stop step once, and read the other shards' proposals (at most every STOP_POLL_S)
        until every shard has proposed."""
        state = await self._propose()
        now_s = time.monotonic()
        if len(state.others) + 1 < self.shard_count and now_s - state.polled_s >= STOP_POLL_S:
            state.others, state.polled_s = await self._read_others(), now_s
        decision = agreed_stop(
            self.tracker.next_step,
            state.proposed,
            state.others,
            self.shard_count,
            now_s - state.first_s,
            self.wait_s,
        )
        if decision.action is not StopAction.WAIT and decision.step != state.announced:
            state.announced = decision.step
            logger.info(
                "stopping at step %d (proposals of the other shards: %s)", decision.step, state.others
            )
        return decision

    async def watch(self) -> None:
        """Another shard's time is up: propose ours now. Its step cannot be applied without our
        micro-batches, so ours would wait for it (in-flight slots held by requests parked at the servers)
        and only propose after the close timeout had applied that step short."""
        if self._proposal is not None:
            return
        others = await self._read_others()
        if others:
            state = await self._propose()
            state.others = others

    async def _propose(self) -> _Proposal:
        """Once: our stop is the first step we have not started (the one after, mid-step)."""
        if self._proposal is not None:
            return self._proposal
        tracker = self.tracker
        state = self._proposal = _Proposal(time.monotonic(), tracker.next_step + tracker.step_in_progress)
        if self.shard_count > 1:
            args = (self.shard_index, self.shard_count, state.proposed, STOP_RECORD_FRESH_S)
            await asyncio.get_running_loop().run_in_executor(None, self.records.publish_stop, *args)
            logger.info(
                "time is up at step %d; agreeing on the last step with the other shards", state.proposed
            )
        return state

    async def _read_others(self) -> dict[int, int]:
        since = time.time() - STOP_RECORD_FRESH_S
        found = await asyncio.get_running_loop().run_in_executor(
            None, self.records.stops, self.shard_count, since
        )
        return {shard: step for shard, step in found.items() if shard != self.shard_index}
