"""Fixed GPipe-style pipelines: one peer per stage per pipeline, flush every step, no rerouting.

- Formation: live peers sorted by speed (mean rate, fastest first) are cut into groups of S; inside a
  group the heaviest stage gets the fastest peer that can hold it. Leftover peers are spares.
- A step: the pipeline's trainer injects M micro-batches (`gpipe_micro_batches`, default: the global
  batch split over the initial pipelines, at most 4S), all forwards then backwards through the same peers; when all
  M are back the step's samples count and the next step starts (the flush makes the pipeline bubble).
  Gradient averaging across pipelines is charged on links per global batch as in SWARM; pipelines are
  not barrier-synchronized with each other.
- A peer that leaves or fails stalls its pipeline: the step's micro-batches are lost and it waits until
  a replacement is assigned. Replacements come from spares (fastest first that can hold the stage),
  which download the stage's state; joining peers become spares. If two or more pipelines are stalled
  and no spare fits, the highest-numbered stalled one is dissolved into spares to repair the others.
  When S spares are idle and nothing is stalled they form a new pipeline.
"""

from __future__ import annotations

from swarmtrain.sim.base import PeerState
from swarmtrain.sim.chunk import Chunk
from swarmtrain.sim.network import Endpoint
from swarmtrain.sim.pipeline import PipelineSimulation

RUNNING, STALLED, STARTING = "running", "stalled", "starting"
MAX_MICRO_BATCHES_PER_STAGE = 4  # GPipe's advice: M >= 4S amortizes the bubble; memory bounds M anyway


class Pipeline:
    __slots__ = ("index", "slots", "state", "done", "endpoint", "downloading")

    def __init__(self, index: int, slots: list[int], endpoint: Endpoint) -> None:
        self.index = index
        self.slots = slots  # peer index per stage, -1 when missing
        self.state = STARTING
        self.done = 0
        self.endpoint = endpoint
        self.downloading: set[int] = set()


