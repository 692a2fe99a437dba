"""`swarmtrain server`: the long-lived process of one peer that serves pipeline stages.

The process owns what outlives a stage: the DHT node and its identity, the event loop, the ledger, the
transport (RPC endpoints over the node's libp2p daemon), the balancer and its move leases, signals and
the exit watchdogs. `run()` is its outer loop: build a `StageService` for a stage
(runtime/server/stage_service.py), serve it until SIGTERM/SIGINT or until the balancer decides to
move, drain and close it, and build the next stage's service on the same node (same peer id,
connections and process group). A service never learns that it moved; the process never touches
parameters.

Process tree: this process (asyncio loop for RPCs, one compute thread and one sync thread per service)
+ the hivemind DHT process with its p2pd + the service's averager process. Everything that forks (the
DHT, an averager) is created while this process holds no P2P replica of the daemon: the averager's
child drops the replica it inherits and with it the socket our incoming streams arrive on
(`release_p2p_replica`). So the transport is opened after a service is built and closed before the
next one is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.net.data_plane import DataPlaneClient, DataPlaneServer, connection_limits
from swarmtrain.net.dht_records import SETTINGS_PERIOD_S, RunRecords
from swarmtrain.net.dht_rejoin import keep_joined
from swarmtrain.net.engine import (
    PeerNetwork,
    peer_identity,
    release_p2p_replica,
    shutdown_quietly,
    start_dht,
    visible_addresses,
)
from swarmtrain.net.link_meter import LinkMeter
from swarmtrain.net.protocol import Message, error_message, namespace
from swarmtrain.net.server_bounds import MemoryBudget, RequestLimits, derive_bounds
from swarmtrain.net.tcp_tuning import DEFAULT_CONGESTION
from swarmtrain.net.transport import StageClient, StageServicer
from swarmtrain.runtime.faults import NO_FAULTS, FaultHooks
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.procs import (
    forked_children_die_with_me,
    reap_own_group,
    remember_group_sockets,
    start_exit_watchdog,
)
from swarmtrain.runtime.server.activity_clock import ActivityClock, stage_markers
from swarmtrain.runtime.server.balancer import Balancer, Move, MovedFrom, move_record
from swarmtrain.runtime.server.stage_choice import StageChoice
from swarmtrain.runtime.server.stage_service import Node, StageOptions, StageService, Transport
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

LEASE_POLL_S = 1.0  # how often the balancer looks for another server's new or changed move lease
DRAIN_TIMEOUT_S = 15.0
HANDLER_REMOVAL_TIMEOUT_S = 5.0
STOP_GRACE_S = 15.0  # a stop that hangs longer (a dead DHT) ends the process group
EXIT_GRACE_S = 20.0
CLOSE_GRACE_S = 120.0


@dataclass
class ServerOptions:
    stage: int
    initial_peers: list[str] = field(default_factory=list)
    network: PeerNetwork = field(default_factory=PeerNetwork)
    threads: int = 1
    ledger_path: str | None = None
    stage_choice: StageChoice | None = None  # how `--stage auto` chose `stage`, for the ledger
    metrics_period_s: float = 5.0
    stage_options: StageOptions = field(default_factory=StageOptions)  # for every stage served
    faults: FaultHooks = NO_FAULTS  # a faulty replica, for tests (runtime/faults.py)
    # the direct data plane's TCP port for hand-offs from the previous stage (0, the default: any free
    # one; None: off, hand-offs come over libp2p)
    data_port: int | None = 0
    data_congestion: str | None = DEFAULT_CONGESTION  # its TCP congestion control (None: the system's)
    # memory lent to callers' requests (--request-memory-mb; None: a share of the available memory)
    request_memory_bytes: int | None = None


@dataclass
class _Endpoints:
    """What `_open_transport` opened, for `_close_transport`."""

    p2p: Any  # hivemind's P2P replica of the node's daemon: only net/ names hivemind's types
    servicer: StageServicer
    data_server: DataPlaneServer | None = None
    data_client: DataPlaneClient | None = None
    # what this server's links carried while serving this stage: the data plane's frames and the
    # libp2p calls (net/link_meter.py, runtime/server/capacity.py)
    link_meter: LinkMeter = field(default_factory=LinkMeter)


@dataclass(frozen=True)
class _Arrival:
    """A move decided: the stage to serve next, and where from, since when, at what expected capacity."""

    stage: int
    moved: MovedFrom


class ServerProcess:
    """Complete when constructed: the DHT node, ledger, loop and balancer exist; `run()` serves."""

    def __init__(self, cfg: RunConfig, options: ServerOptions) -> None:
        self.cfg, self.options = cfg, options
        self.exit_code = 0
        self.move_cost: dict | None = None  # the last move's cost, published with the metrics
        self._lease_held = False  # a moved service's lease, released once it serves
        self._arrival: _Arrival | None = None  # how the service being served came here, if by a move
        self._stop: asyncio.Event | None = None
        # an idle stage's records are read and re-stored less often (planner/idle_pace.py)
        self.activity = ActivityClock()
        forked_children_die_with_me()  # before the DHT and the averagers fork
        torch.set_num_threads(options.threads)
        with ExitStack() as undo:  # a failure half-way stops what was started, in reverse order
            undo.callback(reap_own_group)
            self.ledger = Ledger(options.ledger_path)
            undo.callback(self.ledger.close)
            if options.stage_choice is not None:
                self.ledger.write("stage_choice", **dataclasses.asdict(options.stage_choice))
            # our libp2p key in this process too: the data plane's handshakes are signed with it
            self.identity = peer_identity(options.network)
            self.dht = start_dht(options.initial_peers, options.network, identity=self.identity)
            undo.callback(shutdown_quietly, self.dht)
            self.runner = asyncio.Runner()  # the serving loop, made after the DHT's fork
            undo.callback(self.runner.close)
            self.node = Node(
                dht=self.dht,
                peer_id=self.dht.peer_id.to_base58(),
                # fixed for our lifetime; asking a dead DHT would hang
                addresses=visible_addresses(self.dht),
                records=RunRecords(self.dht, cfg.swarm.run_id, slack_s=self.activity.slack_s),
                ledger=self.ledger,
                loop=self.runner.get_loop(),
                private=options.network.run_key is not None,
                behind_nat=options.network.use_auto_relay,
            )
            self.balancer = self._make_balancer()
            undo.pop_all()

    def _make_balancer(self) -> Balancer | None:
        swarm = self.cfg.swarm
        if swarm.rebalance_period_s <= 0:
            return None
        return Balancer(
            self.node.peer_id,
            swarm.num_stages,
            self.cfg.digest(),
            swarm.rebalance_period_s,
            swarm.rebalance_margin,
        )

    # the outer loop -----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve stage after stage until SIGTERM/SIGINT or a fatal error; returns the exit code."""
        stage, arrival = self.options.stage, None
        try:
            while True:
                service = self._build_service(stage, arrival)
                try:
                    arrival = self.runner.run(self._serve(service))
                finally:
                    self._close_service(service)
                if arrival is None:
                    return self.exit_code
                # the old stage is offline, checkpointed and its averager gone: join the new stage
                stage = arrival.stage
                del service  # released before the next stage's service is built and downloads its state
        except KeyboardInterrupt:
            return self.exit_code
        finally:
            watchdog = start_exit_watchdog(grace_s=EXIT_GRACE_S)
            self._close()
            watchdog.set()
            reap_own_group()

    def _close_service(self, service: StageService) -> None:
        # a final checkpoint of a large stage takes a while; a hang beyond that (a dead averager) ends us
        watchdog = start_exit_watchdog(grace_s=CLOSE_GRACE_S)
        service.close()
        watchdog.set()

    def _build_service(self, stage: int, arrival: _Arrival | None) -> StageService:
        self._arrival = arrival
        start_samples_per_s = None
        if arrival is not None:
            # a moved server starts from the figure the balancers' plan expected of it here, which every
            # server counted for it while it moved (a compute-only measurement leaves serialization out)
            start_samples_per_s = arrival.moved.expected_samples_per_s
            if self.balancer is not None:  # the drain took part of the lease: a full one for the download
                self.balancer.hold(self.node.records, arrival.moved, stage, done=False)
                self._lease_held = True
        service = StageService(
            self.cfg,
            stage,
            self.options.stage_options,
            self.node,
            self.options.faults,
            on_fatal=self._fatal,
            start_samples_per_s=start_samples_per_s,
        )
        remember_group_sockets()
        return service

    def _fatal(self, message: str) -> None:
        """Stop serving and exit non-zero (called from a service's sync thread)."""
        logger.error("%s", message)
        self.exit_code = 2
        if self._stop is not None:
            self.node.loop.call_soon_threadsafe(self._stop.set)

    def _close(self) -> None:
        shutdown_quietly(self.dht)
        self.ledger.close()
        self.runner.close()

    # serving one stage --------------------------------------------------------------------------
    async def _serve(self, service: StageService) -> _Arrival | None:
        """Serve `service` until a stop (None) or a move (where to, once the service has drained)."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        endpoints = await self._open_transport(service)
        if self.balancer is not None:
            self.balancer.serving_since_s = None  # a new stage: the balancer waits for it to serve
        if self._arrival is not None:
            self._log_move_cost(service, self._arrival.moved)
        self.activity.watch(stage_markers(service))
        tasks = [
            asyncio.create_task(
                self._every(self.cfg.swarm.announce_period_s, lambda: self._announce(service))
            ),
            asyncio.create_task(
                self._every_async(self.cfg.swarm.announce_period_s, service.refresh_neighbours)
            ),
            asyncio.create_task(
                self._every(self.options.metrics_period_s, lambda: self._publish_metrics(service))
            ),
            asyncio.create_task(self._every(SETTINGS_PERIOD_S, service.publish_settings)),
            # a link cut long enough leaves our DHT node knowing nobody, and nobody it (net/dht_rejoin.py)
            asyncio.create_task(
                keep_joined(self.dht, self.options.initial_peers, self.cfg.swarm.announce_period_s)
            ),
        ]
        stopped = asyncio.create_task(self._stop.wait())
        deciding = asyncio.create_task(self._rebalance_loop(service)) if self.balancer is not None else None
        next_arrival = None
        try:
            await asyncio.wait(
                [t for t in (stopped, deciding) if t is not None], return_when=asyncio.FIRST_COMPLETED
            )
            if deciding is not None and deciding.done() and not deciding.cancelled():
                move = deciding.result()
                next_arrival = _Arrival(
                    move.to_stage, MovedFrom(move.from_stage, time.time(), move.rate_samples_per_s)
                )
                await self._leave_for(service, move)
        finally:
            watchdog = start_exit_watchdog(grace_s=STOP_GRACE_S)  # whatever hangs below (a dead DHT), we end
            for task in [*tasks, stopped, *([deciding] if deciding is not None else [])]:
                task.cancel()
            self.activity.watch(None)  # leaving: the offline record and the drain at the usual pace
            logger.info("stage %d replica %s stopping", service.spec.index, self.node.peer_id)
            if self.dht.is_alive():  # a stop signal to our process group may have ended it already
                await loop.run_in_executor(None, lambda: service.announce(state="offline"))
            await service.stop_serving()
            await self._close_transport(endpoints)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            watchdog.set()
        return next_arrival if self.exit_code == 0 else None

    async def _open_transport(self, service: StageService) -> _Endpoints:
        """The RPC endpoints: a P2P replica of the node's daemon, a servicer that hands each message to
        the service's handler for its kind, a client counted in the same statistics, and (unless off or
        behind a NAT) the direct data plane for hand-offs, which answers with the same handlers. Both
        transports take requests within one set of bounds sized to this server (net/server_bounds.py)."""
        p2p = await self.dht.replicate_p2p()
        remember_group_sockets()
        run_key = self.options.network.run_key
        limits = _request_limits(service, self.cfg, self.options.request_memory_bytes)

        async def dispatch(message: Message, context) -> Message:
            handler = service.handlers.get(message.kind)
            if handler is None:
                return error_message(f"a stage server does not answer {message.kind!r}", "bad_request")
            return await handler(message, context)

        servicer = StageServicer(
            dispatch, service.max_message_bytes, run_key=run_key, bounds=limits.bounds, held=limits.held
        )
        # one byte and CPU count for what this server receives and what it hands to the next stage
        replies = max(limits.bounds.reply_bytes, service.max_message_bytes)  # hand-offs', step means
        client = StageClient(p2p, namespace(self.cfg), servicer.stats, run_key, replies)
        endpoints = _Endpoints(p2p, servicer)
        # libp2p calls are evidence of our links' rates too (net/link_meter.py says why)
        servicer.meter = client.meter = endpoints.link_meter
        if self.options.data_port is not None:
            await self._open_data_plane(endpoints, limits, self.options.data_port)
        data_server = endpoints.data_server
        service.start_serving(
            Transport(
                client=client,
                stats=servicer.stats,
                data=endpoints.data_client,
                data_port=data_server.port if data_server is not None else 0,
                request_status=data_server.status if data_server is not None else limits.status,
                link_meter=endpoints.link_meter,
            )
        )
        await servicer.add_p2p_handlers(p2p, namespace=namespace(self.cfg))
        connections = connection_limits() if data_server is not None else ""
        logger.info("stage %d %s", service.spec.index, limits.bounds.line(connections))  # once per stage
        logger.info("%s", _ready_line(service, self.node))  # launchers wait for this line
        # the same, for programs (runtime/harness/local_swarm.py's `ready_events`): once per stage served
        self.ledger.write(
            "ready", stage=service.spec.index, peer=self.node.peer_id, epoch=service.worker.epoch
        )
        return endpoints

    async def _open_data_plane(self, endpoints: _Endpoints, limits: RequestLimits, port: int) -> None:
        """The data plane's client (hand-offs to the next stage) and, unless behind a NAT, its server."""
        run_key, congestion = self.options.network.run_key, self.options.data_congestion
        stats, meter = endpoints.servicer.stats, endpoints.link_meter
        endpoints.data_client = DataPlaneClient(
            self.identity, run_key, stats, congestion, meter, limits.bounds.reply_bytes
        )
        if self.node.behind_nat:  # nobody could dial it; it still dials the next stage's
            return
        endpoints.data_server = DataPlaneServer(
            endpoints.servicer.answer_direct,
            endpoints.servicer.limit,
            self.identity,
            run_key,
            congestion,
            endpoints.link_meter,
            limits.bounds,
            limits.held,
        )
        await endpoints.data_server.start(self.options.network.host, port)

    async def _close_transport(self, endpoints: _Endpoints) -> None:
        if endpoints.data_server is not None:
            await endpoints.data_server.close()
        if endpoints.data_client is not None:
            endpoints.data_client.close()
        p2p = endpoints.p2p
        with suppress(Exception):  # the daemon may be gone already (a stop after its death)
            await asyncio.wait_for(
                endpoints.servicer.remove_p2p_handlers(p2p, namespace=namespace(self.cfg)),
                HANDLER_REMOVAL_TIMEOUT_S,
            )
        with suppress(Exception):
            await asyncio.wait_for(release_p2p_replica(self.dht, p2p), HANDLER_REMOVAL_TIMEOUT_S)

    # announcements and metrics ------------------------------------------------------------------
    def _announce(self, service: StageService) -> None:
        if service.draining:
            return  # leaving: its offline record stands, and our intent at the target stage counts us
        announcement = service.announce()
        # our record first: a released lease makes every server decide at once, and one that did not see
        # us yet at either place planned a move too many
        if self._lease_held and announcement.state == "online":
            self._release_lease(service)

    def _release_lease(self, service: StageService) -> None:
        """Our lease done, once we serve (retried at every announcement until the DHT stored it: a lease
        left "moving" would count us as still on our way for a minute)."""
        if self.balancer is not None and self._arrival is not None:
            moved = self._arrival.moved
            self._lease_held = not self.balancer.hold(self.node.records, moved, service.spec.index, done=True)

    def _publish_metrics(self, service: StageService) -> None:
        metrics = replace(service.metrics(), moved=self.move_cost)
        self.node.records.publish_metrics(
            self.node.peer_id, metrics.to_dict(), ttl_s=3 * self.options.metrics_period_s
        )
        logger.info("%s", metrics.log_line())

    def _log_move_cost(self, service: StageService, moved: MovedFrom) -> None:
        """The move's cost, now that the new stage serves: the state download and the seconds since the
        server of the old stage decided to move."""
        record = move_record(
            moved.stage, service.spec.index, moved.decided_at_unix_s, service.downloaded_bytes
        )
        logger.warning("rebalancing: moved here %s", record)
        self.ledger.write("moved", **json.loads(record))
        self.move_cost = json.loads(record)

    async def _every(self, period_s: float, fn) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(None, fn)
            except Exception:
                logger.exception("periodic task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(period_s)

    async def _every_async(self, period_s: float, fn) -> None:
        while True:
            try:
                await fn()
            except Exception:
                logger.exception("periodic task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(period_s)

    # moves --------------------------------------------------------------------------------------
    async def _rebalance_loop(self, service: StageService) -> Move:
        """Decide every jittered period, and at once when another server's lease changes (the plan
        that named it may name us too); returns the move this server makes."""
        balancer = self.balancer
        assert balancer is not None
        loop = asyncio.get_running_loop()
        # the rest of a plan follows its first move within a poll (one DHT read each): polled every
        # announce period (2 s), the three moves of one plan were decided 4.0 s apart, and the time to
        # balance only just met two announce periods plus the longest move (bench/rebalance_live.py)
        poll_s = min(LEASE_POLL_S, self.cfg.swarm.announce_period_s)
        next_decision_s = time.monotonic() + balancer.jittered_period_s()
        while True:
            await asyncio.sleep(max(0.0, min(poll_s, next_decision_s - time.monotonic())))
            if balancer.serving_since_s is None and service.serving:
                balancer.serving_since_s = time.monotonic()
            try:
                changed = await loop.run_in_executor(None, balancer.leases_changed, self.node.records)
                if not changed and time.monotonic() < next_decision_s:
                    continue
                next_decision_s = time.monotonic() + balancer.jittered_period_s()
                # the lease protocol's reads must show the latest leases, whatever an idle slack allows
                move = await loop.run_in_executor(None, balancer.decide, self.node.records.without_slack())
            except Exception:  # a failed read: decide next period
                logger.exception("rebalancing tick failed")
                continue
            if move is not None:
                return move

    async def _leave_for(self, service: StageService, move: Move) -> None:
        """Count ourselves at the target stage, then drain the service we leave."""
        assert self.balancer is not None
        loop = asyncio.get_running_loop()
        intent = service.announcement(state="joining")
        intent.stage, intent.throughput_samples_per_s = move.to_stage, move.rate_samples_per_s
        await loop.run_in_executor(
            None, self.balancer.announce_intent, self.node.records, intent, service.announce_ttl_s
        )
        logger.warning(
            "rebalancing: moving from stage %d to stage %d, the bottleneck (%.1f samples/s; the two "
            "stages' minimum after the move %.1f)",
            move.from_stage,
            move.to_stage,
            move.bottleneck_before_samples_per_s,
            move.pair_min_after_samples_per_s,
        )
        self.ledger.write("move", to=move.to_stage, bottleneck=move.bottleneck_before_samples_per_s)
        await service.drain(DRAIN_TIMEOUT_S)


def _request_limits(service: StageService, cfg: RunConfig, memory_bytes: int | None) -> RequestLimits:
    """The bounds on callers' requests while `service` is served (net/server_bounds.py): from its stage's
    shapes, the run's codec and micro-batch, and the memory budget (`memory_bytes`, else a share)."""
    memory = MemoryBudget.of(memory_bytes)
    io, codec_name, micro_batch = service.io, cfg.swarm.compression, cfg.training.micro_batch_size
    return RequestLimits.of(derive_bounds(io, codec_name, micro_batch, memory))


def _ready_line(service: StageService, node: Node) -> str:
    """The line launchers wait for (local_swarm.READY_MARKER): everything, sockets included, exists."""
    worker, compute = service.worker, service.options.compute.describe()
    return (
        f"stage {service.spec.index} replica {node.peer_id} ready (epoch {worker.epoch}, {compute}, "
        f"{torch.get_num_threads()} torch threads, forward graphs kept within {worker.cache_max_bytes >> 20} "
        f"MB); addresses: {' '.join(node.addresses)}"
    )
