"""A replica's clock for a step nobody closes (planner/held_step.py's rule): the synchronizer
(runtime/server/stage_sync.py), finding the other stages past a step this replica is held at by samples of
its own, asks this clock each sync tick; once the samples have sat unchanged, with no trainer's close, and
the other stages have been ahead, for a close timeout, it has the step loop apply them with the stage peers
that hold samples of the same step (`StepsPort.apply_held`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from swarmtrain.planner.held_step import applies_held_step, held_step_members
from swarmtrain.runtime.server.stage_worker import StageWorker

if TYPE_CHECKING:
    from swarmtrain.runtime.server.stage_catch_up import StepsPort


class HeldStepClock:
    def __init__(self, worker: StageWorker, steps: StepsPort, peer_id: str, close_timeout_s: float) -> None:
        self.worker, self.steps, self.peer_id, self.close_timeout_s = worker, steps, peer_id, close_timeout_s
        self._seen: tuple[int, int, float] | None = None  # (epoch, samples held of it, since when)

    def check(
        self,
        epoch: int,
        other_stage_epoch: int,
        behind_s: float,
        now_s: float,
        stage_records: Callable[[], Mapping[str, Mapping]],
    ) -> bool:
        """Whether the step loop took the held step `epoch` to apply; `stage_records` reads the stage
        peers' progress records (a DHT read: only once it is due)."""
        bucket = self.worker.buckets.get(epoch)
        held = bucket.samples if bucket is not None else 0
        if self._seen is None or self._seen[:2] != (epoch, held):
            self._seen = (epoch, held, now_s)  # the samples changed: the step was still under way here
        due = applies_held_step(
            epoch,
            other_stage_epoch,
            held,
            self.steps.has_close(),
            self.steps.finishing(),
            behind_s,
            now_s - self._seen[2],
            self.close_timeout_s,
        )
        if not due:
            return False
        if not self.steps.apply_held(epoch, held_step_members(self.peer_id, held, epoch, stage_records())):
            return False
        self._seen = None
        return True
