"""What every mode shares: settings, peer state, churn delivery, periodic sampling of the optimum.

A mode subclasses `Simulation` and implements `setup`, `on_join` and `on_depart`; the base applies the
churn schedule, keeps the link model and metrics, and samples throughput against the optimum of the
live peers (recomputed only when membership changed since the last sample).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from swarmtrain.sim.churn import ChurnSchedule
from swarmtrain.sim.costs import STAGE_EXCHANGES, RateTable, StageCosts
from swarmtrain.sim.engine import EventQueue
from swarmtrain.sim.entities import Fleet, PeerSpec
from swarmtrain.sim.metrics import Metrics, SimResult
from swarmtrain.sim.network import Endpoint, Network
from swarmtrain.sim.optimal import optimal_allocation
from swarmtrain.utils.rng import make_rng

MODES = ("swarm", "swarm-no-rebalance", "gpipe", "async-replicas")


@dataclass(frozen=True)
class SimConfig:
    """Knobs of one simulation. `None` means: derived from the fleet and model (see `runner`)."""

    mode: str = "swarm"
    duration_s: float = 3600.0
    seed: int = 0
    chunk_samples: int | None = None  # samples routed together as one simulated micro-batch
    event_budget: int = 1_500_000  # target event count when `chunk_samples` is derived
    in_flight: int | None = None  # micro-batches in flight over all trainers (SWARM)
    in_flight_per_peer: float = 3.0
    num_trainers: int | None = None
    rebalance_period_s: float = 60.0
    rebalance_jitter: float = 0.1
    rebalance_margin: float = 0.1
    max_moves_per_tick: int | None = None  # None: every move the plan wants, as live servers do
    fail_detect_s: float = 5.0  # a failed peer's requests are retried elsewhere after this
    request_timeout_s: float = 30.0  # per micro-batch of the config; scaled by chunk size (see pipeline)
    num_samples: int = 120  # points of the time series
    average_every_steps: int = 50  # async replicas: local steps between averaging rounds
    local_batch_samples: int | None = None  # async replicas: samples per local step
    # async replicas: bytes per parameter of the averaging payload (2: fp16; the runtime's 8-bit codec
    # sends 1 + 4/256, see `costs.BYTES_PER_VALUE`)
    replica_averaging_bytes_per_param: float = 2.0
    # SWARM and GPipe data path. False (default): boundary tensors go from peer to peer and trainers have
    # unlimited links. True: as the runtime does it, the trainer relays every boundary tensor (peer ->
    # trainer -> next peer), sends a stage's input again with each backward and the labels with the last
    # stage's request, over its own link of `trainer_link_bytes_per_s` each way.
    relay_via_trainer: bool = False
    trainer_link_bytes_per_s: float = float("inf")
    # SWARM steps. None (default): delayed updates, a stage's gradient all-reduce overlaps its next
    # micro-batches. k >= 0: as the runtime's training.max_staleness, a stage runs the forward of a
    # micro-batch of step s only after it has applied step s - 1 - k, and applies a step once all of its
    # samples finished there and its peers exchanged their gradients (0: the runtime's default)
    max_staleness: int | None = None
    # how a stage's peers exchange gradients (sim/costs.py): "butterfly", SWARM's fp16 all-reduce, or
    # "all-to-all", the live runtime's sums to every stage peer in the run's swarm.exchange_compression
    stage_exchange: str = "butterfly"
    gpipe_micro_batches: int | None = None  # chunks per pipeline step
    # Variability (coefficient of variation, gamma-distributed, mean kept) of each compute task and
    # each transfer's latency in SWARM and GPipe modes; 0 = deterministic.
    compute_cv: float = 0.0
    latency_cv: float = 0.0
    # SWARM and GPipe stage requests. `call_overhead_s`: a fixed cost of every compute call on a peer
    # (Python, dispatch, kernel launches), added to the call's samples / rate. `max_batch_samples` > 0:
    # a peer starting a call takes its oldest queued chunk and the oldest queued chunks of the same
    # stage, kind (forward or backward) and step after it, up to this many samples, as one call (the
    # live server's --max-batch-tokens); 0 = every chunk is its own call. Batching saves only the
    # per-call cost: with `call_overhead_s` 0 it saves no compute, and as a call's first parts wait for
    # the whole call, it can cost throughput where the micro-batches in flight do not cover that wait.
    call_overhead_s: float = 0.0
    max_batch_samples: int = 0
    audit: bool = False  # record every micro-batch's stage visits (tests)
    record_events: bool = False  # keep (time, seq, handler) of every event; summary gets its digest

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if not (0 <= self.compute_cv < 10 and 0 <= self.latency_cv < 10):
            raise ValueError("compute_cv and latency_cv must be in [0, 10)")
        if not 0 <= self.call_overhead_s < float("inf"):  # written so that NaN fails too
            raise ValueError(
                f"call_overhead_s must be a finite number of seconds >= 0, got {self.call_overhead_s}"
            )
        if self.max_batch_samples < 0:
            raise ValueError(f"max_batch_samples must be >= 0 (0: no batching), got {self.max_batch_samples}")
        if self.stage_exchange not in STAGE_EXCHANGES:
            raise ValueError(f"stage_exchange must be one of {', '.join(STAGE_EXCHANGES)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be None or >= 0")
        if not self.replica_averaging_bytes_per_param > 0 or not self.trainer_link_bytes_per_s > 0:
            raise ValueError(
                "replica_averaging_bytes_per_param and trainer_link_bytes_per_s must be positive"
            )


class PeerState(Endpoint):
    """A peer's dynamic state. Events that refer to a peer carry its `epoch` and are void once it changes."""

    __slots__ = (
        "index",
        "spec",
        "live",
        "serving",
        "stage",
        "epoch",
        "queue",
        "busy",
        "busy_since_s",
        "held",
        "compute_s",
        "rates",
        "samples_since_step",
        "home_stage",
        "group",
        "backlog_until_s",
    )

    def __init__(self, index: int, spec: PeerSpec, compute_s: tuple[float, ...], rates: tuple[float, ...]):
        super().__init__(spec.location, spec.uplink_bytes_per_s, spec.downlink_bytes_per_s)
        self.index = index
        self.spec = spec
        self.live = False
        self.serving = False
        self.stage = -1
        self.epoch = 0
        self.queue: deque = deque()
        self.busy = False
        self.busy_since_s = 0.0
        self.held: dict[int, object] = {}
        self.compute_s = compute_s
        self.rates = rates  # samples/s at each stage without averaging traffic (what it announces)
        self.samples_since_step = 0.0
        self.home_stage = -1
        self.group = -1  # pipeline index (gpipe)
        self.backlog_until_s = 0.0  # when the compute already accepted (FIFO) will be done


