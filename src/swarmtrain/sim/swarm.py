"""SWARM mode: stage swarms, stochastic wiring by per-trainer IWRR, joins and (optionally) rebalancing.

- Trainers: each keeps its share of the micro-batches in flight and one `StageRouter` per stage (the
  planner's pure IWRR class). Peers announce `rate * 3` (forward-equivalent samples/s, matching the
  router's forward/backward weights); routers then learn from observed end-to-end durations.
- At start the live peers take the best static allocation (`optimal`).
- A joining peer picks a stage, downloads that stage's state (`sizes.stage_state_bytes`) from the stage
  peer that can send it soonest, then serves. With rebalancing it joins the bottleneck
  (`planner.rebalance.stage_for_new_peer`); without, it returns to its *home* stage, its place in the
  best allocation of the whole fleet (what an operator's launch script with `--stage N` pins).
- Rebalancing (mode `swarm`): every `rebalance_period_s` (+- jitter) the pure policy
  `planner.rebalance.plan_moves` sees every peer's rate at each stage and queue length; each move costs
  the real price: the mover abandons its queue (retried elsewhere), loses its un-averaged gradients,
  downloads the target state, then serves.
- A failed peer's micro-batches are retried on other peers after `fail_detect_s`; a graceful leave
  hands them back at once.
"""

from __future__ import annotations

import heapq

from swarmtrain.planner.rebalance import Move, PeerLoad, RebalanceConfig, plan_moves, stage_for_new_peer
from swarmtrain.planner.routing import FORWARD_WEIGHT, StageRouter
from swarmtrain.sim.base import PeerState
from swarmtrain.sim.chunk import Chunk
from swarmtrain.sim.network import Endpoint
from swarmtrain.sim.optimal import optimal_allocation
from swarmtrain.sim.pipeline import LAST_STAGE_WEIGHT, PipelineSimulation

ANNOUNCE_FACTOR = LAST_STAGE_WEIGHT  # samples/s of forward+backward -> forward-equivalent samples/s


class FastMinRouter(StageRouter):
    """The planner's router with one change for thousands of peers: the minimum virtual finish time
    (where a new peer enters) is read from the heap top, dropping stale entries, instead of scanning all
    peers. Every peer has exactly one live heap entry keyed by its current finish time, so the value is
    the same; adding n peers costs O(n log n) instead of O(n^2)."""

    def _min_finish_s(self) -> float:
        heap = self._heap
        while heap:
            key, _, peer = heap[0]
            state = self._peers.get(peer)
            if state is not None and key == state.virtual_finish_s:
                return key
            heapq.heappop(heap)
        return 0.0


class Trainer:
    __slots__ = ("index", "endpoint", "routers", "issued")

    def __init__(self, index: int, endpoint: Endpoint, num_stages: int) -> None:
        self.index = index
        self.endpoint = endpoint
        self.routers = [FastMinRouter() for _ in range(num_stages)]
        self.issued = 0.0  # samples this trainer has started


