"""`swarmtrain server`: one process hosting one pipeline stage of a SWARM run.

Process tree: this process (asyncio loop for RPCs, one compute thread, one sync thread) + the
hivemind DHT process with its p2pd + the averager process. Start order matters: everything that
forks (DHT, averager) is created before any thread starts (notes 3.3).

Life cycle: `StageServer(cfg, options)` starts the DHT, builds the stage from the run config,
starts the averager and takes the stage's state from its live replicas, else its newest checkpoint,
else initial weights (refused once the swarm has stepped): a constructed server is complete, and one
that fails half-way stops what it had started. `run()` registers the RPC handlers, announces in the
DHT every `announce_period_s`, serves (checkpointing every N steps with --checkpoint-dir) until
SIGTERM/SIGINT, announces offline and writes a final checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError
from swarmtrain.net.dht_records import RunRecords, StageAnnouncement, progress_key, stage_key
from swarmtrain.net.engine import (
    PeerNetwork,
    release_p2p_replica,
    shutdown_quietly,
    start_dht,
    visible_addresses,
)
from swarmtrain.net.hand_off import validate_chain
from swarmtrain.net.protocol import (
    TRAINING_KINDS,
    Message,
    ProtocolError,
    StageIO,
    StageRequest,
    error_message,
    make_message,
    max_grads_message_bytes,
    namespace,
    validate_close,
    validate_grads,
    validate_request,
    validate_step_means,
    validate_step_means_request,
)
from swarmtrain.runtime import byzantine
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.procs import (
    forked_children_die_with_me,
    reap_own_group,
    remember_group_sockets,
    start_exit_watchdog,
)
from swarmtrain.runtime.server.balancer import Balancer, MovedFrom, move_record
from swarmtrain.runtime.server.capacity import CapacityMeter
from swarmtrain.runtime.server.chain_hop import Admitted, ChainHop, NextStage
from swarmtrain.runtime.server.compute import (
    PRIORITY_BACKWARD,
    PRIORITY_EVAL,
    PRIORITY_FORWARD,
    PRIORITY_SYNC,
    ComputeWorker,
    DeadlineExpired,
)
from swarmtrain.runtime.server.stage_checkpoint import CheckpointSettings, StageCheckpointer
from swarmtrain.runtime.server.stage_steps import StepCoordinator, StepSettings
from swarmtrain.runtime.server.stage_sync import StageSynchronizer, SyncSettings
from swarmtrain.runtime.server.stage_worker import StageWorker, all_finite
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)
LEASE_POLL_S = 1.0  # how often the balancer looks for another server's new or changed move lease

# a record lives this many announce periods: one missed announcement does not drop a live server
ANNOUNCE_TTL_PERIODS = 3
DRAIN_TIMEOUT_S = 15.0
DRAIN_POLL_S = 0.05


@dataclass
class ServerOptions:
    stage: int
    initial_peers: list[str] = field(default_factory=list)
    network: PeerNetwork = field(default_factory=PeerNetwork)
    threads: int = 1
    cache_size: int = 64
    cache_max_bytes: int = 512 << 20
    max_batch: int | None = None  # default: 4 micro-batches
    ledger_path: str | None = None
    metrics_period_s: float = 5.0
    min_matchmaking_time_s: float = 1.0
    sync_tick_s: float = 0.5
    checkpoint_dir: str | None = None  # default: the run config's swarm.checkpoint_dir (empty: none)
    fresh_start: bool = False  # initial weights even when the swarm has stepped (said loudly)
    # initial weights from this Hugging Face model directory instead of the seed (--init-from-hf); the
    # stage's live replicas and checkpoints still come first (stage_sync.py's join)
    init_from_hf: str | None = None
    moved_from: MovedFrom | None = None  # set for the server a move builds


class StageServer:
    """One replica of one stage, complete when constructed (see the module docstring). Its own event
    loop exists from construction too, so the step coordinator and the stop event are made with it;
    only the transport endpoints (RPC client, servicer) are made when `run()` serves, because they
    need the loop running."""

    def __init__(
        self, cfg: RunConfig, options: ServerOptions, dht=None, runner: asyncio.Runner | None = None
    ) -> None:
        """`dht`, `runner`: the DHT node and event loop of this process's previous stage server (a move
        keeps the peer's node, identity, connections and loop: the node's RPC client is bound to the
        loop it was made on); None makes new ones."""
        specs = cfg.stages()
        if not 0 <= options.stage < len(specs):
            raise UserError(f"--stage {options.stage} outside 0..{len(specs) - 1} for this run config")
        self.cfg, self.options, self.spec = cfg, options, specs[options.stage]
        self.digest = cfg.digest()
        max_batch = options.max_batch or 4 * cfg.training.micro_batch_size
        self.io = StageIO.from_config(cfg.model, self.spec, max_batch)
        self.exit_code = 0
        self.move_to: int | None = None  # set when the balancer moves this server to another stage
        self._running_requests = 0  # micro-batches being served (a move waits for them)
        self._samples_done = 0  # samples whose backward ran here (counted with their CPU for capacity)
        self.move: MovedFrom | None = None  # where this server comes from when it moves on
        self.move_cost: dict | None = None
        self._client = self.stats = None  # the transport, while serving
        self.hop: ChainHop | None = None  # this stage's part of direct hand-offs, while serving
        forked_children_die_with_me()  # before the DHT and the averager fork
        torch.set_num_threads(options.threads)
        with ExitStack() as undo:  # a failure half-way stops what was started, in reverse order
            undo.callback(reap_own_group)
            self.ledger = Ledger(options.ledger_path)
            undo.callback(self.ledger.close)
            self._build(undo, dht, runner)
            undo.pop_all()  # complete: from here `shutdown()` stops it all

    def _build(self, undo: ExitStack, dht, runner: asyncio.Runner | None) -> None:
        from swarmtrain.net.averaging import StageAverager

        options, cfg = self.options, self.cfg
        self.dht = dht or start_dht(options.initial_peers, options.network)
        undo.callback(shutdown_quietly, self.dht)
        self.peer_id = self.dht.peer_id.to_base58()
        self.addresses = visible_addresses(self.dht)  # fixed for our lifetime; asking a dead DHT would hang
        self.records = RunRecords(self.dht, cfg.swarm.run_id)
        self.worker = StageWorker(
            cfg,
            self.spec,
            options.cache_size,
            self.ledger,
            options.cache_max_bytes,
            init_from_hf=options.init_from_hf,
        )
        self._param_shapes = [tuple(p.shape) for p in self.worker.params]
        self.compute = ComputeWorker()
        moved = options.moved_from
        # a moved server starts from the figure the balancers' plan expected of it here, which every
        # server counted for it while it moved (a compute-only measurement leaves serialization out)
        self.capacity = CapacityMeter(
            moved.expected_samples_per_s if moved else self._measure_throughput(),
            min_samples=4 * cfg.training.micro_batch_size,
            warmup_samples=4 * cfg.training.micro_batch_size,
        )
        self.balancer = self._make_balancer()
        self._lease_held = moved is not None and self.balancer is not None
        if self._lease_held:  # the drain took part of the lease: a full one for the download
            self.balancer.hold(self.records, moved, options.stage, done=False)
        self.averager = StageAverager(
            self.worker.params,
            self.dht,
            prefix=f"{namespace(cfg)}_s{self.spec.index}",
            state_provider=self.worker.export_state,
            min_matchmaking_time_s=options.min_matchmaking_time_s,
            request_timeout_s=min(0.5, options.min_matchmaking_time_s / 2),
            allreduce_timeout_s=cfg.swarm.averaging_timeout_s,
            # a private run: state goes only to peers announced (signed) at this stage
            members_keys=self._stage_keys() if options.network.run_key else (),
        )
        undo.callback(shutdown_quietly, self.averager)
        self.runner = runner or asyncio.Runner()  # the serving loop, made after the forks
        undo.callback(self.runner.close)
        self._loop = self.runner.get_loop()
        self._stop = asyncio.Event()
        self.compute.start()
        undo.callback(self.compute.stop)
        self.checkpointer = self._make_checkpointer()
        if self.checkpointer is not None:
            undo.callback(self.checkpointer.close)
        self.steps = StepCoordinator(
            self.worker,
            self.compute,
            self.peer_id,
            self._send_grads,
            StepSettings(
                close_timeout_s=cfg.swarm.request_timeout_s, exchange_timeout_s=cfg.swarm.averaging_timeout_s
            ),
            self.ledger,
            on_step=self._step_applied,
            loop=self._loop,
        )
        self.sync = self._make_synchronizer()
        undo.callback(self.sync.stop)
        remember_group_sockets()
        self.ledger.write("start", peer=self.peer_id, stage=self.spec.index)
        self._warn_about_foreign_peers()
        self.sync.join()

    def _make_synchronizer(self) -> StageSynchronizer:
        swarm = self.cfg.swarm
        settings = SyncSettings(
            tick_s=self.options.sync_tick_s,
            heartbeat_s=max(0.5, swarm.announce_period_s / 2),
            progress_ttl_s=max(3.0, 2 * swarm.announce_period_s),
            num_stages=swarm.num_stages,
            allow_fresh=self.options.fresh_start,
        )
        return StageSynchronizer(
            self.worker,
            self.compute,
            self.averager,
            self.records,
            self.peer_id,
            self.digest,
            settings,
            self.ledger,
            checkpoints=self.checkpointer,
            on_fatal=self._fatal,
            closing=self._closing,
            on_epoch_moved=self.steps.version_changed_threadsafe,
            replay_missed=self._replay_missed,
        )

    def _make_balancer(self) -> Balancer | None:
        swarm = self.cfg.swarm
        if swarm.rebalance_period_s <= 0:
            return None
        return Balancer(
            self.peer_id, swarm.num_stages, self.digest, swarm.rebalance_period_s, swarm.rebalance_margin
        )

    def _make_checkpointer(self) -> StageCheckpointer | None:
        directory = self.options.checkpoint_dir or self.cfg.swarm.checkpoint_dir
        if not directory:
            return None
        swarm = self.cfg.swarm
        settings = CheckpointSettings(
            directory=Path(directory),
            every_steps=swarm.checkpoint_every_steps,
            every_s=swarm.checkpoint_every_s,
            keep=swarm.checkpoint_keep,
        )
        identity = {
            "run_id": swarm.run_id,
            "digest": self.digest,
            "preset": self.cfg.preset,
            "layer_start": self.spec.layer_start,
            "layer_end": self.spec.layer_end,
            "num_stages": swarm.num_stages,
        }
        return StageCheckpointer(settings, self.spec.index, identity, self.worker.export_state)

    def _fatal(self, message: str) -> None:
        """Stop serving and exit non-zero (called from the sync thread)."""
        logger.error("%s", message)
        self.exit_code = 2
        self._loop.call_soon_threadsafe(self._stop.set)

    def _closing(self) -> bool:
        """The step this replica is at has a close or gradients pending (read from the sync thread)."""
        return self.worker.epoch in self.steps.pending

    def _step_applied(self, epoch: int, fingerprint: list[float] | None) -> None:
        self.sync.step_applied(epoch, fingerprint)
        if self.checkpointer is not None:
            self.checkpointer.after_step(self.worker.epoch)

    def _measure_throughput(self) -> float:
        """A first throughput estimate (fwd+bwd ~ 3x a forward) in samples per CPU second, like the
        capacity meter's, which replaces it once it has measured enough samples. Timed in CPU, not wall
        time: under a CPU quota beside other starting servers, wall time read identical stage-0 servers
        at 33 to 506 samples/s (bench/rebalance_live.py)."""
        t, m = self.cfg.training, self.cfg.model
        shape = (
            (t.micro_batch_size, m.seq_len)
            if self.spec.is_first
            else (t.micro_batch_size, m.seq_len, m.d_model)
        )
        sample = torch.zeros(shape, dtype=torch.long) if self.spec.is_first else torch.randn(shape)
        repeats = 3
        with torch.no_grad():
            self.worker.module(sample)
            start = time.process_time()
            for _ in range(repeats):
                self.worker.module(sample)
        return t.micro_batch_size * repeats / max(3 * (time.process_time() - start), 1e-6)

    def _warn_about_foreign_peers(self) -> None:
        for peer, ann in self.records.stage_peers(self.spec.index).items():
            if ann.config_digest != self.digest:
                logger.warning(
                    "peer %s serves stage %d with config digest %s, ours is %s: it is ignored "
                    "(different model, stage cut or optimizer settings)",
                    peer,
                    self.spec.index,
                    ann.config_digest,
                    self.digest,
                )

    # serving ------------------------------------------------------------------------------------
    def _stage_keys(self) -> tuple[str, ...]:
        run, i = self.cfg.swarm.run_id, self.spec.index
        return (stage_key(run, i), progress_key(run, i))

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT or a move, shut down. Returns the exit code. After a move
        (`move_to` set) the DHT node and the loop stay for the next stage's server (`dht`, `runner`)."""
        try:
            self.runner.run(self._serve())
        except KeyboardInterrupt:
            pass
        finally:
            watchdog = start_exit_watchdog(grace_s=20.0)
            self.shutdown()
            if self.moving:
                watchdog.set()
            else:
                reap_own_group()
        return self.exit_code

    @property
    def _announce_ttl_s(self) -> float:
        return ANNOUNCE_TTL_PERIODS * self.cfg.swarm.announce_period_s

    def _leaving(self) -> bool:
        """A move is decided: this server drains and serves no new micro-batch."""
        return self.move_to is not None

    @property
    def moving(self) -> bool:
        return self.move_to is not None and self.exit_code == 0

    async def _serve(self) -> None:
        from swarmtrain.net.transport import StageClient, StageServicer

        loop = self._loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        p2p = await self.dht.replicate_p2p()
        remember_group_sockets()
        run_key = self.options.network.run_key
        params = self.worker.params
        grads_bytes = max_grads_message_bytes(sum(p.numel() for p in params), len(params))
        limit = max(self.io.max_message_bytes(), grads_bytes)
        servicer = StageServicer(self._handle, limit, run_key=run_key)
        self.stats = servicer.stats
        # one byte and CPU count for what this server receives and what it hands to the next stage
        self._client = StageClient(p2p, namespace(self.cfg), stats=self.stats, run_key=run_key)
        self.hop = self._make_chain_hop(self._client)
        await servicer.add_p2p_handlers(p2p, namespace=namespace(self.cfg))
        self.sync.start()
        step_task = asyncio.create_task(self.steps.run())
        logger.info(  # launchers wait for this line: everything (incl. sockets) exists from here on
            "stage %d replica %s ready (epoch %d); addresses: %s",
            self.spec.index,
            self.peer_id,
            self.worker.epoch,
            " ".join(self.addresses),
        )
        self.capacity.restart(self._samples_done, self._work_cpu_s())
        tasks = [
            asyncio.create_task(self._every(self.cfg.swarm.announce_period_s, self._announce)),
            asyncio.create_task(self._every_async(self.cfg.swarm.announce_period_s, self._refresh_next_stage)),
            asyncio.create_task(self._every(self.options.metrics_period_s, self._publish_metrics)),
        ]
        if self.balancer is not None:
            tasks.append(asyncio.create_task(self._rebalance_loop(self.balancer)))
        if self.options.moved_from is not None:
            self._log_move_cost()
        try:
            await self._stop.wait()
        finally:
            watchdog = start_exit_watchdog(grace_s=15.0)  # whatever hangs below (a dead DHT), we end
            for task in [*tasks, step_task]:
                task.cancel()
            logger.info("stage %d replica %s stopping", self.spec.index, self.peer_id)
            await loop.run_in_executor(None, lambda: self._announce(state="offline"))
            await asyncio.wait_for(servicer.remove_p2p_handlers(p2p, namespace=namespace(self.cfg)), 5)
            if self.moving:
                await asyncio.wait_for(release_p2p_replica(self.dht, p2p), 5)
                watchdog.set()

    async def _rebalance_loop(self, balancer: Balancer) -> None:
        """Decide every jittered period, and at once when another server's lease changes (the plan
        that named it may name us too)."""
        loop = asyncio.get_running_loop()
        # the rest of a plan follows its first move within a poll (one DHT read each): polled every
        # announce period (2 s), the three moves of one plan were decided 4.0 s apart, and the time to
        # balance only just met two announce periods plus the longest move (bench/rebalance_live.py)
        poll_s = min(LEASE_POLL_S, self.cfg.swarm.announce_period_s)
        next_decision_s = time.monotonic() + balancer.jittered_period_s()
        while True:
            await asyncio.sleep(max(0.0, min(poll_s, next_decision_s - time.monotonic())))
            if balancer.serving_since_s is None and self.sync.serving.is_set():
                balancer.serving_since_s = time.monotonic()
            try:
                changed = await loop.run_in_executor(None, balancer.leases_changed, self.records)
                if not changed and time.monotonic() < next_decision_s:
                    continue
                next_decision_s = time.monotonic() + balancer.jittered_period_s()
                move = await loop.run_in_executor(None, balancer.decide, self.records)
            except Exception:  # a failed read: decide next period
                logger.exception("rebalancing tick failed")
                continue
            if move is not None:
                await self._move(balancer, move)
                return

    async def _move(self, balancer: Balancer, move) -> None:
        loop = asyncio.get_running_loop()
        intent = self._announcement(state="joining")
        intent.stage, intent.throughput_samples_per_s = move.to_stage, move.rate_samples_per_s
        await loop.run_in_executor(None, balancer.announce_intent, self.records, intent, self._announce_ttl_s)
        logger.warning(
            "rebalancing: moving from stage %d to stage %d, the bottleneck (%.1f samples/s; the two "
            "stages' minimum after the move %.1f)",
            move.from_stage,
            move.to_stage,
            move.bottleneck_before_samples_per_s,
            move.pair_min_after_samples_per_s,
        )
        self.ledger.write("move", to=move.to_stage, bottleneck=move.bottleneck_before_samples_per_s)
        self.move_to = move.to_stage
        self.move = MovedFrom(move.from_stage, time.time(), move.rate_samples_per_s)
        await self._drain()
        self._stop.set()

    async def _drain(self) -> None:
        """Leave the stage without losing work (`move_to` set): trainers are told at once (an offline
        record; new micro-batches and parked forwards are answered `unavailable`, which they retry on
        another replica without waiting), micro-batches already computing finish, and we stay for the
        exchange of every step we hold samples of. Stopping with requests unanswered stalled the whole
        swarm for the trainer's request timeout (30 s, bench/rebalance_live.py)."""
        loop = asyncio.get_running_loop()
        self.steps.version_changed()  # parked forwards see that we are leaving
        await loop.run_in_executor(None, lambda: self._announce(state="offline"))
        deadline_s = time.monotonic() + DRAIN_TIMEOUT_S
        while self._running_requests or self.worker.unapplied_samples:
            if time.monotonic() > deadline_s:
                logger.warning(
                    "rebalancing: left with %d request(s) running and %d sample(s) unapplied",
                    self._running_requests,
                    self.worker.unapplied_samples,
                )
                return
            await asyncio.sleep(DRAIN_POLL_S)

    def _log_move_cost(self) -> None:
        """The move's cost, now that this server serves its new stage: the state download and the seconds
        since the server of the old stage decided to move."""
        moved = self.options.moved_from
        record = move_record(
            moved.stage, self.spec.index, moved.decided_at_unix_s, self.sync.counters.downloaded_bytes
        )
        logger.warning("rebalancing: moved here %s", record)
        self.ledger.write("moved", **json.loads(record))
        self.move_cost = json.loads(record)

    def _release_lease(self) -> None:
        """Our lease done, once we serve (retried at every announcement until the DHT stored it: a lease
        left "moving" would count us as still on our way for a minute)."""
        moved = self.options.moved_from
        if self.balancer is not None and moved is not None:  # as `_lease_held` implies
            self._lease_held = not self.balancer.hold(self.records, moved, self.spec.index, done=True)

    def _make_chain_hop(self, client) -> ChainHop | None:
        if self.spec.is_last:
            return None
        next_stage = NextStage(self.records, self.spec.index + 1, self.digest, client)
        num_stages = self.cfg.swarm.num_stages
        return ChainHop(self.worker, self.compute, client, next_stage, self.io, self.digest, num_stages, self.peer_id)

    async def _refresh_next_stage(self) -> None:
        if self.hop is not None:
            await self.hop.next_stage.refresh()

    async def _every_async(self, period_s: float, fn) -> None:
        while True:
            try:
                await fn()
            except Exception:
                logger.exception("periodic task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(period_s)

    async def _every(self, period_s: float, fn) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(None, fn)
            except Exception:
                logger.exception("periodic task %s failed", getattr(fn, "__name__", fn))
            await asyncio.sleep(period_s)

    async def _send_grads(self, peer: str, step: int, samples: int, sums: list[torch.Tensor]) -> bool:
        """One replica's gradient sums of a step to a stage peer; False if the peer is gone."""
        from hivemind.p2p import PeerID

        from swarmtrain.net.transport import RemoteError, TruncatedReply, is_connection_error

        header = {"step": step, "samples": samples, "stage": self.spec.index, "digest": self.digest}
        if byzantine.sends_nan(step):  # a faulty replica (tests); its scaling is in the accumulation
            sums = byzantine.nan_like(sums)
        message = make_message("grads", header, dict(zip(self.worker.names, sums, strict=True)), "none")
        for attempt in range(3):  # a cut-off stream is retried; a dead peer is not waited for
            try:
                timeout_s = self.cfg.swarm.averaging_timeout_s
                await self._client.call(PeerID.from_base58(peer), "grads", message, timeout_s=timeout_s)
                return True
            except RemoteError as exc:  # alive but refusing (digest, shape): retrying cannot help
                logger.warning("step %d: stage peer %s refused our gradients: %s", step, peer[-8:], exc)
                return False
            except Exception as exc:
                if is_connection_error(exc) and not isinstance(exc, TruncatedReply):
                    logger.warning("step %d: stage peer %s unreachable: %r", step, peer[-8:], exc)
                    return False
                logger.info(
                    "step %d: sending gradients to %s failed (%r), attempt %d", step, peer, exc, attempt
                )
        return False

    async def _handle(self, message: Message, context) -> Message:
        """One handler per message kind (the transport has already matched kind and RPC)."""
        handlers = {
            "info": self._on_info,
            "close": self._on_close,
            "grads": self._on_grads,
            "step_means": self._on_step_means,
            "forward": self._on_micro_batch,
            "backward": self._on_micro_batch,
            "forward_backward": self._on_micro_batch,
            "evaluate": self._on_micro_batch,
            "chain": self._on_micro_batch,
        }
        if message.kind not in handlers:
            return error_message(f"a stage server does not answer {message.kind!r}", "bad_request")
        return await handlers[message.kind](message, context)

    async def _on_info(self, message: Message, _context) -> Message:
        return await self.compute.run(lambda: self._info(message), PRIORITY_SYNC)

    async def _on_close(self, message: Message, _context) -> Message:
        self.steps.on_close(**validate_close(message, self.spec.index, self.digest))
        return Message("result", {"ok": True})

    async def _on_grads(self, message: Message, context) -> Message:
        step, samples, sums = validate_grads(
            message, self.spec.index, self.digest, self.worker.names, self._param_shapes
        )
        self.steps.on_grads(context.remote_id.to_base58(), step, samples, sums)
        return Message("result", {"ok": True})

    async def _on_step_means(self, message: Message, _context) -> Message:
        step = validate_step_means_request(message, self.spec.index, self.digest)
        kept = self.steps.means_of(step)
        if kept is None:
            return error_message(f"the means of step {step} are not kept here", "unavailable")
        samples, means = kept
        header = {"step": step, "samples": samples}
        if means is None or not all_finite(means):
            return Message("result", {**header, "empty": True})  # skipped alike on every replica
        return make_message("result", header, dict(zip(self.worker.names, means, strict=True)), "none")

    def _replay_missed(self, peer: str, start: int, end: int) -> bool:
        """(sync thread) Apply steps start..end-1, which this replica missed, from `peer`'s mean
        gradients; False when that failed (the caller resyncs)."""
        if self._client is None:
            return False
        future = asyncio.run_coroutine_threadsafe(self._replay_from(peer, start, end), self._loop)
        try:
            return future.result(timeout=self.cfg.swarm.request_timeout_s * (end - start) + 5.0)
        except Exception as exc:  # unreachable donor, a step it no longer keeps, a malformed answer
            future.cancel()
            logger.info("replaying steps %d-%d from %s failed: %r", start, end - 1, peer[-8:], exc)
            return False

    async def _replay_from(self, peer: str, start: int, end: int) -> bool:
        from hivemind.p2p import PeerID

        assert self._client is not None
        for step in range(start, end):
            header = {"step": step, "stage": self.spec.index, "digest": self.digest}
            request = Message("step_means", header)
            timeout_s = self.cfg.swarm.request_timeout_s
            reply = await self._client.call(PeerID.from_base58(peer), "step_means", request, timeout_s)
            samples, means = validate_step_means(reply, self.worker.names, self._param_shapes)
            if not await self.steps.replay(step, samples, means):
                return False
        return True

    async def _on_micro_batch(self, message: Message, _context) -> Message:
        if not self.sync.serving.is_set():
            return error_message("this replica is downloading the stage state; try another", "unavailable")
        if self._leaving():
            return _leaving_answer()
        self._running_requests += 1
        try:
            if message.kind == "chain":
                return await self._handle_chain(message)
            return await self._handle_micro_batch(message)
        finally:
            self._running_requests -= 1

    async def _handle_chain(self, message: Message) -> Message:
        assert self.hop is not None  # validate_chain refuses chains at the last stage
        chain = validate_chain(message, self.io, self.digest, self.cfg.swarm.num_stages)
        # the chain's time includes every later stage's: each may take up to a request timeout
        later_stages = self.cfg.swarm.num_stages - self.spec.index
        admitted = await self._admit(chain.forward, message.header, later_stages)
        if isinstance(admitted, Message):
            return admitted
        try:
            reply = await self.hop.run(chain, admitted)
        except DeadlineExpired as exc:
            return error_message(str(exc), "timeout")
        if reply.kind == "result":
            self._samples_done += chain.forward.num_samples
        return reply

    async def _admit(self, request: StageRequest, header: dict, timeouts: int = 1) -> Admitted | Message:
        """The request's deadline once it may run (the parameters of its step are here), or the answer
        that refuses it (already applied, not ready in time, leaving)."""
        timeout_s = self.cfg.swarm.request_timeout_s * timeouts
        requested = header.get("timeout_s")
        if isinstance(requested, (int, float)) and 0 < requested < timeout_s:
            timeout_s = float(requested)
        arrived_s = time.monotonic()
        deadline_s = arrived_s + timeout_s
        if request.step is None:
            return Admitted(arrived_s, deadline_s, 0.0)
        # a training micro-batch of step k runs on the parameters after step k - max_staleness
        # (synchronous by default: after step k - 1); an evaluation names the step it must see
        need = request.step if request.evaluate else request.step - self.cfg.training.max_staleness
        if not request.evaluate and self.worker.epoch > request.step:
            return error_message(f"step {request.step} is already applied here (at {self.worker.epoch})", "stale")
        if not await self.steps.wait_for_version(need, deadline_s, abandon=self._leaving):
            if self._leaving():
                return _leaving_answer()
            return error_message(f"parameters of step {need} not ready in time", "timeout")
        return Admitted(arrived_s, deadline_s, time.monotonic() - arrived_s)

    async def _handle_micro_batch(self, message: Message) -> Message:
        request = validate_request(message, self.io, self.digest)
        admitted = await self._admit(request, message.header)
        if isinstance(admitted, Message):
            return admitted
        arrived_s, deadline_s, step_wait_s = admitted.arrived_s, admitted.deadline_s, admitted.step_wait_s
        if request.kind == "backward":
            fn, priority = self.worker.backward, PRIORITY_BACKWARD
        else:
            fn, priority = self.worker.forward, PRIORITY_EVAL if request.evaluate else PRIORITY_FORWARD
        try:
            reply, compute_s = await self.compute.run(lambda: _timed(fn, request), priority, deadline_s)
        except DeadlineExpired as exc:
            return error_message(str(exc), "timeout")
        except ProtocolError as exc:
            return error_message(str(exc), exc.code)
        # a backward or a fused forward-backward ran: the samples' work is done (and its CPU counted)
        if request.kind != "forward" and not request.evaluate:
            self._samples_done += request.num_samples
        # queue wait + compute: the caller subtracts it from its round trip to see the transport's share
        reply.header["server_s"] = round(time.monotonic() - arrived_s, 6)
        reply.header["compute_s"] = round(compute_s, 6)
        # waiting for the previous step is the step's pace, not this peer's speed: routers leave it out
        reply.header["step_wait_s"] = round(step_wait_s, 6)
        return reply

    def _info(self, message: Message) -> Message:
        """Counters, and on request the parameters or the pending gradient sums (tests, monitor)."""
        w = self.worker
        header = {
            "stage": self.spec.index,
            "digest": self.digest,
            "peer": self.peer_id,
            "epoch": w.epoch,
            "samples_seen": w.samples_seen,
            "pending_samples": w.unapplied_samples,
            "serving": self.sync.serving.is_set(),
            "fingerprint": self.sync.fingerprint,  # [step, [sum |p|, sum p]] as compared between replicas
            "counters": dict(w.counters),
            "cache": {"entries": len(w.cache), "bytes": w.cache_bytes},
            "sync": vars(self.sync.counters),
            "steps": vars(self.steps.counters) if self.steps is not None else {},
            "names": w.names,
        }
        want = message.header.get("want")
        tensors = {}
        if want == "params":
            tensors = {name: p.detach() for name, p in zip(w.names, w.params, strict=True)}
        elif want == "grads":
            tensors = dict(zip(w.names, w.unapplied_grad_sums(), strict=True))  # sums over pending_samples
        return make_message("result", header, tensors, "none")

    # announcements and metrics ------------------------------------------------------------------
    def _announce(self, state: str | None = None) -> None:
        self.capacity.update(self._samples_done, self._work_cpu_s())
        if self.move_to is not None and state != "offline":
            return  # moving: our record at the target stage stands for us now
        announcement = self._announcement(state)
        # an offline record too: the DHT replaces a record only by one that expires later, so a short-lived
        # offline record was refused and trainers kept routing to a stopped server until it expired
        self.records.announce(self.peer_id, announcement, self._announce_ttl_s)
        # our record first: a released lease makes every server decide at once, and one that did not see
        # us yet at either place planned a move too many
        if self._lease_held and announcement.state == "online":
            self._release_lease()

    def _work_cpu_s(self) -> float:
        """CPU seconds spent on micro-batches so far: their forward and backward jobs on the compute thread
        (stage 0's backward is a call of its own: its wall-clock busy time alone made stage 0 look 2x
        cheaper than it was) and their requests' parsing and replies' packing (runtime/server/capacity.py)."""
        by_priority = self.compute.cpu_s_by_priority
        compute_s = by_priority.get(PRIORITY_FORWARD, 0.0) + by_priority.get(PRIORITY_BACKWARD, 0.0)
        transport_s = self.stats.cpu_s(TRAINING_KINDS) if self.stats is not None else 0.0
        return compute_s + transport_s

    @property
    def throughput_samples_per_s(self) -> float:
        return self.capacity.samples_per_cpu_s

    def _announcement(self, state: str | None = None) -> StageAnnouncement:
        state = state or ("online" if self.sync.serving.is_set() else "joining")
        return StageAnnouncement(
            stage=self.spec.index,
            addresses=self.addresses,
            throughput_samples_per_s=self.throughput_samples_per_s,
            queue_len=self.compute.queue_len,
            config_digest=self.digest,
            state_version=self.worker.epoch,
            state=state,
        )

    def _publish_metrics(self) -> None:
        c, s = self.worker.counters, self.sync.counters
        st = self.steps.counters
        totals = self.stats.totals() if self.stats is not None else None
        metrics = {
            "role": "server",
            "stage": self.spec.index,
            "step": self.worker.epoch,
            "samples_seen": self.worker.samples_seen,
            "samples_per_s": round(self.throughput_samples_per_s, 2),
            "queue_len": self.compute.queue_len,
            "pending_samples": self.worker.unapplied_samples,
            "forward": c["forward"] + c["fused"],
            "backward": c["backward"] + c["fused"],
            "recomputed": c["recomputed"],
            "duplicates": c["duplicates"],
            "late": c["late"],
            "partial_exchanges": st.partial_exchanges,
            "solo_steps": st.solo_steps,
            "resyncs": s.resyncs,
            "lost_samples": s.lost_samples,
            "group_size": st.last_group_size,
            "exchange_s": round(st.last_exchange_s, 4),
            "bytes_in": totals.wire_bytes if totals else 0,
            "samples_forward": c["samples_forward"],
            "busy_s": round(self.compute.busy_s, 3),
            "work_cpu_s": round(self._work_cpu_s(), 3),
            "moved": self.move_cost,
        }
        self.records.publish_metrics(self.peer_id, metrics, ttl_s=3 * self.options.metrics_period_s)
        logger.info("metrics %s", " ".join(f"{k}={v}" for k, v in metrics.items() if k != "role"))

    def shutdown(self) -> None:
        self.sync.stop()
        self._final_checkpoint()
        self.compute.stop()
        shutdown_quietly(self.averager, None if self.moving else self.dht)
        self.ledger.close()
        if not self.moving:
            self.runner.close()

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


def _leaving_answer() -> Message:
    return error_message("this replica is leaving the stage; try another", "unavailable")


def _timed(fn, request):
    start_s = time.perf_counter()
    reply = fn(request)
    return reply, time.perf_counter() - start_s
