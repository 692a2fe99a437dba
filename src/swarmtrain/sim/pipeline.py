"""Micro-batches through stage peers: the machinery SWARM and fixed pipelines share.

A chunk (one simulated micro-batch of `chunk_samples` samples) goes forward through stages 0..S-1 and
backward S-1..0. At each stage it is sent to a peer (a transfer on the link model), waits in that peer's
FIFO queue, and is computed (forward: 1/3 of the stage's training time; the last stage runs forward and
backward in one go; a backward on the peer that ran the forward reuses its activations, elsewhere it
recomputes them, +1/3). Boundary tensors travel peer to peer. The trainer keeps a copy of every boundary
tensor (in the runtime it relays them), so a retry is re-sent from the trainer. With
`SimConfig.relay_via_trainer` they take the runtime's path: the previous peer's output goes to the trainer
and the trainer sends the request (with a backward, the stage's input again; with the last stage's
forward, the labels), over the trainer's link of `trainer_link_bytes_per_s` each way.

Compute calls: each chunk is one call on its peer, costing `SimConfig.call_overhead_s` (a fixed
per-call cost, 0 by default) plus its samples' compute. With `SimConfig.max_batch_samples` a peer that
starts a call takes the oldest queued chunk and the oldest queued chunks of the same kind after it (same
stage, forward or backward, and step, as the live server's batch key) up to that many samples, and runs
them as one call (`_take_call`); each part's results go on when the call is done.

When a stage steps (its gradient all-reduce, which occupies both directions of its peers' links, and with
`SimConfig.max_staleness` which step it applies) is sim/stage_steps.py's; a failed peer loses the samples it
had accumulated since the stage's last step.

Subclasses decide which peer serves a chunk (`choose_peer`) and what happens when it completes.
"""

from __future__ import annotations

from collections import deque

from swarmtrain.planner.routing import BACKWARD_WEIGHT, FORWARD_CHARGE, FORWARD_WEIGHT
from swarmtrain.sim.base import Observer, PeerState, Simulation
from swarmtrain.sim.chunk import Chunk
from swarmtrain.sim.metrics import SimResult
from swarmtrain.sim.network import Endpoint
from swarmtrain.sim.stage_steps import StageSteps
from swarmtrain.utils.rng import make_rng

LAST_STAGE_WEIGHT = FORWARD_WEIGHT + BACKWARD_WEIGHT  # the last stage runs forward and backward together


class Variability:
    """Random factors (mean 1, gamma-distributed with the given coefficient of variation) on each
    compute task's duration and each transfer's latency. Real servers on shared machines and real
    networks jitter, and jitter makes requests queue where a deterministic pipeline would not: the
    calibration against the local demo (experiments/calibrate_demo.py) needs it. CV 0: no draw at all,
    so deterministic runs are unchanged. A stream of its own keeps the other random choices stable."""

    def __init__(self, compute_cv: float, latency_cv: float, seed: int) -> None:
        self.compute_cv, self.latency_cv = compute_cv, latency_cv
        self.rng = make_rng(seed, "sim", "variability")

    def _draw(self, cv: float) -> float:
        shape = 1.0 / (cv * cv)
        return float(self.rng.gamma(shape, 1.0 / shape))

    def compute_factor(self) -> float:
        return self._draw(self.compute_cv) if self.compute_cv else 1.0

    def latency_factor(self) -> float:
        return self._draw(self.latency_cv) if self.latency_cv else 1.0


