"""The trainer's side of a global step: which step each micro-batch belongs to, and when a step is
over at each stage.

A trainer with shard i of N contributes `global_batch_size / N` samples to every step, as
`micro_batches_per_step` consecutive micro-batches. The tracker counts, per step and stage, the
micro-batches that have finished that stage's backward (or will never reach it: they failed
earlier) and which replica accumulated how many samples. When all of a step's micro-batches are
finished at a stage, it calls `close(step, stage, members)`: the stage's replicas then exchange
and apply exactly those gradients (runtime/server/stage_steps.py). Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CloseFn = Callable[[int, int, dict[str, int]], None]


@dataclass
class _Step:
    expected: int
    started: int = 0
    finished: list[int] = field(default_factory=list)  # per stage
    members: list[dict[str, int]] = field(default_factory=list)  # per stage: peer -> samples
    closed: list[bool] = field(default_factory=list)


class StepTracker:
    def __init__(self, num_stages: int, micro_batches_per_step: int, start_step: int, close: CloseFn) -> None:
        if micro_batches_per_step <= 0:
            raise ValueError("a step needs at least one micro-batch")
        self.num_stages = num_stages
        self.micro_batches_per_step = micro_batches_per_step
        self.close = close
        self.steps: dict[int, _Step] = {}
        self.next_step = start_step  # the step the next micro-batch joins
        self.closed_steps = 0  # steps closed at every stage

    def begin(self) -> int:
        """Register a new micro-batch; returns its step."""
        step = self.next_step
        state = self.steps.get(step)
        if state is None:
            state = self.steps[step] = _Step(
                self.micro_batches_per_step,
                finished=[0] * self.num_stages,
                members=[{} for _ in range(self.num_stages)],
                closed=[False] * self.num_stages,
            )
        state.started += 1
        if state.started == state.expected:
            self.next_step += 1
        return step

    @property
    def step_in_progress(self) -> bool:
        """Some micro-batches of `next_step` are started but not all."""
        state = self.steps.get(self.next_step)
        return state is not None and 0 < state.started < state.expected

    def truncate(self) -> None:
        """No more micro-batches for the step being filled (the trainer stops): close it short."""
        state = self.steps.get(self.next_step)
        if state is not None and state.started < state.expected:
            state.expected = state.started
            self.next_step += 1
            for stage in range(self.num_stages):
                self._maybe_close(self.next_step - 1, stage)

    def finished(self, step: int, stage: int, peer: str | None = None, samples: int = 0) -> None:
        """A micro-batch of `step` is done with `stage`: accumulated `samples` on `peer`, or none."""
        state = self.steps[step]
        state.finished[stage] += 1
        if peer is not None and samples > 0:
            state.members[stage][peer] = state.members[stage].get(peer, 0) + samples
        self._maybe_close(step, stage)

    def _maybe_close(self, step: int, stage: int) -> None:
        state = self.steps[step]
        if state.closed[stage] or state.started < state.expected or state.finished[stage] < state.expected:
            return
        state.closed[stage] = True
        self.close(step, stage, dict(state.members[stage]))
        if all(state.closed):
            del self.steps[step]
            self.closed_steps += 1
