"""When a simulated stage steps: its gradient all-reduce, and (synchronous steps) which step it applies.

Each peer of a stage counts the samples it processed. Without `SimConfig.max_staleness`, each time the
stage as a whole has processed a global batch all its serving peers run the all-reduce in the
background (overlapped with compute, as with delayed parameter updates). With it (SWARM modes), steps
are synchronous as in the runtime: a stage applies step s once the step is closed and all of its
chunks finished there, after an exchange nothing overlaps, and a forward of a step-s chunk waits
(`gate`) until the stage applied step s - 1 - max_staleness.

A stage learns that its part of step s is over from the trainer's close (runtime/trainer/step_tracker.py),
and a trainer learns that a chunk finished a stage from that call's answer. Relayed, every call answers
the trainer; handed off directly (`closes_at_return`), a chunk's hops report only when it returns from
stage 0, so every stage's close waits for the step's last chunk to come back.
"""

from __future__ import annotations

from collections.abc import Callable

from swarmtrain.sim.base import PeerState
from swarmtrain.sim.chunk import Chunk
from swarmtrain.sim.costs import StageCosts
from swarmtrain.sim.engine import EventQueue
from swarmtrain.sim.metrics import Metrics


class StageSteps:
    def __init__(
        self,
        costs: StageCosts,
        max_staleness: int | None,
        members: list[dict[int, PeerState]],
        engine: EventQueue,
        metrics: Metrics,
        closed_step: Callable[[], float],
        release: Callable[[Chunk], None],
        closes_at_return: bool = False,
    ) -> None:
        """`members`: the serving peers of each stage (shared with the simulation); `closed_step`: the
        highest step no trainer adds samples to any more; `release`: dispatch a chunk that waited for
        its step's turn; `closes_at_return`: a stage's close waits for the step's chunks to return
        (direct hand-offs, see above)."""
        S = costs.num_stages
        self.costs, self.max_staleness, self.members = costs, max_staleness, members
        self.engine, self.metrics = engine, metrics
        self._closed_step, self._release = closed_step, release
        self.stage_samples = [0.0] * S
        self.next_step = [float(costs.global_batch_size)] * S  # background all-reduce: at these samples
        # synchronous steps: per stage, the last step applied, the samples of each step whose last call
        # there finished, forwards waiting for their step's turn
        self.applied = [-1] * S
        self.applying = [False] * S
        self.step_done: list[dict[int, float]] = [{} for _ in range(S)]
        self.step_issued: dict[int, float] = {}
        self.gated: list[list[Chunk]] = [[] for _ in range(S)]
        self.closes_at_return = closes_at_return
        self.step_returned: dict[int, float] = {}  # samples of each step back at their trainer

    def gate(self, chunk: Chunk) -> bool:
        """Park a forward whose step is too far ahead of its stage (the runtime parks it until the stage
        applied step - 1 - max_staleness); True when parked."""
        s = chunk.stage
        if self.max_staleness is None or chunk.step <= self.applied[s] + 1 + self.max_staleness:
            return False
        self.gated[s].append(chunk)
        return True

    def assign(self, chunk: Chunk, step: int) -> None:
        """Synchronous steps: the chunk's samples belong to `step` (called before it is dispatched)."""
        chunk.step = step
        if self.max_staleness is not None:
            self.step_issued[step] = self.step_issued.get(step, 0.0) + chunk.samples
            for stage in range(self.costs.num_stages):
                self.try_apply(stage)

    def progress(self, stage: int, chunk: Chunk, peer: PeerState) -> None:
        """The chunk's last call at `stage` finished on `peer`."""
        samples = chunk.samples
        peer.samples_since_step += samples
        self.stage_samples[stage] += samples
        if self.max_staleness is not None:
            done = self.step_done[stage]
            done[chunk.step] = done.get(chunk.step, 0.0) + samples
            self.try_apply(stage)
            return
        while self.stage_samples[stage] >= self.next_step[stage]:
            self.next_step[stage] += self.costs.global_batch_size
            self._average(stage)

    def returned(self, chunk: Chunk) -> None:
        """The chunk is back at its trainer (its stage-0 backward finished)."""
        if self.max_staleness is None or not self.closes_at_return:
            return
        self.step_returned[chunk.step] = self.step_returned.get(chunk.step, 0.0) + chunk.samples
        for stage in range(self.costs.num_stages):
            self.try_apply(stage)

    def try_apply(self, stage: int) -> None:
        """Apply the stage's next step once it is closed and all its samples finished there: after the
        gradient exchange between the stage's peers, which (unlike delayed updates) nothing overlaps."""
        k = self.applied[stage] + 1
        if self.applying[stage] or k > self._closed_step():
            return
        issued = self.step_issued.get(k, 0.0)
        if self.step_done[stage].get(k, 0.0) < issued:
            return
        if self.closes_at_return and self.step_returned.get(k, 0.0) < issued:
            return
        self.applying[stage] = True
        self.engine.schedule(self._average(stage, foreground=True), self._on_applied, stage, k)

    def _on_applied(self, stage: int, step: int) -> None:
        self.applying[stage] = False
        self.applied[stage] = step
        self.step_done[stage].pop(step, None)
        if self.closes_at_return and all(a >= step for a in self.applied):
            self.step_returned.pop(step, None)
        if self.gated[stage]:
            parked, self.gated[stage] = self.gated[stage], []
            for chunk in parked:  # those still too early park again
                self.engine.schedule(self.engine.now_s, self._release, chunk)
        self.try_apply(stage)

    def _average(self, stage: int, foreground: bool = False) -> float:
        """The stage's gradient all-reduce; returns when it is done (background: now)."""
        members = self.members[stage]
        n = len(members)
        now = self.engine.now_s
        done = now
        per_peer = self.costs.exchange_bytes(stage, n)
        for peer in members.values():
            if per_peer and foreground:
                peer.reserve_both(now, per_peer)
                done = max(done, peer.link_free_s())
            elif per_peer:
                peer.add_background(now, per_peer)
            peer.samples_since_step = 0.0
        self.metrics.bytes_by_kind["averaging"] += per_peer * n
        return done