Observer = Callable[["Simulation", float], None]


class Simulation:
    def __init__(
        self,
        fleet: Fleet,
        costs: StageCosts,
        config: SimConfig,
        schedule: ChurnSchedule,
        compute_s: list[tuple[float, ...]],
        table: RateTable,
        chunk_samples: int,
    ) -> None:
        self.fleet, self.costs, self.config, self.schedule = fleet, costs, config, schedule
        self.num_stages = costs.num_stages
        self.table = table
        self.chunk_samples = chunk_samples
        self.engine = EventQueue()
        self.network = Network(fleet.locations)
        self.rng = make_rng(config.seed, "sim", config.mode)
        base_rates = table.rates(costs, 0.0).tolist()
        self.peers = [
            PeerState(i, spec, compute_s[i], tuple(base_rates[i])) for i, spec in enumerate(fleet.peers)
        ]
        self.metrics = Metrics(self.metrics_stages())
        self._membership_changed = True
        self._optimum = 0.0
        self._observer: Observer | None = None

    # to implement ------------------------------------------------------------------------------
    def metrics_stages(self) -> int:
        return self.num_stages

    def setup(self) -> None:
        raise NotImplementedError

    def on_join(self, peer: PeerState) -> None:
        raise NotImplementedError

    def on_depart(self, peer: PeerState, graceful: bool) -> None:
        raise NotImplementedError

    def finish_accounting(self, now_s: float) -> None:
        """Attribute compute still in progress at a sample point to the interval that ends."""
        for peer in self.peers:
            if peer.busy and peer.stage >= 0:
                start = max(peer.busy_since_s, self._last_sample_s)
                self.metrics.stage_busy_s[self.metric_stage(peer)] += now_s - start

    def metric_stage(self, peer: PeerState) -> int:
        return peer.stage

    # run ---------------------------------------------------------------------------------------
    def live_indices(self) -> np.ndarray:
        return np.array([p.index for p in self.peers if p.live], dtype=np.int64)

    def optimum(self) -> float:
        if self._membership_changed:
            alloc = optimal_allocation(self.table, self.costs, self.live_indices())
            self._optimum = alloc.throughput_samples_per_s
            self._membership_changed = False
        return self._optimum

    def audit(self) -> dict:
        """Chunks whose path was checked against the pipeline's order (`SimConfig.audit`), and misses."""
        return {"chunks": 0, "violations": 0}

    def run(self, observer: Observer | None = None) -> SimResult:
        """`observer(sim, now_s)`: called at each sample point the metrics recorded (a timeline's frame)."""
        self._observer = observer
        cfg = self.config
        for i, peer in enumerate(self.peers):
            peer.live = i not in self.schedule.initially_offline
        self.setup()
        for event in self.schedule.events:
            if event.time_s <= cfg.duration_s:
                self.engine.schedule(event.time_s, self._on_churn, event.peer, event.event)
        interval = cfg.duration_s / cfg.num_samples
        self._last_sample_s = 0.0
        for k in range(1, cfg.num_samples + 1):
            self.engine.schedule(k * interval if k < cfg.num_samples else cfg.duration_s, self._on_sample)
        if cfg.record_events:
            self.engine.trace = []
        self.engine.run(cfg.duration_s)
        summary = self.metrics.summary(cfg.duration_s, self.engine.events_processed)
        if self.engine.trace is not None:
            text = "\n".join(f"{t!r} {seq} {name}" for t, seq, name in self.engine.trace)
            summary["event_digest"] = hashlib.sha256(text.encode()).hexdigest()
        summary.update(mode=cfg.mode, chunk_samples=self.chunk_samples, num_peers=len(self.peers))
        return SimResult(cfg.mode, self.metrics.num_stages, cfg.duration_s, summary, self.metrics.series)

    def _on_sample(self, _a, _b) -> None:
        now = self.engine.now_s
        self.finish_accounting(now)
        live = sum(1 for p in self.peers if p.live)
        recorded = self.metrics.sample(now, self.optimum(), live)
        self._last_sample_s = now
        if recorded and self._observer is not None:
            self._observer(self, now)

    def _on_churn(self, index: int, event: str) -> None:
        peer = self.peers[index]
        self._membership_changed = True
        if event == "join":
            if peer.live:
                return
            peer.live = True
            peer.epoch += 1
            peer.clear(self.engine.now_s)  # a new machine: empty link queues
            self.metrics.counts["joins"] += 1
            self.on_join(peer)
        else:
            if not peer.live:
                return
            peer.live = False
            self.metrics.counts["leaves" if event == "leave" else "failures"] += 1
            self.on_depart(peer, graceful=event == "leave")
            peer.epoch += 1

    # shared helpers ----------------------------------------------------------------------------
    def charge_bytes(self, kind: str, num_bytes: float) -> None:
        self.metrics.bytes_by_kind[kind] += num_bytes

    def download_state(self, peer: PeerState, sources, num_bytes: float) -> float:
        """Fetch `num_bytes` of state from the source that would finish soonest (ties: first listed);
        with no live source, from the trainers' checkpoint store (unlimited uplink). Returns arrival."""
        now = self.engine.now_s
        best, best_end = None, float("inf")
        for source in sources:
            end = max(source.up_free_s, now) + num_bytes / source.up_bytes_per_s
            if end < best_end:
                best, best_end = source, end
        if best is None:
            best = Endpoint(peer.location, float("inf"), float("inf"))
        self.charge_bytes("state", num_bytes)
        return self.network.transfer(now, best, peer, num_bytes)
