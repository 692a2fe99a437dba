"""One replica of one pipeline stage, as a container of parts: it assembles them and runs their life
cycle, and its handler table is the union of theirs. It knows nothing of moves: the server process
(runtime/server/server_process.py) builds one, serves it, drains it and closes it, and builds another
when the balancer moves the peer.

Parts: the worker (stage_worker.py: tensors, buckets, optimizer) and the compute thread (compute.py);
the step exchange (stage_steps.py decides, stage_exchange.py talks to the stage peers and handles
`close`, `grads`, `step_means`, `ping`); the synchronizer (stage_sync.py: join, resync, adoption) with
its catch-up (stage_catch_up.py: what a replica behind its stage does, reaching the step exchange
through one port, `StepsBridge`) and the checkpointer; the micro-batch desk (stage_desk.py: every
micro-batch kind, admission, compute; built when the stage starts serving, with its hop to the next
stage); the status part (stage_status.py: one snapshot from which `info`, the DHT announcement and the
metrics derive).

Life cycle:
- `StageService(...)` builds the stage from the run config, starts the averager (a forked process:
  nothing of the transport may exist yet, see `release_p2p_replica`) and the compute thread, and takes
  the stage's state from its live replicas, else its newest checkpoint, else initial weights (refused
  once the swarm has stepped). A constructed service is complete; one that fails half-way stops what it
  had started.
- `start_serving(transport)` gives it the process's transport: the chain hop to the next stage, the
  step exchange and the sync thread start, and `handlers` answer.
- `drain()` stops taking micro-batches, says so in the DHT and waits for the running ones and for the
  exchange of every step it holds samples of; `stop_serving()` stops its tasks; `close()` writes the
  last checkpoint and stops the averager and the threads. The DHT node, the transport and the event
  loop belong to the process and outlive the service.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError
from swarmtrain.model.device import CPU_FP32, ComputeDevice, busy_clock_s
from swarmtrain.net.dht_records import RunRecords, StageAnnouncement, progress_key, stage_key
from swarmtrain.net.engine import shutdown_quietly
from swarmtrain.net.link_meter import DOWN, UP, LinkMeter
from swarmtrain.net.protocol import (
    BUNDLE_KIND,
    TRAINING_KINDS,
    Message,
    StageIO,
    make_message,
    max_grads_message_bytes,
    namespace,
)
from swarmtrain.planner.catch_up import KEEP_STEPS_AHEAD, evidence_ttl_s
from swarmtrain.planner.download_deadline import DEFAULT_RULE, DownloadRule
from swarmtrain.planner.link_capacity import COMPUTE, DOWNLINK, UPLINK, limited_capacity
from swarmtrain.runtime.faults import FaultHooks
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.server.capacity import CapacityMeter, LinkCapacityMeter
from swarmtrain.runtime.server.chain_hop import ChainHop, HopClients, StagePeers
from swarmtrain.runtime.server.compute import (
    PRIORITY_BACKWARD,
    PRIORITY_FORWARD,
    PRIORITY_SYNC,
    ComputeWorker,
)
from swarmtrain.runtime.server.server_metrics import ServerMetrics
from swarmtrain.runtime.server.stage_batches import probe_samples_per_s
from swarmtrain.runtime.server.stage_catch_up import StepsBridge
from swarmtrain.runtime.server.stage_checkpoint import checkpointer_for
from swarmtrain.runtime.server.stage_desk import Admission, Handler, MicroBatchDesk
from swarmtrain.runtime.server.stage_exchange import StagePeerLink, StepExchange
from swarmtrain.runtime.server.stage_members import LiveReplicas, keep_live_replicas_fresh, read_live_replicas
from swarmtrain.runtime.server.stage_replies import finished
from swarmtrain.runtime.server.stage_status import (
    CacheUsage,
    StageSnapshot,
    announcement_of,
    info_header,
    metrics_of,
)
from swarmtrain.runtime.server.stage_steps import StepCoordinator, StepSettings
from swarmtrain.runtime.server.stage_sync import StageSynchronizer, SyncSettings
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.runtime.server.step_rate import Utilization
from swarmtrain.runtime.server.sums_codec import SumsCodec
from swarmtrain.utils.logging import get_logger

if TYPE_CHECKING:  # hivemind is imported only once the process has prepared its environment
    from swarmtrain.net.data_plane import DataPlaneClient
    from swarmtrain.net.transport import StageClient, TransportStats

logger = get_logger(__name__)

DRAIN_POLL_S = 0.05
# a record lives this many announce periods: one missed announcement does not drop a live server
ANNOUNCE_TTL_PERIODS = 3


@dataclass(frozen=True)
class StageOptions:
    """How the process builds every stage it serves (the command line's settings)."""

    cache_size: int = 64
    cache_max_bytes: int | None = None  # None: the device's default (StageWorker)
    max_batch: int | None = None  # default: 4 micro-batches
    sync_tick_s: float = 0.5
    min_matchmaking_time_s: float = 1.0
    checkpoint_dir: str | None = None  # default: the run config's swarm.checkpoint_dir (empty: none)
    fresh_start: bool = False  # initial weights even when the swarm has stepped (said loudly)
    init_from_hf: str | None = None  # initial weights from this Hugging Face model directory
    compute: ComputeDevice = CPU_FP32  # where the stage computes and in what dtype (--device, --dtype)
    max_batch_tokens: int = 0  # queued requests of one kind and step share a call up to this (0: off)
    # how long a join or resync waits for donors (--state-download-min-mbit, --state-download-base-s)
    download_rule: DownloadRule = DEFAULT_RULE


@dataclass(frozen=True)
class Node:
    """What the process lends a service: its DHT node and identity, the run's records, its ledger and
    its event loop (the step exchange runs on it; it exists before it runs)."""

    dht: object
    peer_id: str
    addresses: list[str]
    records: RunRecords
    ledger: Ledger
    loop: asyncio.AbstractEventLoop
    private: bool  # a run key: the stage's state goes only to peers announced (signed) at the stage
    behind_nat: bool = False  # announced through relays (--auto-relay): it dials the peers that call it


@dataclass(frozen=True)
class Transport:
    """The process's RPC endpoints while it serves."""

    client: StageClient
    stats: TransportStats
    data: DataPlaneClient | None = None  # hand-offs to the next stage, where it has a data plane
    data_port: int = 0  # our data plane's, announced; 0: none (off, or behind a NAT)
    # the bounds on callers' requests (net/server_bounds.py, the data plane's connection limits) and what
    # callers hold against them now: `info`'s `data_plane`
    request_status: Callable[[], dict] | None = None
    link_meter: LinkMeter | None = None  # what the data plane's links carried (link capacity)


class StageService:
    def __init__(
        self,
        cfg: RunConfig,
        stage: int,
        options: StageOptions,
        node: Node,
        faults: FaultHooks,
        on_fatal: Callable[[str], None],
        start_samples_per_s: float | None = None,
    ) -> None:
        """`on_fatal(reason)`: the sync thread found the stage unusable (the process stops serving);
        `start_samples_per_s`: the capacity to announce until measured (None: a short forward-only
        measurement now)."""
        specs = cfg.stages()
        if not 0 <= stage < len(specs):
            raise UserError(f"--stage {stage} outside 0..{len(specs) - 1} for this run config")
        self.cfg, self.options, self.spec, self.node = cfg, options, specs[stage], node
        self._start_samples_per_s = start_samples_per_s
        self.faults, self._on_fatal = faults, on_fatal
        self.digest = cfg.digest()
        self.peer_id = node.peer_id
        max_batch = options.max_batch or 4 * cfg.training.micro_batch_size
        self.io = StageIO.from_config(cfg.model, self.spec, max_batch, options.compute.device)
        self._transport: Transport | None = None
        self.hop: ChainHop | None = None  # this stage's part of direct hand-offs, while serving
        self.callers: StagePeers | None = None  # behind a NAT: the stage before, kept connected
        self._tasks: list[asyncio.Task] = []
        with ExitStack() as undo:  # a failure half-way stops what was started, in reverse order
            self._build(undo)
            undo.pop_all()  # complete: from here `close()` stops it all

    def _build(self, undo: ExitStack) -> None:
        from swarmtrain.net.averaging import StageAverager

        options, cfg, node = self.options, self.cfg, self.node
        self.worker = StageWorker(
            cfg,
            self.spec,
            options.cache_size,
            node.ledger,
            options.cache_max_bytes,
            init_from_hf=options.init_from_hf,
            fault_grad_scale=self.faults.grad_scale,
            compute=options.compute,
            overlap_sends=options.compute.device.type == "cuda",  # the sending half of the overlap
        )
        self.compute = compute_thread(self.worker, options.max_batch_tokens)
        self.capacity = CapacityMeter(
            self._start_samples_per_s or probe_samples_per_s(self.worker, cfg, options.compute),
            min_samples=4 * cfg.training.micro_batch_size,
            warmup_samples=4 * cfg.training.micro_batch_size,
        )
        self.link_capacity = LinkCapacityMeter(
            min_samples=4 * cfg.training.micro_batch_size,
            warmup_samples=4 * cfg.training.micro_batch_size,
        )
        self.utilization = Utilization()  # how busy its compute thread and links are (announced)
        self.averager = StageAverager(
            self.worker.params,
            node.dht,
            prefix=f"{namespace(cfg)}_s{self.spec.index}",
            state_provider=self.worker.export_state,
            min_matchmaking_time_s=options.min_matchmaking_time_s,
            request_timeout_s=min(0.5, options.min_matchmaking_time_s / 2),
            allreduce_timeout_s=cfg.swarm.averaging_timeout_s,
            members_keys=self._stage_keys() if node.private else (),
        )
        undo.callback(shutdown_quietly, self.averager)
        self.compute.start()
        undo.callback(self.compute.stop)
        self.checkpointer = checkpointer_for(
            cfg, options.checkpoint_dir, self.spec, self.digest, self.worker.export_state
        )
        if self.checkpointer is not None:
            undo.callback(self.checkpointer.close)
        # who may be named in a close or send us gradients: read from the DHT off the event loop
        self.live_replicas = LiveReplicas(keep_s=(ANNOUNCE_TTL_PERIODS + 1) * cfg.swarm.announce_period_s)
        self.link = StagePeerLink(
            self.spec,
            self.digest,
            self.worker,
            self.faults,
            averaging_timeout_s=cfg.swarm.averaging_timeout_s,
            request_timeout_s=cfg.swarm.request_timeout_s,
        )
        self.steps = StepCoordinator(
            self.worker,
            self.compute,
            self.peer_id,
            self.link.send_grads,
            StepSettings(
                close_timeout_s=cfg.swarm.request_timeout_s, exchange_timeout_s=cfg.swarm.averaging_timeout_s
            ),
            node.ledger,
            on_step=self._step_applied,
            loop=node.loop,
            alive=self.link.answers_ping,
            live_replicas=self.live_replicas,
            verify=self.link.is_stage_replica,
            # an honest close is at most 1 + max_staleness steps past a replica still exchanging the
            # step before, but a replica that was frozen is behind by more and catches up by steps: a
            # close it refuses now is one it waits for when it gets there, which no trainer sends again
            close_window=max(KEEP_STEPS_AHEAD, 1 + cfg.training.max_staleness),
            sums_codec=SumsCodec(cfg.swarm.exchange_compression),
        )
        self.sync = self._make_synchronizer()
        undo.callback(self.sync.stop)
        self.admission = Admission(self.sync.serving.is_set)
        node.ledger.write("start", peer=self.peer_id, stage=self.spec.index)
        self._warn_about_foreign_peers()
        self.sync.join()
        self._read_live_replicas = partial(read_live_replicas, node.records, self.spec.index, self.digest)
        self.live_replicas.update(self._read_live_replicas())
        # the step exchange's handlers and info; the micro-batch desk's join them once it serves
        exchange = StepExchange(self.spec, self.digest, self.worker, self.steps, self.link)
        self.handlers: dict[str, Handler] = {"info": self._on_info, **exchange.handlers}

    def _make_synchronizer(self) -> StageSynchronizer:
        swarm = self.cfg.swarm
        settings = SyncSettings(
            tick_s=self.options.sync_tick_s,
            heartbeat_s=max(0.5, swarm.announce_period_s / 2),
            progress_ttl_s=max(3.0, 2 * swarm.announce_period_s),
            num_stages=swarm.num_stages,
            allow_fresh=self.options.fresh_start,
            download_rule=self.options.download_rule,
            stranded_grace_s=swarm.request_timeout_s,
            close_timeout_s=swarm.request_timeout_s,
            evidence_ttl_s=evidence_ttl_s(swarm.request_timeout_s, swarm.averaging_timeout_s),
        )
        return StageSynchronizer(
            self.worker,
            self.compute,
            self.averager,
            self.node.records,
            self.peer_id,
            self.digest,
            settings,
            self.node.ledger,
            checkpoints=self.checkpointer,
            on_fatal=self._on_fatal,
            steps=StepsBridge(self.steps, self.link, self.node.loop),
        )

    def _step_applied(
        self, epoch: int, fingerprint: list[float] | None, live: bool, own_samples: int
    ) -> None:
        self.sync.step_applied(epoch, fingerprint, own_samples)
        if self.checkpointer is not None:
            self.checkpointer.after_step(self.worker.epoch, live)

    def _warn_about_foreign_peers(self) -> None:
        for peer, ann in self.node.records.stage_peers(self.spec.index).items():
            if ann.config_digest != self.digest:
                logger.warning(
                    "peer %s serves stage %d with config digest %s, ours is %s: it is ignored "
                    "(different model, stage cut or optimizer settings)",
                    peer,
                    self.spec.index,
                    ann.config_digest,
                    self.digest,
                )

    def _stage_keys(self) -> tuple[str, ...]:
        run, i = self.cfg.swarm.run_id, self.spec.index
        return (stage_key(run, i), progress_key(run, i))

    # serving ------------------------------------------------------------------------------------
    @property
    def max_message_bytes(self) -> int:
        """The largest request this stage accepts: a micro-batch, or a replica's gradient sums."""
        params = self.worker.params
        grads_bytes = max_grads_message_bytes(sum(p.numel() for p in params), len(params))
        return max(self.io.max_message_bytes(), grads_bytes)

    @property
    def serving(self) -> bool:
        return self.sync.serving.is_set()

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def start_serving(self, transport: Transport) -> None:
        """(on the process's event loop) Take requests through `transport` from now on."""
        self._transport = transport
        self.link.attach(transport.client)
        if not self.spec.is_last:
            next_stage = StagePeers(self.node.records, self.spec.index + 1, self.digest, transport.client)
            self.hop = ChainHop(
                self.worker,
                self.compute,
                HopClients(transport.client, transport.data),
                next_stage,
                self.io,
                self.digest,
                self.cfg.swarm.num_stages,
                self.peer_id,
            )
        if self.node.behind_nat and self.spec.index > 0:
            self.callers = StagePeers(
                self.node.records, self.spec.index - 1, self.digest, transport.client, redial=True
            )
        desk = MicroBatchDesk(
            self.cfg,
            self.spec,
            self.io,
            self.digest,
            self.worker,
            self.compute,
            self.steps,
            self.sync.catch_up,
            self.admission,
            self.hop,
        )
        self.handlers.update(desk.handlers)
        self.sync.start()
        self._tasks.append(asyncio.create_task(self.steps.run()))
        refresh = keep_live_replicas_fresh(
            self.live_replicas, self._read_live_replicas, self.cfg.swarm.announce_period_s
        )
        self._tasks.append(asyncio.create_task(refresh))
        self.capacity.restart(self.admission.samples_done, self._work_s())

    async def refresh_neighbours(self) -> None:
        """The next stage's peers (where hand-offs may go) and, behind a NAT, connections to the stage
        before (the peers whose hand-offs come here)."""
        if self.hop is not None:
            await self.hop.next_stage.refresh()
        if self.callers is not None:
            await self.callers.refresh()

    async def drain(self, timeout_s: float) -> None:
        """Serve no new micro-batch and leave without losing work: trainers are told at once (an offline
        record; new micro-batches and parked forwards are answered `unavailable`, which they retry on
        another replica without waiting), micro-batches already computing finish, and we stay for the
        exchange of every step we hold samples of. Stopping with requests unanswered would stall the
        whole swarm for the trainer's request timeout (30 s, bench/rebalance_live.py)."""
        loop = asyncio.get_running_loop()
        self.admission.draining = True
        # joiners stop picking us as a donor at once (idle, a declaration would list us for up to 35 s)
        with suppress(OSError):  # an averager process that died lists nobody any more
            self.averager.allow_state_sharing = False
        self.steps.versions.changed()  # parked forwards see that we are leaving
        await loop.run_in_executor(None, lambda: self.announce(state="offline"))
        deadline_s = time.monotonic() + timeout_s
        while self.admission.running or self.worker.unapplied_samples:
            if time.monotonic() > deadline_s:
                logger.warning(
                    "left the stage with %d request(s) running and %d sample(s) unapplied",
                    self.admission.running,
                    self.worker.unapplied_samples,
                )
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def stop_serving(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def close(self) -> None:
        """Stop the sync thread, write the last checkpoint, stop the compute thread and the averager."""
        self.sync.stop()
        self._final_checkpoint()
        self.compute.stop()
        shutdown_quietly(self.averager)

    def _final_checkpoint(self) -> None:
        """On a graceful stop, the state as it is (a whole-swarm restart then loses nothing); never
        the initial weights, which are no checkpoint of anything."""
        if self.checkpointer is None:
            return
        try:
            if not self.sync.untrained:
                self.checkpointer.save_and_wait(self.worker.epoch)
        except Exception:
            logger.exception("final checkpoint failed")
        finally:
            self.checkpointer.close()

    # info -------------------------------------------------------------------------------------
    async def _on_info(self, message: Message, _context) -> Message:
        return await self.compute.run(lambda: self._info(message), PRIORITY_SYNC)

    def _info(self, message: Message) -> Message:
        """Counters, and on request the parameters or the pending gradient sums (tests, monitor)."""
        w = self.worker
        want = message.header.get("want")
        tensors = {}
        if want == "params":
            tensors = {name: p.detach().cpu() for name, p in zip(w.names, w.params, strict=True)}
        elif want == "grads":
            tensors = dict(zip(w.names, w.unapplied_grad_sums(), strict=True))  # sums over pending_samples
        return make_message("result", info_header(self.snapshot(), w.names), tensors, "none")

    # status: one snapshot, from which info, the announcement and the metrics derive ------------------
    def snapshot(self, work_s: float | None = None) -> StageSnapshot:
        """`work_s`: `_work_s()` when the caller has just read it (a read walks the transport's stats)."""
        from swarmtrain.net.transport import ByteCount, TransportStats

        w, transport = self.worker, self._transport
        stats = transport.stats if transport is not None else TransportStats()
        sent = stats.sent() if transport is not None else ByteCount()
        links = self.link_capacity
        capacity, limit = limited_capacity(
            self.capacity.samples_per_work_s, links.uplink_samples_per_s, links.downlink_samples_per_s
        )
        swarm_samples_per_s = self.steps.step_rate.samples_per_s(time.monotonic())
        return StageSnapshot(
            stage=self.spec.index,
            digest=self.digest,
            peer_id=self.peer_id,
            addresses=self.node.addresses,
            behind_nat=self.node.behind_nat,
            data_port=transport.data_port if transport is not None else 0,
            device=self.options.compute.describe(),
            epoch=w.epoch,
            samples_seen=w.samples_seen,
            pending_samples=w.unapplied_samples,
            serving=self.serving,
            draining=self.draining,
            capacity_samples_per_s=capacity,
            limit=limit,
            compute_samples_per_s=self.capacity.samples_per_work_s,
            uplink_samples_per_s=links.uplink_samples_per_s,
            downlink_samples_per_s=links.downlink_samples_per_s,
            swarm_samples_per_s=swarm_samples_per_s,
            # only while the swarm steps: an idle swarm's resources idle for want of work, not of capacity
            utilization=(self.utilization.fraction(limit) or 0.0) if swarm_samples_per_s > 0 else 0.0,
            queue_len=self.compute.queue_len,
            busy_s=self.compute.busy_s,
            work_s=self._work_s() if work_s is None else work_s,
            compute_requests=self.compute.tasks_done,
            compute_calls=self.compute.calls,
            bundles_sent=self.hop.bundles if self.hop is not None else 0,
            direct_in=stats.direct_in,
            bytes_in=stats.received().wire_bytes,
            bytes_out=sent.wire_bytes,
            fp32_bytes_out=sent.fp32_bytes,
            fingerprint=self.sync.fingerprint,
            worker=dataclasses.replace(w.counters),
            cache=CacheUsage(len(w.cache), w.cache_bytes, w.cache_max_bytes),
            sync=dataclasses.replace(self.sync.counters),
            steps=dataclasses.replace(self.steps.counters),
            data_plane=transport.request_status() if transport and transport.request_status else {},
        )

    def announce(self, state: str | None = None) -> StageAnnouncement:
        """Publish this replica's record (online, joining or offline) and return it."""
        work_s = self._work_s()
        self.capacity.update(self.admission.samples_done, work_s)
        meter = self._transport.link_meter if self._transport is not None else None
        busy_s = {COMPUTE: self.compute.busy_s}
        if meter is not None:
            totals = {d: meter.totals(d) for d in (UP, DOWN)}
            self.link_capacity.update(self.admission.samples_done, totals)
            busy_s.update({UPLINK: totals[UP].busy_s, DOWNLINK: totals[DOWN].busy_s})
        self.utilization.update(time.monotonic(), busy_s)
        announcement = announcement_of(self.snapshot(work_s), state)
        # an offline record too: the DHT replaces a record only by one that expires later, so a short-lived
        # offline record would be refused and trainers would route to a stopped server until it expired
        self.node.records.announce(self.peer_id, announcement, self.announce_ttl_s)
        self.averager.idle_slack_s = self.node.records.slack_s()  # its declaration keeps the same pace
        return announcement

    def publish_settings(self) -> None:
        """What this run's digest is made of, in its own record (every `SETTINGS_PERIOD_S`, by the server
        process): a peer of another digest names the settings that differ from it."""
        self.node.records.publish_settings(self.peer_id, self.digest, self.cfg.settings_summary())

    @property
    def announce_ttl_s(self) -> float:
        return ANNOUNCE_TTL_PERIODS * self.cfg.swarm.announce_period_s

    def announcement(self, state: str | None = None) -> StageAnnouncement:
        return announcement_of(self.snapshot(), state)

    def metrics(self) -> ServerMetrics:
        return metrics_of(self.snapshot())

    @property
    def downloaded_bytes(self) -> int:
        return self.sync.counters.downloaded_bytes

    def _work_s(self) -> float:
        """CPU seconds spent on micro-batches so far: their forward and backward jobs on the compute thread
        (stage 0's backward is a call of its own: its wall-clock busy time alone made stage 0 look 2x
        cheaper than it was) and their requests' parsing and replies' packing (runtime/server/capacity.py)."""
        by_priority = self.compute.work_s_by_priority
        compute_s = by_priority.get(PRIORITY_FORWARD, 0.0) + by_priority.get(PRIORITY_BACKWARD, 0.0)
        stats = self._transport.stats if self._transport is not None else None
        return compute_s + (stats.cpu_s((*TRAINING_KINDS, BUNDLE_KIND)) if stats is not None else 0.0)


def compute_thread(worker: StageWorker, max_batch_tokens: int) -> ComputeWorker:
    """The stage's compute thread: its busy clock reads the worker's device; when the worker's replies
    leave with their payloads still copying to the host (`Replies.overlap`, a CUDA server), its send
    thread finishes them before their callers see them (runtime/server/stage_replies.py)."""
    return ComputeWorker(
        busy_clock=partial(busy_clock_s, worker.compute.device),
        max_batch_tokens=max_batch_tokens,
        finish=finished if worker.replies.overlap else None,
    )
