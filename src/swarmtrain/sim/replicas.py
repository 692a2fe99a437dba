"""Asynchronous full replicas with layer swapping (ATOM-style), averaging every H local steps.

Every live peer whose host memory holds the whole model's training state trains the whole model by
itself, streaming layers from host memory when the accelerator is too small (`costs.full_model_s_per_sample`).
A local step processes `local_batch_samples`; after every `average_every_steps` steps the replica
averages its parameters with the others (butterfly all-reduce of fp16 parameters, or of
`SimConfig.replica_averaging_bytes_per_param` bytes each: about 2x the model in each direction of its
link), which blocks its compute until its links have moved the bytes (replicas do not wait for each
other: group formation is not modelled). A replica that fails loses the samples since
its last averaging; a joining replica first downloads the full training state from the replica that can
send it soonest.
"""

from __future__ import annotations

import math

from swarmtrain.sim.base import PeerState, Simulation
from swarmtrain.sim.costs import full_model_s_per_sample


class ReplicaSimulation(Simulation):
    def __init__(self, *args, local_batch_samples: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.local_batch_samples = local_batch_samples
        self.step_s = [full_model_s_per_sample(p.spec, self.costs) for p in self.peers]
        self.steps = [0] * len(self.peers)
        self.replicas: dict[int, PeerState] = {}
        self.average_bytes = 2 * self.costs.model_params * self.config.replica_averaging_bytes_per_param

    def metrics_stages(self) -> int:
        return 1

    def metric_stage(self, peer: PeerState) -> int:
        return 0

    def setup(self) -> None:
        for peer in self.peers:
            if peer.live and math.isfinite(self.step_s[peer.index]):
                self._serve(peer)

    def _serve(self, peer: PeerState) -> None:
        peer.serving = True
        peer.stage = 0
        self.replicas[peer.index] = peer
        self.metrics.serving_changed(self.engine.now_s, 0, +1)
        self._start_step(peer)

    def _start_step(self, peer: PeerState) -> None:
        now = self.engine.now_s
        peer.busy = True
        peer.busy_since_s = now
        duration = self.local_batch_samples * self.step_s[peer.index]
        self.engine.schedule(now + duration, self._on_step, peer.index, peer.epoch)

    def _on_step(self, index: int, epoch: int) -> None:
        peer = self.peers[index]
        if peer.epoch != epoch:
            return
        now = self.engine.now_s
        self.metrics.stage_busy_s[0] += now - max(peer.busy_since_s, self._last_sample_s)
        peer.busy = False
        self.metrics.samples_completed += self.local_batch_samples
        peer.samples_since_step += self.local_batch_samples
        self.steps[index] += 1
        if self.steps[index] % self.config.average_every_steps:
            self._start_step(peer)
            return
        n = len(self.replicas)
        per_peer = self.average_bytes * (n - 1) / n if n > 1 else 0.0
        peer.reserve_both(now, per_peer)
        self.metrics.bytes_by_kind["averaging"] += per_peer
        self.engine.schedule(peer.link_free_s(), self._on_averaged, index, epoch)

    def _on_averaged(self, index: int, epoch: int) -> None:
        peer = self.peers[index]
        if peer.epoch != epoch:
            return
        peer.samples_since_step = 0.0
        self._start_step(peer)

    def on_join(self, peer: PeerState) -> None:
        if not math.isfinite(self.step_s[peer.index]):
            return
        arrival = self.download_state(peer, self.replicas.values(), self.costs.model_state_bytes)
        self.engine.schedule(arrival, self._on_downloaded, peer.index, peer.epoch)

    def _on_downloaded(self, index: int, epoch: int) -> None:
        peer = self.peers[index]
        if peer.epoch == epoch and peer.live:
            self._serve(peer)

    def on_depart(self, peer: PeerState, graceful: bool) -> None:
        if peer.busy:
            self.metrics.stage_busy_s[0] += self.engine.now_s - max(peer.busy_since_s, self._last_sample_s)
            peer.busy = False
        if peer.serving:
            peer.serving = False
            del self.replicas[peer.index]
            self.metrics.serving_changed(self.engine.now_s, 0, -1)
        if not graceful:
            self.metrics.samples_lost += peer.samples_since_step
        peer.samples_since_step = 0.0
        peer.stage = -1