class PipelineSimulation(Simulation):
    uses_timeouts = True  # fixed pipelines cannot go elsewhere, so they wait instead
    # numbers each chunk's step (`StageSteps.assign`, `closed_step`), so steps can run synchronously
    numbers_steps = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        S = self.num_stages
        self.last = S - 1
        self.members: list[dict[int, PeerState]] = [{} for _ in range(S)]
        self.waiting: list[list[Chunk]] = [[] for _ in range(S)]
        self._next_chunk_id = 0
        scale = max(1.0, self.chunk_samples / self.costs.micro_batch_size)
        self.timeout_s = self.config.request_timeout_s * scale if self.uses_timeouts else float("inf")
        self.audit_violations = 0
        self.audited_chunks = 0
        self.variability = Variability(self.config.compute_cv, self.config.latency_cv, self.config.seed)
        self.call_overhead_s = self.config.call_overhead_s
        self.max_batch_samples = self.config.max_batch_samples
        self.batched_calls = 0  # calls that took two chunks or more, and those chunks
        self.batched_chunks = 0
        # synchronous steps only where chunks are numbered by step (`SimConfig.max_staleness`)
        max_staleness = self.config.max_staleness if self.numbers_steps else None
        self.steps = StageSteps(
            self.costs,
            max_staleness,
            self.members,
            self.engine,
            self.metrics,
            self.closed_step,
            self.dispatch,
            closes_at_return=not self.config.relay_via_trainer,
        )

    def audit(self) -> dict:
        return {"chunks": self.audited_chunks, "violations": self.audit_violations}

    def run(self, observer: Observer | None = None) -> SimResult:
        result = super().run(observer)
        if self.max_batch_samples:  # only then: default summaries keep their keys
            result.summary.update(batched_calls=self.batched_calls, batched_chunks=self.batched_chunks)
        return result

    def refresh_rates(self, throughput_samples_per_s: float, sizes: list[int] | None = None) -> None:
        """What peers announce: their rate at each stage with the averaging traffic of a pipeline at the
        given throughput taken off their links (a peer that cannot keep up announces 0 there). The
        all-reduce share uses `sizes` (peers per stage), by default the current stage swarms."""
        if sizes is None and any(self.members):
            sizes = [len(m) for m in self.members]
        rates = self.table.rates(self.costs, throughput_samples_per_s, sizes).tolist()
        for peer in self.peers:
            peer.rates = tuple(rates[peer.index])

    # to implement ------------------------------------------------------------------------------
    def choose_peer(self, chunk: Chunk, weight: float) -> PeerState | None:
        raise NotImplementedError

    def on_chunk_done(self, chunk: Chunk) -> None:
        raise NotImplementedError

    def on_computed_report(self, chunk: Chunk, peer: PeerState, weight: float, duration_s: float) -> None:
        """Hook for routers to learn from an observed end-to-end duration (SWARM)."""

    def trainer_endpoint(self, chunk: Chunk) -> Endpoint:
        raise NotImplementedError

    def closed_step(self) -> float:
        """Synchronous steps: the highest step no trainer will add samples to any more."""
        raise NotImplementedError

    # chunks ------------------------------------------------------------------------------------
    def new_chunk(self, owner) -> Chunk:
        chunk = Chunk(self.next_chunk_id(), owner, self.chunk_samples, self.num_stages)
        if self.config.audit:
            chunk.log = []
        return chunk

    def next_chunk_id(self) -> int:
        self._next_chunk_id += 1
        return self._next_chunk_id

    def dispatch(self, chunk: Chunk, _unused=None) -> None:
        """Send the chunk to a peer of its current stage (or park it until the stage has one)."""
        s = chunk.stage
        if chunk.backward and s < self.last:
            p = chunk.path[s]
            peer = self.peers[p] if p >= 0 else None
            if (
                peer is not None
                and peer.serving
                and peer.stage == s
                and peer.epoch == chunk.path_epoch[s]
                and p != chunk.avoid
            ):
                chunk.recompute = False
            else:
                peer = self.choose_peer(chunk, BACKWARD_WEIGHT)
                chunk.recompute = True
        else:
            if self.steps.gate(chunk):
                return
            peer = self.choose_peer(chunk, LAST_STAGE_WEIGHT if s == self.last else FORWARD_CHARGE)
        if peer is None:
            self.waiting[s].append(chunk)
            self.metrics.counts["stalls"] += 1
            return
        self._send(chunk, peer)

    def _request_bytes(self, chunk: Chunk) -> tuple[str, float]:
        """What the request to the chunk's current stage carries (kind, bytes)."""
        k, act, tokens = (
            chunk.samples,
            self.costs.activation_bytes_per_sample,
            self.costs.token_bytes_per_sample,
        )
        relay = self.config.relay_via_trainer
        if chunk.backward:
            if relay:  # the runtime sends the stage's input again with the gradient of its output
                return "gradients", k * (act + (tokens if chunk.stage == 0 else act))
            return "gradients", k * act * (2 if chunk.recompute else 1)
        # the labels (as wide as the ids): relayed, the trainer sends them to the last stage; handed off
        # directly, they ride every forward hop there (net/hand_off.py)
        labels = k * self.costs.label_bytes_per_sample if not relay or chunk.stage == self.last else 0.0
        if chunk.stage == 0:
            return "tokens", k * tokens + labels
        return "activations", k * act + labels

    def _send(self, chunk: Chunk, peer: PeerState) -> None:
        now = self.engine.now_s
        trainer = self.trainer_endpoint(chunk)
        src = self.peers[chunk.src] if chunk.src >= 0 else trainer
        kind, num_bytes = self._request_bytes(chunk)
        chunk.attempt += 1
        chunk.peer = peer.index
        chunk.sent_s = now
        peer.held[chunk.id] = chunk
        if self.variability.compute_cv:
            chunk.compute_factor = self.variability.compute_factor()
        if self.config.relay_via_trainer and src is not trainer:
            # the previous peer's output (activations, or the input gradient) goes back to the trainer,
            # which sends the request on once it has it (`_relay`)
            out_bytes = chunk.samples * self.costs.activation_bytes_per_sample
            back = self.network.transfer(now, src, trainer, out_bytes, self.timeout_s)
            if back is None:
                self._time_out(chunk, peer, now + self.timeout_s, 2 * self.timeout_s)
                return
            self.metrics.bytes_by_kind[kind] += out_bytes
            self.engine.schedule(back, self._relay, chunk, chunk.attempt)
            return
        self._request(chunk, src, peer, kind, num_bytes)

    def _relay(self, chunk: Chunk, attempt: int) -> None:
        if attempt != chunk.attempt:
            return  # the peer it was meant for left; the chunk was rerouted
        kind, num_bytes = self._request_bytes(chunk)
        self._request(chunk, self.trainer_endpoint(chunk), self.peers[chunk.peer], kind, num_bytes)

    def _request(self, chunk: Chunk, src: Endpoint, peer: PeerState, kind: str, num_bytes: float) -> None:
        """The request's transfer to the peer, within what is left of its deadline."""
        now = self.engine.now_s
        left_s = self.timeout_s - (now - chunk.sent_s)
        arrival = self.network.transfer(now, src, peer, num_bytes, left_s)
        if arrival is not None and self.variability.latency_cv:
            arrival += self.network.latency(src.location, peer.location) * (
                self.variability.latency_factor() - 1
            )
        if arrival is None:  # the links are backed up beyond the deadline: given up, retried elsewhere
            self._time_out(chunk, peer, chunk.sent_s + self.timeout_s, 2 * self.timeout_s)
            return
        self.metrics.bytes_by_kind[kind] += num_bytes
        self.engine.schedule(arrival, self._on_arrive, chunk, chunk.attempt)

    def _on_arrive(self, chunk: Chunk, attempt: int) -> None:
        if attempt != chunk.attempt:
            return  # the peer it was sent to left; the chunk was rerouted
        now = self.engine.now_s
        peer = self.peers[chunk.peer]
        duration = self._duration(peer, chunk)
        if not (self.max_batch_samples and peer.busy and self._joins_call(peer, chunk)):
            duration += self.call_overhead_s  # a call of its own
        # With batching this is when all the compute accepted so far is done, an upper bound on when
        # the chunk's call is (it may join a call ahead of others queued).
        done = (peer.backlog_until_s if peer.busy and peer.backlog_until_s > now else now) + duration
        # Requests have a deadline (`request_timeout_s`): one that would answer too late (deep queue,
        # or an uplink backed up by averaging) is given up and retried elsewhere, as a trainer does.
        answered = self._answered_s(peer, chunk, done)
        if answered - chunk.sent_s > self.timeout_s:
            self._time_out(chunk, peer, max(now, chunk.sent_s + self.timeout_s), answered - chunk.sent_s)
            return
        peer.backlog_until_s = done
        if peer.busy:
            peer.queue.append(chunk)
        else:
            self._start_compute(peer, chunk)

    def _duration(self, peer: PeerState, chunk: Chunk) -> float:
        """The chunk's compute without the per-call cost. The compute noise factor is the chunk's own
        (drawn per request at `_send`), so a batched call costs exactly what its parts would alone
        minus the shared per-call costs, and turning batching on draws the same random numbers."""
        full = peer.compute_s[chunk.stage] * chunk.samples * chunk.compute_factor
        if chunk.backward:
            return full * (1.0 if chunk.recompute else 2.0 / 3.0)
        return full if chunk.stage == self.last else full / 3.0

    def _answered_s(self, peer: PeerState, chunk: Chunk, done_s: float) -> float:
        """When the response to a chunk computed by `done_s` has left the peer's uplink."""
        if chunk.stage == 0 and (chunk.backward or self.last == 0):
            out_bytes = 0.0  # only the loss goes back to the trainer
        else:
            out_bytes = chunk.samples * self.costs.activation_bytes_per_sample
        return (peer.up_free_s if peer.up_free_s > done_s else done_s) + out_bytes / peer.up_bytes_per_s

    def _weight(self, chunk: Chunk) -> float:
        if chunk.backward:
            return BACKWARD_WEIGHT
        return LAST_STAGE_WEIGHT if chunk.stage == self.last else FORWARD_WEIGHT

    def _start_compute(self, peer: PeerState, chunk: Chunk) -> None:
        now = self.engine.now_s
        peer.busy = True
        peer.busy_since_s = now
        duration = self._duration(peer, chunk) + self.call_overhead_s
        self.engine.schedule(now + duration, self._on_computed, chunk, chunk.attempt)

    def _start_next(self, peer: PeerState) -> None:
        """The next call from the peer's (non-empty) queue, with batching on."""
        parts = self._take_call(peer)
        if len(parts) == 1:
            self._start_compute(peer, parts[0])
            return
        self._start_call(peer, parts)

    @staticmethod
    def _same_call(a: Chunk, b: Chunk) -> bool:
        """The live server's batch key: same stage, kind (forward or backward) and step."""
        return a.stage == b.stage and a.backward == b.backward and a.step == b.step

    def _take_call(self, peer: PeerState) -> list[Chunk]:
        """The oldest queued chunk and the oldest of its kind after it, up to `max_batch_samples` in
        all; as the server, it stops at the first that does not fit."""
        queue = peer.queue
        first = queue.popleft()
        parts, samples, room = [first], first.samples, True
        kept: deque[Chunk] = deque()
        for chunk in queue:
            if room and self._same_call(first, chunk):
                if samples + chunk.samples <= self.max_batch_samples:
                    parts.append(chunk)
                    samples += chunk.samples
                    continue
                room = False
            kept.append(chunk)
        if len(parts) > 1:
            peer.queue = kept
        return parts

    def _joins_call(self, peer: PeerState, chunk: Chunk) -> bool:
        """Whether `chunk`, queued now, shares a call with chunks already queued. `_take_call` packs
        each kind's queued chunks into calls in order, a new call where the next does not fit, so the
        chunk joins the last call of its kind if that has room."""
        limit, fill = self.max_batch_samples, 0
        for queued in peer.queue:
            if self._same_call(chunk, queued):
                fill = queued.samples if fill + queued.samples > limit else fill + queued.samples
        return fill > 0 and fill + chunk.samples <= limit

    def _start_call(self, peer: PeerState, parts: list[Chunk]) -> None:
        """One call for several chunks: one per-call cost and each part's compute."""
        now = self.engine.now_s
        peer.busy = True
        peer.busy_since_s = now
        duration = self.call_overhead_s
        for chunk in parts:
            duration += self._duration(peer, chunk)
        self.batched_calls += 1
        self.batched_chunks += len(parts)
        self.engine.schedule(now + duration, self._on_call_computed, parts, parts[0].attempt)

    def _time_out(self, chunk: Chunk, peer: PeerState, when_s: float, expected_s: float) -> None:
        peer.held.pop(chunk.id, None)
        chunk.attempt += 1
        chunk.avoid = peer.index
        chunk.expected_s = expected_s
        self.engine.schedule(when_s, self._on_timeout, chunk, chunk.attempt)

    def _on_timeout(self, chunk: Chunk, attempt: int) -> None:
        if attempt != chunk.attempt:
            return
        self.metrics.counts["timeouts"] += 1
        self.on_computed_report(chunk, self.peers[chunk.avoid], self._weight(chunk), chunk.expected_s)
        chunk.src = -1
        self.dispatch(chunk)
        chunk.avoid = -1

    def _on_computed(self, chunk: Chunk, attempt: int) -> None:
        if attempt != chunk.attempt:
            return
        # `_end_call` and `_hand_back` written out: this runs for every call of every chunk
        now = self.engine.now_s
        peer = self.peers[chunk.peer]
        s = chunk.stage
        since = peer.busy_since_s if peer.busy_since_s > self._last_sample_s else self._last_sample_s
        self.metrics.stage_busy_s[s] += now - since
        peer.busy = False
        del peer.held[chunk.id]
        self.on_computed_report(
            chunk, peer, self._weight(chunk), self._answered_s(peer, chunk, now) - chunk.sent_s
        )
        if chunk.log is not None:
            chunk.log.append((s, chunk.backward or s == self.last))
        if peer.queue:
            if self.max_batch_samples:
                self._start_next(peer)
            else:
                self._start_compute(peer, peer.queue.popleft())
        self._advance(peer, chunk)

    def _on_call_computed(self, parts: list[Chunk], attempt: int) -> None:
        """A batched call is done: every part's results go on, as if each had been its own call."""
        first = parts[0]
        # Only `abandon` voids a queued or computing chunk, and it voids all the peer holds at once:
        # the first part stands for the call.
        if attempt != first.attempt:
            return
        peer = self.peers[first.peer]
        self._end_call(peer, first.stage)
        for chunk in parts:
            self._hand_back(peer, chunk)
        if peer.queue:
            self._start_next(peer)  # batching is on: only `_start_next` makes batched calls
        for chunk in parts:
            self._advance(peer, chunk)

    def _end_call(self, peer: PeerState, stage: int) -> None:
        """Busy time counts once per call, however many chunks it held."""
        since = peer.busy_since_s if peer.busy_since_s > self._last_sample_s else self._last_sample_s
        self.metrics.stage_busy_s[stage] += self.engine.now_s - since
        peer.busy = False

    def _hand_back(self, peer: PeerState, chunk: Chunk) -> None:
        """The peer answers the chunk's request."""
        del peer.held[chunk.id]
        # What a trainer measures: the request until the response is back, so the output's wait on this
        # peer's uplink counts (otherwise a peer with a slow uplink looks fast and gets flooded).
        answered_s = self._answered_s(peer, chunk, self.engine.now_s)
        self.on_computed_report(chunk, peer, self._weight(chunk), answered_s - chunk.sent_s)
        if chunk.log is not None:
            chunk.log.append((chunk.stage, chunk.backward or chunk.stage == self.last))

    def _advance(self, peer: PeerState, chunk: Chunk) -> None:
        """The chunk, computed at its stage on `peer`, goes to its next stage (or home)."""
        s = chunk.stage
        chunk.src = peer.index
        if not chunk.backward and s < self.last:
            chunk.path[s] = peer.index
            chunk.path_epoch[s] = peer.epoch
            chunk.stage = s + 1
            self.dispatch(chunk)
            return
        self.steps.progress(s, chunk, peer)
        if s == 0:
            self._finish(chunk)
            return
        chunk.backward = True
        chunk.stage = s - 1
        self.dispatch(chunk)

    def _finish(self, chunk: Chunk) -> None:
        if chunk.log is not None:
            self.audited_chunks += 1
            expected = [(s, s == self.last) for s in range(self.num_stages)] + [
                (s, True) for s in range(self.last - 1, -1, -1)
            ]
            if chunk.log != expected:
                self.audit_violations += 1
        self.steps.returned(chunk)
        self.on_chunk_done(chunk)

    # membership --------------------------------------------------------------------------------
    def start_serving(self, peer: PeerState, stage: int) -> None:
        peer.serving = True
        peer.stage = stage
        self.members[stage][peer.index] = peer
        self.metrics.serving_changed(self.engine.now_s, stage, +1)
        if self.waiting[stage]:
            parked, self.waiting[stage] = self.waiting[stage], []
            for chunk in parked:
                self.engine.schedule(self.engine.now_s, self.dispatch, chunk)

    def stop_serving(self, peer: PeerState) -> None:
        if not peer.serving:
            return
        self.members[peer.stage].pop(peer.index, None)
        self.metrics.serving_changed(self.engine.now_s, peer.stage, -1)
        peer.serving = False
        self._membership_changed = True

    def abandon(self, peer: PeerState) -> list[Chunk]:
        """Void everything the peer holds (queued, computing, arriving); the caller re-sends them. A
        batched call's parts stay in `held` until the call ends, so a call of several chunks is voided
        whole (`_on_call_computed` sees the first part's new attempt)."""
        now = self.engine.now_s
        if peer.busy:
            start = peer.busy_since_s if peer.busy_since_s > self._last_sample_s else self._last_sample_s
            if peer.stage >= 0:
                self.metrics.stage_busy_s[peer.stage] += now - start
            peer.busy = False
        peer.backlog_until_s = now
        chunks = list(peer.held.values())
        peer.held.clear()
        peer.queue.clear()
        for chunk in chunks:
            chunk.attempt += 1
            chunk.src = -1
            self.metrics.counts["reroutes"] += 1
        return chunks

    def reroute_later(self, chunks: list[Chunk], delay_s: float) -> None:
        when = self.engine.now_s + delay_s
        for chunk in chunks:
            self.engine.schedule(when, self._reroute, chunk, chunk.attempt)

    def _reroute(self, chunk: Chunk, attempt: int) -> None:
        if attempt == chunk.attempt:
            self.dispatch(chunk)
