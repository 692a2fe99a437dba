"""Where trainers on a time limit (`--duration-s`) stop: the same step for every shard, so the run's last
step is a whole global batch.

A stage applies step k once every trainer shard has closed it (runtime/server/stage_steps.py). Trainers
that each stopped when their own time was up stopped at different steps (a few apart even when started
together), and every step that only some of them started waited out the close timeout and was applied
short. So a trainer whose time is up proposes its next step as the stop (one DHT record per shard,
written once) and starts nothing more until every shard has proposed; then all train on to the highest
proposal, the same for every shard since each sees the same proposals. A shard that never proposes
(dead, or on a longer limit) is waited for `wait_limit_s`; then the others stop at the highest proposal
they see, and that shard's later steps close short as before. Pure: the trainer does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StopAction(Enum):
    WAIT = "wait"  # start nothing; read the proposals again later
    GO = "go"  # start micro-batches of `step`'s predecessors: the agreed stop is further on
    STOP = "stop"  # the agreed stop is reached


@dataclass(frozen=True)
class StopDecision:
    action: StopAction
    step: int  # the highest proposal seen (the stop, once every shard proposed)


def agreed_stop(
    next_step: int,
    proposed: int,
    others: dict[int, int],
    shard_count: int,
    waited_s: float,
    wait_limit_s: float,
) -> StopDecision:
    """`next_step`: the first step this trainer has not started; `proposed`: its own proposal (its next
    step when its time was up); `others`: shard -> proposal of the other shards (fresh records only);
    `waited_s`: since this trainer's time was up."""
    target = max([proposed, *others.values()])
    if len(others) + 1 < shard_count and waited_s < wait_limit_s:
        return StopDecision(StopAction.WAIT, target)
    return StopDecision(StopAction.GO if next_step < target else StopAction.STOP, target)