class SwarmSimulation(PipelineSimulation):
    numbers_steps = True

    def __init__(self, *args, num_trainers: int, in_flight: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rebalance = self.config.mode == "swarm"
        self.capacity = [0.0] * self.num_stages  # serving + downloading peers, samples/s
        self.num_trainers = num_trainers
        self.in_flight = in_flight
        self.trainers: list[Trainer] = []
        self.max_moves = 1
        self.policy = RebalanceConfig(margin=self.config.rebalance_margin)

    # setup -------------------------------------------------------------------------------------
    def _initial_stages(self, live: list[PeerState]) -> tuple[list[int], float]:
        """Stages of the live peers at start, and the throughput the announced rates assume.

        Peers start where the best static allocation of the live peers puts them, unless the fleet gives
        home stages (`PeerSpec.home_stage`, e.g. a placement that keeps each stage in one region). A
        peer's home stage (where it returns without rebalancing) is its place in the given placement or
        in the best allocation of the whole fleet."""
        alloc = optimal_allocation(self.table, self.costs, [p.index for p in live])
        if len(live) == len(self.peers):
            whole = {p.index: int(s) for p, s in zip(live, alloc.stage_of.tolist(), strict=True)}
        else:
            whole = dict(enumerate(optimal_allocation(self.table, self.costs).stage_of.tolist()))
        for peer in self.peers:
            given = peer.spec.home_stage
            peer.home_stage = given if given is not None else whole.get(peer.index, -1)
        if any(p.spec.home_stage is not None for p in self.peers) or not self.rebalance:
            return [p.home_stage for p in live], alloc.throughput_samples_per_s
        return alloc.stage_of.tolist(), alloc.throughput_samples_per_s

    def setup(self) -> None:
        live = [p for p in self.peers if p.live]
        # None: the whole plan, as live servers carry it out (runtime/server/balancer.py)
        self.max_moves = self.config.max_moves_per_tick or len(self.peers)
        stages, throughput = self._initial_stages(live)
        locations = sorted({p.location for p in self.peers})
        link = self.config.trainer_link_bytes_per_s
        for t in range(self.num_trainers):
            where = locations[t % len(locations)]
            self.trainers.append(Trainer(t, Endpoint(where, link, link), self.num_stages))
        self.refresh_rates(throughput, [sum(1 for s in stages if s == k) for k in range(self.num_stages)])
        for peer, stage in zip(live, stages, strict=True):
            if stage >= 0 and peer.rates[stage] > 0:
                self.capacity[stage] += peer.rates[stage]
                self.start_serving(peer, stage)
        for i in range(self.in_flight):
            chunk = self.new_chunk(self.trainers[i % self.num_trainers])
            self._start(chunk)
        if self.rebalance:
            self.engine.schedule(self._next_tick_s(), self._on_rebalance)

    def trainer_endpoint(self, chunk: Chunk) -> Endpoint:
        return chunk.owner.endpoint

    def _start(self, chunk: Chunk) -> None:
        """A new micro-batch of its trainer: the step of its first sample (each trainer contributes
        global_batch / trainers samples to a step), then on its way."""
        trainer = chunk.owner
        share = self.costs.global_batch_size / self.num_trainers
        step = int(trainer.issued // share)
        trainer.issued += chunk.samples
        self.steps.assign(chunk, step)
        self.dispatch(chunk)

    def closed_step(self) -> float:
        share = self.costs.global_batch_size / self.num_trainers
        return min(int(t.issued // share) for t in self.trainers) - 1

    # routing -----------------------------------------------------------------------------------
    def choose_peer(self, chunk: Chunk, weight: float) -> PeerState | None:
        exclude = (chunk.avoid,) if chunk.avoid >= 0 else ()
        p = chunk.owner.routers[chunk.stage].choose(self.engine.now_s, chunk.samples, weight, exclude)
        return None if p is None else self.peers[p]

    def on_computed_report(self, chunk: Chunk, peer: PeerState, weight: float, duration_s: float) -> None:
        chunk.owner.routers[chunk.stage].report(peer.index, chunk.samples, duration_s, weight)

    def on_chunk_done(self, chunk: Chunk) -> None:
        self.metrics.samples_completed += chunk.samples
        chunk.reset(self.next_chunk_id())
        self._start(chunk)

    # membership --------------------------------------------------------------------------------
    def start_serving(self, peer: PeerState, stage: int) -> None:
        announced = peer.rates[stage] * ANNOUNCE_FACTOR / FORWARD_WEIGHT
        for trainer in self.trainers:
            trainer.routers[stage].add_peer(peer.index, announced)
        self._membership_changed = True
        super().start_serving(peer, stage)

    def stop_serving(self, peer: PeerState) -> None:
        if not peer.serving:
            return
        for trainer in self.trainers:
            trainer.routers[peer.stage].remove_peer(peer.index)
        self.capacity[peer.stage] -= peer.rates[peer.stage]
        super().stop_serving(peer)

    def on_join(self, peer: PeerState) -> None:
        if self.rebalance:
            stage = stage_for_new_peer(self.capacity, peer.rates)
        else:
            stage = peer.home_stage if peer.home_stage >= 0 and peer.rates[peer.home_stage] > 0 else None
        if stage is not None:
            self._download_then_serve(peer, stage)

    def on_depart(self, peer: PeerState, graceful: bool) -> None:
        if peer.serving:
            self.stop_serving(peer)
        elif peer.stage >= 0:  # was downloading a stage's state
            self.capacity[peer.stage] -= peer.rates[peer.stage]
        peer.stage = -1
        if not graceful:
            self.metrics.samples_lost += peer.samples_since_step
        peer.samples_since_step = 0.0
        self.reroute_later(self.abandon(peer), 0.0 if graceful else self.config.fail_detect_s)

    def _download_then_serve(self, peer: PeerState, stage: int) -> None:
        peer.stage = stage
        self.capacity[stage] += peer.rates[stage]
        arrival = self.download_state(peer, self.members[stage].values(), self.costs.state_bytes[stage])
        self.engine.schedule(arrival, self._on_downloaded, peer.index, peer.epoch)

    def _on_downloaded(self, index: int, epoch: int) -> None:
        peer = self.peers[index]
        if peer.epoch != epoch or not peer.live:
            return
        self.start_serving(peer, peer.stage)

    # rebalancing -------------------------------------------------------------------------------
    def _next_tick_s(self) -> float:
        jitter = self.config.rebalance_jitter * (2 * self.rng.random() - 1)
        return self.engine.now_s + self.config.rebalance_period_s * (1 + jitter)

    def refresh_rates(self, throughput_samples_per_s: float, sizes: list[int] | None = None) -> None:
        super().refresh_rates(throughput_samples_per_s, sizes)
        self.capacity = [0.0] * self.num_stages
        for peer in self.peers:
            if peer.live and peer.stage >= 0:
                self.capacity[peer.stage] += peer.rates[peer.stage]

    def _on_rebalance(self, _a=None, _b=None) -> None:
        self.refresh_rates(self.optimum())
        for move in self.rebalance_plan():
            self._move(self.peers[move.peer], move.to_stage)
        self.engine.schedule(self._next_tick_s(), self._on_rebalance)

    def rebalance_plan(self) -> list[Move]:
        """The moves the policy makes on the peers' current rates (it changes nothing: timelines show it)."""
        if not self.rebalance:
            return []
        loads = []
        for peer in self.peers:
            if peer.live and peer.stage >= 0:
                loads.append(
                    PeerLoad(
                        peer.index,
                        peer.stage,
                        peer.rates[peer.stage],
                        len(peer.queue) + peer.busy,
                        throughput_by_stage=peer.rates,
                        pending=not peer.serving,
                    )
                )
        return plan_moves(loads, self.num_stages, self.policy, max_moves=self.max_moves)

    def _move(self, peer: PeerState, target: int) -> None:
        self.metrics.counts["moves"] += 1
        self.stop_serving(peer)
        self.metrics.samples_lost += peer.samples_since_step
        peer.samples_since_step = 0.0
        self.reroute_later(self.abandon(peer), 0.0)
        peer.epoch += 1
        self._download_then_serve(peer, target)