class GPipeSimulation(PipelineSimulation):
    uses_timeouts = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pipelines: list[Pipeline] = []
        self.spares: list[PeerState] = []
        self.micro_batches = 1

    def setup(self) -> None:
        self.refresh_rates(self.optimum())
        self.spares = [p for p in self.peers if p.live and max(p.rates) > 0]
        while (pipeline := self._form(download=False)) is not None:
            pipeline.state = RUNNING
        count = max(1, len(self.pipelines))
        chunks = self.costs.global_batch_size / (count * self.chunk_samples)
        cap = MAX_MICRO_BATCHES_PER_STAGE * self.num_stages
        self.micro_batches = self.config.gpipe_micro_batches or max(1, min(cap, round(chunks)))
        for pipeline in self.pipelines:
            self._start_step(pipeline)

    def _speed(self, peer: PeerState) -> float:
        return sum(peer.rates) / len(peer.rates)

    def _form(self, download: bool) -> Pipeline | None:
        if len(self.spares) < self.num_stages:
            return None
        ranked = sorted(self.spares, key=lambda p: (-self._speed(p), p.index))[: self.num_stages]
        heavy_first = sorted(range(self.num_stages), key=lambda s: (-self.costs.flops_per_sample[s], s))
        slots = [-1] * self.num_stages
        for stage in heavy_first:
            fit = next(
                (p for p in ranked if p.group < 0 and p.rates[stage] > 0 and p.index not in slots), None
            )
            if fit is None:
                return None
            slots[stage] = fit.index
        link = self.config.trainer_link_bytes_per_s
        pipeline = Pipeline(len(self.pipelines), slots, Endpoint(self.peers[slots[0]].location, link, link))
        self.pipelines.append(pipeline)
        for stage, index in enumerate(slots):
            self._assign(pipeline, self.peers[index], stage, download)
        return pipeline

    def _assign(self, pipeline: Pipeline, peer: PeerState, stage: int, download: bool) -> None:
        self.spares.remove(peer)
        peer.group = pipeline.index
        pipeline.slots[stage] = peer.index
        if not download:
            self.start_serving(peer, stage)
            return
        peer.stage = stage
        pipeline.downloading.add(peer.index)
        arrival = self.download_state(peer, self.members[stage].values(), self.costs.state_bytes[stage])
        self.engine.schedule(arrival, self._on_downloaded, peer.index, peer.epoch)

    def _on_downloaded(self, index: int, epoch: int) -> None:
        peer = self.peers[index]
        if peer.epoch != epoch or not peer.live or peer.group < 0:
            return
        pipeline = self.pipelines[peer.group]
        pipeline.downloading.discard(index)
        self.start_serving(peer, peer.stage)
        if not pipeline.downloading and -1 not in pipeline.slots:
            pipeline.state = RUNNING
            self._start_step(pipeline)

    # steps -------------------------------------------------------------------------------------
    def _start_step(self, pipeline: Pipeline) -> None:
        pipeline.done = 0
        for _ in range(self.micro_batches):
            self.dispatch(self.new_chunk(pipeline))

    def trainer_endpoint(self, chunk: Chunk) -> Endpoint:
        return chunk.owner.endpoint

    def choose_peer(self, chunk: Chunk, weight: float) -> PeerState | None:
        return self.peers[chunk.owner.slots[chunk.stage]]

    def on_chunk_done(self, chunk: Chunk) -> None:
        pipeline = chunk.owner
        pipeline.done += 1
        if pipeline.done == self.micro_batches:
            self.metrics.samples_completed += self.micro_batches * self.chunk_samples
            self._start_step(pipeline)

    # churn -------------------------------------------------------------------------------------
    def on_join(self, peer: PeerState) -> None:
        if max(peer.rates) > 0:
            self.spares.append(peer)
            self._repair()

    def on_depart(self, peer: PeerState, graceful: bool) -> None:
        if peer.group < 0:
            if peer in self.spares:
                self.spares.remove(peer)
            return
        pipeline = self.pipelines[peer.group]
        self._stall(pipeline)
        pipeline.slots[pipeline.slots.index(peer.index)] = -1
        pipeline.downloading.discard(peer.index)
        self.stop_serving(peer)
        peer.group, peer.stage = -1, -1
        self._repair()

    def _stall(self, pipeline: Pipeline) -> None:
        if pipeline.state == RUNNING:
            self.metrics.samples_lost += pipeline.done * self.chunk_samples
            self.metrics.counts["stalls"] += 1
        pipeline.state = STALLED
        pipeline.done = 0
        for index in pipeline.slots:
            if index >= 0:
                self.abandon(self.peers[index])  # the step's micro-batches are void; nothing is retried

    def _repair(self) -> None:
        while True:
            stalled = [p for p in self.pipelines if p.state == STALLED]
            for pipeline in stalled:
                self._fill(pipeline)
            stuck = [p for p in stalled if -1 in p.slots]
            if len(stuck) < 2:
                break
            self._dissolve(stuck[-1])
        if not any(p.state == STALLED for p in self.pipelines):
            while self._form(download=True) is not None:
                pass

    def _fill(self, pipeline: Pipeline) -> None:
        for stage, index in enumerate(pipeline.slots):
            if index >= 0:
                continue
            ranked = sorted(self.spares, key=lambda p: (-self._speed(p), p.index))
            fit = next((p for p in ranked if p.rates[stage] > 0), None)
            if fit is not None:
                self._assign(pipeline, fit, stage, download=True)
        if -1 not in pipeline.slots and not pipeline.downloading:
            pipeline.state = RUNNING
            self._start_step(pipeline)

    def _dissolve(self, pipeline: Pipeline) -> None:
        for stage, index in enumerate(pipeline.slots):
            if index < 0:
                continue
            peer = self.peers[index]
            self.stop_serving(peer)
            peer.group, peer.stage = -1, -1
            peer.epoch += 1  # voids a download in progress
            pipeline.slots[stage] = -1
            self.spares.append(peer)
        pipeline.downloading.clear()
        pipeline.state = "dissolved"
