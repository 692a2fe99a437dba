"""`swarmtrain trainer`: streams data and drives micro-batches through randomized pipelines.

Each micro-batch: token ids -> a stage-0 peer -> hidden states -> a stage-1 peer ... -> the last
stage gets hidden states and labels and does forward, loss and backward at once (fused: one round
trip less) -> gradients go back through the stages in reverse; any replica may take a backward (it
recomputes the forward from the input it is sent when it does not hold the activations).
The trainer relays encoded tensors as received (never decodes hidden states). Many micro-batches
are in flight at once; for every call a peer is chosen by IWRR (`PeerTable`), failures are retried
on another peer with bounded retries and backoff (runtime/trainer/call_policy.py).

Every micro-batch belongs to a global step (runtime/trainer/step_tracker.py): this trainer contributes
`global_batch_size / shard_count` samples to each step, and once a step's micro-batches are done at
a stage it tells that stage's replicas (`close`), which then exchange and apply exactly that step.
A stage runs a step's forwards only on the parameters after the previous step (synchronous steps,
as in one process), so at equal samples the swarm follows local training.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError
from swarmtrain.config.model import SUBSPACE
from swarmtrain.net.dht_records import RunRecords
from swarmtrain.net.dht_rejoin import keep_joined
from swarmtrain.net.engine import PeerNetwork
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.protocol import close_message, encode_labels, namespace
from swarmtrain.net.token_ids import IDS, encode_token_ids
from swarmtrain.net.transport import StageClient
from swarmtrain.planner.routing import BACKWARD_WEIGHT, FORWARD_CHARGE, FORWARD_WEIGHT, direct_from
from swarmtrain.planner.stop_step import StopAction
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.procs import remember_group_sockets
from swarmtrain.runtime.trainer.call_policy import CallStats, MicroBatchFailed
from swarmtrain.runtime.trainer.chain_calls import ChainCaller
from swarmtrain.runtime.trainer.close_calls import CLOSE_EXIT_WAIT_S, CLOSE_RETRY_S, deliver_close
from swarmtrain.runtime.trainer.peer_table import MISMATCH_GRACE_PERIODS, PeerTable, RunMismatch
from swarmtrain.runtime.trainer.stage_calls import StageCaller, direct_first_client
from swarmtrain.runtime.trainer.step_tracker import StepTracker
from swarmtrain.runtime.trainer.stop_agreement import STOP_POLL_S, StopAgreement
from swarmtrain.runtime.trainer.trainer_metrics import TrainerMetrics, TrainerResult, transport_summary
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# a validation micro-batch that failed every retry of the call policy is asked again this many times in
# all, after a pause of two announce periods (at least EVAL_PAUSE_MIN_S): the time a NAT'd server takes
# to redial the stage before it and a banned peer to announce itself again
EVAL_ROUNDS = 3
EVAL_PAUSE_MIN_S = 2.0


class ValidationFailed(RuntimeError):
    """A validation micro-batch failed every round: the val loss is not measured (training is done)."""


@dataclass
class TrainerOptions:
    codec: str | None = None  # default: the run config's swarm.compression
    max_in_flight: int = 4
    max_samples: int | None = None  # this trainer's own samples (with N shards, a run of S is S/N each)
    until_step: int | None = None  # stop once the run reaches this global step (the CLI's default)
    duration_s: float | None = None
    eval_samples: int = 0
    ledger_path: str | None = None
    trainer_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    # part of every micro-batch id: a restarted trainer with the same --trainer-id never reuses an id
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # ids unique per start
    shard_index: int = 0
    shard_count: int = 1
    network: PeerNetwork = field(default_factory=PeerNetwork)
    log_period_s: float = 5.0
    refresh_period_s: float | None = None  # default: the announce period
    # direct: servers hand activations and gradients to each other (net/hand_off.py); relay: every
    # tensor goes through the trainer (each stage called in turn, as before direct hand-off existed)
    hand_off: str = "direct"
    # chains over their first peer's data plane where it has one (net/direct_first.py); False: libp2p
    data_plane: bool = True


class SwarmTrainer:
    """Runs inside an asyncio loop; owns no parameters."""

    def __init__(
        self, cfg: RunConfig, options: TrainerOptions, dht, identity: PeerIdentity | None = None
    ) -> None:
        """`identity`: the key our DHT runs with, proven to the stage peers' data planes (None: libp2p only)."""
        self.cfg, self.options, self.dht, self.identity = cfg, options, dht, identity
        self.codec = options.codec or cfg.swarm.compression
        self.num_stages = cfg.swarm.num_stages
        self.digest = cfg.digest()
        self.records = RunRecords(dht, cfg.swarm.run_id)
        self.table = PeerTable(
            self.records,
            self.num_stages,
            self.digest,
            cfg.settings_summary(),
            MISMATCH_GRACE_PERIODS * cfg.swarm.announce_period_s,
        )
        self.ledger = Ledger(options.ledger_path)
        self.result = TrainerResult()
        self.stopping = asyncio.Event()
        self.client: StageClient | None = None
        self.caller: StageCaller | None = None
        self.tracker: StepTracker | None = None
        self.chain: ChainCaller | None = None  # direct hand-off, once set up
        self._close_tasks: set[asyncio.Task] = set()
        self.close_stats = CallStats()  # the closes' own: the summary's counters are the micro-batches'
        self._start_s = time.monotonic()
        self.stop_agreement: StopAgreement | None = None  # where --duration-s ends the run, once training
        self.mismatch: RunMismatch | None = None  # a stage's peers all run other settings: the run ends
        t = cfg.training
        step_samples, rest = divmod(t.global_batch_size, options.shard_count)
        if rest or step_samples % t.micro_batch_size:
            raise UserError(
                f"training.global_batch_size ({t.global_batch_size}) must split into {options.shard_count} "
                f"trainer shards of whole micro-batches of {t.micro_batch_size}"
            )
        self.micro_batches_per_step = step_samples // t.micro_batch_size

    async def setup(self) -> None:
        p2p = await self.dht.replicate_p2p()
        run_key = self.options.network.run_key
        self.client = StageClient(p2p, namespace(self.cfg), run_key=run_key)
        calls = direct_first_client(self.client, self.identity, run_key, self.table)
        self.caller = StageCaller(calls, self.table, self.cfg.swarm, self.digest, self.codec, self.stopping)
        if self.options.hand_off == "direct" and self.num_stages > 1:
            self.chain = ChainCaller(self.caller, self.num_stages, self.digest, self.codec)
        await self.caller.refresh()

    # training -----------------------------------------------------------------------------------
    async def train(self, batches_from, closes_wait_s: float = CLOSE_EXIT_WAIT_S) -> TrainerResult:
        """`batches_from(skip_samples)`: this shard's micro-batch stream after that many of its samples.
        Step k of the swarm takes the shard's samples [k * B/N, (k+1) * B/N): a trainer that starts at
        the swarm's step (a restart, a late joiner) continues the data where that step is.
        `closes_wait_s`: how long closes still being retried at the end are waited for (an evaluation
        after training needs them: it asks for the parameters after our last step)."""
        opts, res = self.options, self.result
        await self._wait_for_every_stage()
        res.start_step = self._swarm_step()
        shard_samples_per_step = self.micro_batches_per_step * self.cfg.training.micro_batch_size
        res.data_start_sample = res.start_step * shard_samples_per_step
        batches = batches_from(res.data_start_sample)
        self.tracker = StepTracker(self.num_stages, self.micro_batches_per_step, res.start_step, self._close)
        wait_s = self.cfg.swarm.request_timeout_s  # as long as a stage waits for a step's missing closes
        self.stop_agreement = StopAgreement(
            self.records, self.tracker, opts.shard_index, opts.shard_count, opts.duration_s, wait_s
        )
        where = (res.start_step, res.data_start_sample, opts.shard_index, opts.shard_count)
        logger.info("starting at global step %d (data: sample %d of shard %d/%d)", *where)
        start = self._start_s = time.monotonic()
        background = [
            asyncio.create_task(self._every(self._refresh_period_s(), self.caller.refresh)),
            asyncio.create_task(self._every(opts.log_period_s, self._report)),
        ]
        if opts.duration_s is not None and opts.shard_count > 1:
            background.append(asyncio.create_task(self._every(STOP_POLL_S, self.stop_agreement.watch)))
        in_flight: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(opts.max_in_flight)
        try:
            while await self._keep_going(start):
                await slots.acquire()
                if not await self._keep_going(start):
                    slots.release()
                    break
                self._start_micro_batch(batches, in_flight, slots)
            self.tracker.truncate()  # stopped mid-step (Ctrl-C): the stages close it short
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            await self._finish_closes(closes_wait_s)
        finally:
            res.elapsed_s = time.monotonic() - start
            res.steps_closed = self.tracker.closed_steps
            for task in background:
                task.cancel()
        return res

    def _start_micro_batch(self, batches, in_flight: set[asyncio.Task], slots: asyncio.Semaphore) -> None:
        """Take this shard's next micro-batch and start it, holding one of the slots until it is done."""
        opts, res = self.options, self.result
        data_start_s = time.perf_counter()
        inputs, labels = next(batches)
        res.data_wait_s += time.perf_counter() - data_start_s
        step = self.tracker.begin()
        mb = f"{opts.trainer_id}.{opts.incarnation}-{res.started}"
        res.started += 1
        self.ledger.write("start", mb=mb, n=int(inputs.shape[0]), step=step)
        task = asyncio.create_task(self._micro_batch(mb, step, inputs, labels))
        in_flight.add(task)
        task.add_done_callback(lambda t: (in_flight.discard(t), slots.release()))

    async def _keep_going(self, start: float) -> bool:
        """Start another micro-batch? No on a signal at once; at --max-samples, the run's last step or
        --duration-s only at a step boundary, so that every step is a whole global batch; with several
        shards on a time limit, only at the step they all agreed on (planner/stop_step.py)."""
        while True:
            if self.mismatch is not None:  # a micro-batch found a stage of other settings only
                raise self.mismatch
            if self.stopping.is_set():
                return False
            if self.tracker.step_in_progress:
                return True
            if self._at_limit():
                return False
            if not self.stop_agreement.time_is_up(start):
                return True
            decision = await self.stop_agreement.decide()
            if decision.action is StopAction.STOP:
                return False
            if decision.action is StopAction.GO:
                return True
            await asyncio.sleep(STOP_POLL_S)  # the other shards have not all proposed yet

    def _at_limit(self) -> bool:
        opts, per_step = self.options, self.micro_batches_per_step
        if opts.until_step is not None and self.tracker.next_step >= opts.until_step:
            return True
        if opts.max_samples is not None:
            steps = -(-opts.max_samples // (per_step * self.cfg.training.micro_batch_size))
            return self.result.started >= steps * per_step
        return False

    async def _wait_for_every_stage(self) -> None:
        """Before the first step: every stage has a live peer (its step tells where to start)."""
        for stage in range(self.num_stages):
            await self.caller.peers.wait_for_peer(stage)

    def _swarm_step(self) -> int:
        """The step the swarm is at: the highest parameter version any live server announces."""
        versions = [a.state_version for anns in self.table.announcements for a in anns.values()]
        return max(versions, default=0)

    def _close(self, step: int, stage: int, members: dict[str, int]) -> None:
        """Tell every replica of `stage` we know of that `step` is over there (and who has it)."""
        # a banned member (gone, or frozen) is waited for by nobody: its samples are not counted. It is
        # still told, as every banned replica is: a frozen one that wakes up applies the step with the
        # others instead of waiting for the close or resyncing
        participants = self.table.close_recipients(stage, members)
        members = {p: n for p, n in members.items() if not self.table.is_banned(p)}
        message = close_message(
            step,
            stage,
            self.digest,
            self.options.shard_index,
            self.options.shard_count,
            members,
            participants,
        )
        self.ledger.write("close", step=step, stage=stage, members=members)
        for peer in participants:
            task = asyncio.create_task(self._send_close(peer, stage, step, message))
            self._close_tasks.add(task)
            task.add_done_callback(self._close_tasks.discard)

    async def _finish_closes(self, wait_s: float) -> None:
        """At the end, wait a little for closes still being retried (to a peer that died since)."""
        if not self._close_tasks:
            return
        _, pending = await asyncio.wait(set(self._close_tasks), timeout=wait_s)
        for task in pending:
            task.cancel()
        if pending:
            logger.info("%d close(s) undelivered at exit (their peers are unreachable)", len(pending))

    async def _send_close(self, peer: str, stage: int, step: int, message) -> None:
        """Deliver a close (runtime/trainer/close_calls.py): a replica that never gets its step's close
        cannot apply the step, and a stage with one replica has nobody to resync from."""
        try:
            await deliver_close(self.client, self.caller.peers, self.close_stats, peer, stage, step, message)
        except Exception:  # a bug, not a failure of the peer: said, never lost with the task
            logger.exception("close of step %d to stage %d peer %s failed", step, stage, peer[-8:])

    async def _micro_batch(self, mb: str, step: int, input_ids, labels) -> None:
        n = int(input_ids.shape[0])
        try:
            loss = await self.forward_backward(mb, step, input_ids, labels)
        except RunMismatch as exc:  # no retry can help: the run ends with the error (`_keep_going`)
            self.mismatch = exc
            self.stopping.set()
            return
        except Exception as exc:  # MicroBatchFailed, or a bug: count it, never lose the task silently
            self.result.failed += 1
            self.ledger.write("failed", mb=mb, reason=str(exc))
            logger.warning("micro-batch %s failed: %s", mb, exc)
            return
        self.result.completed += 1
        self.result.samples += n
        self.result.losses.append((self.result.samples, loss))
        self.result.completed_ids.append(mb)
        self.ledger.write("done", mb=mb, n=n, loss=loss)

    async def forward_backward(self, mb: str, step: int, input_ids, labels) -> float:
        """One micro-batch of `step` through every stage and back; returns its loss. Every stage's
        outcome (accumulated where, or not at all) goes to the step tracker exactly once. With direct
        hand-off the trainer relays only the stages before `_direct_from` (none unless two NAT'd peers
        would have to hand off to each other)."""
        call, last, n = self.caller.call_peer, self.num_stages - 1, int(input_ids.shape[0])
        done: set[int] = set()
        try:
            first = self._direct_from(n)
            # stage 0's ids as int16, compact beside the labels of a hand-off from it (net/token_ids.py)
            x = encode_token_ids(input_ids, labels if first == 0 < last else None, self.cfg.model.vocab_size)
            stage_inputs, forward_peers = [], []
            for stage in range(first):
                tensors = {"inputs": x, **self._ids(stage, input_ids)}
                reply, peer = await call(
                    stage, "forward", mb, n, tensors, FORWARD_WEIGHT, charge=FORWARD_CHARGE, step=step
                )
                stage_inputs.append(x)
                forward_peers.append(peer)
                x = reply.tensors["outputs"]
            if first < last:
                loss, grad = await self._hand_off(mb, step, n, first, x, (input_ids, labels), done)
            else:
                tensors = {"inputs": x, "labels": encode_labels(labels, self.cfg.model.vocab_size)}
                tensors.update(self._ids(last, input_ids, labels))
                weight = FORWARD_WEIGHT + BACKWARD_WEIGHT
                reply, peer = await call(last, "forward_backward", mb, n, tensors, weight, step=step)
                self._finished(step, last, peer, reply, done)
                loss, grad = float(reply.header["loss"]), reply.tensors.get("grad_inputs")
            for stage in reversed(range(first)):
                # a later stage holds this micro-batch's gradient: giving up here would make the
                # stages disagree on the step's batch, so the call keeps trying
                reply, peer = await call(
                    stage,
                    "backward",
                    mb,
                    n,
                    {"inputs": stage_inputs[stage], "grad_outputs": grad, **self._ids(stage, input_ids)},
                    BACKWARD_WEIGHT,
                    prefer=forward_peers[stage],
                    persistent=True,
                    step=step,
                )
                self._finished(step, stage, peer, reply, done)
                grad = reply.tensors.get("grad_inputs")
            return loss
        finally:
            for stage in range(self.num_stages):
                if stage not in done and self.tracker is not None:
                    self.tracker.finished(step, stage)

    def _direct_from(self, n: int) -> int:
        """The first stage of this micro-batch's direct hand-offs (planner/routing.py `direct_from`, on
        the peers IWRR would pick now); the last stage when every hand-off is relayed."""
        if self.chain is None:
            return self.num_stages - 1
        if not self.table.any_behind_nat():  # the usual case: the routers are left as they are
            return 0
        peers = [self.table.choose(stage, n, 0.0) for stage in range(self.num_stages)]
        pairs = zip(peers[:-1], peers[1:], strict=True)
        return direct_from([self.table.can_hand_off(stage, a, b) for stage, (a, b) in enumerate(pairs)])

    def _ids(self, stage: int, input_ids, labels=None) -> dict:
        """The token ids a stage after a subspace boundary takes beside its inputs (net/token_ids.py),
        compact where the message carries `labels`; nothing for stage 0 or without subspace boundaries."""
        if stage == 0 or self.cfg.model.boundary != SUBSPACE:
            return {}
        return {IDS: encode_token_ids(input_ids, labels, self.cfg.model.vocab_size)}

    async def _hand_off(self, mb: str, step: int, n: int, first: int, inputs, tokens, done: set[int]):
        """Stages `first` to the last by direct hand-off: (loss, gradient of `first`'s inputs).
        `tokens`: the micro-batch's (input ids, labels)."""
        assert self.chain is not None
        input_ids, labels = tokens
        ids = self._ids(first, input_ids, labels).get(IDS)
        loss, hops, grad = await self.chain.run(
            mb, step, n, inputs, encode_labels(labels, self.cfg.model.vocab_size), first, ids
        )
        for hop in hops:
            if self.tracker is not None:
                self.tracker.finished(step, hop.stage, hop.peer, hop.acc)
            done.add(hop.stage)
        return loss, grad

    def _finished(self, step: int, stage: int, peer: str, reply, done: set[int]) -> None:
        """Tell the step tracker (absent when a probe drives single micro-batches)."""
        accumulated = reply.header.get("acc", 0)
        if self.tracker is not None:
            self.tracker.finished(step, stage, peer, accumulated if isinstance(accumulated, int) else 0)
        done.add(stage)

    async def evaluate(self, dataset, max_samples: int, step: int | None = None) -> float:
        """Mean loss over the first validation samples, computed through the swarm (forward only), by the
        same path as training: handed from server to server with direct hand-off (`--hand-off direct`),
        through the trainer with `relay`. A validation micro-batch keeps nothing anywhere, so one that
        failed is asked again after a pause (`EVAL_ROUNDS`); ValidationFailed when every round failed.
        `step`: the version every stage must have reached (default: after this trainer's last step)."""
        total, count = 0.0, 0
        version = step if step is not None or self.tracker is None else self.tracker.next_step
        pause_s = max(EVAL_PAUSE_MIN_S, 2 * self.cfg.swarm.announce_period_s)
        for i, (inputs, labels) in enumerate(
            dataset.ordered_batches(self.cfg.training.micro_batch_size, max_samples)
        ):
            mb, n = f"{self.options.trainer_id}.{self.options.incarnation}-eval{i}", int(inputs.shape[0])
            for round_ in range(1, EVAL_ROUNDS + 1):
                try:
                    loss = await self._evaluate_one(mb, n, inputs, labels, version)
                    break
                except MicroBatchFailed as exc:
                    if round_ == EVAL_ROUNDS:
                        raise ValidationFailed(f"{mb}: {EVAL_ROUNDS} rounds failed, last: {exc}") from None
                    # a path that broke (a relayed connection reset, a NAT'd server's connection closed)
                    # is back once the peers announce themselves again and the server redials
                    logger.warning("validation %s failed (%s); asking again in %.0f s", mb, exc, pause_s)
                    await asyncio.sleep(pause_s)
            total += loss * n
            count += n
        return total / max(count, 1)

    async def _evaluate_one(self, mb: str, n: int, inputs, labels, version) -> float:
        first, vocab_size = self._direct_from(n), self.cfg.model.vocab_size
        x = encode_token_ids(inputs, labels if first == 0 < self.num_stages - 1 else None, vocab_size)
        for stage in range(first):
            tensors = {"inputs": x, **self._ids(stage, inputs)}
            reply = await self.caller.call(stage, "evaluate", mb, n, tensors, FORWARD_WEIGHT, step=version)
            x = reply.tensors["outputs"]
        ids = self._ids(first, inputs, labels)
        if self.chain is not None and first < self.num_stages - 1:
            return await self.chain.evaluate(
                mb, n, x, encode_labels(labels, vocab_size), first, version, ids.get(IDS)
            )
        tensors = {"inputs": x, "labels": encode_labels(labels, vocab_size), **ids}
        reply = await self.caller.call(
            self.num_stages - 1, "evaluate", mb, n, tensors, FORWARD_WEIGHT, step=version
        )
        return float(reply.header["loss"])

    # background ---------------------------------------------------------------------------------
    def _refresh_period_s(self) -> float:
        return self.options.refresh_period_s or self.cfg.swarm.announce_period_s

    async def _every(self, period_s: float, fn) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()
            except Exception:
                logger.exception("periodic task failed")

    async def _report(self) -> None:
        res = self.result
        recent = [loss for _, loss in res.losses[-16:]]
        loss = sum(recent) / len(recent) if recent else float("nan")
        rate = res.samples / max(time.monotonic() - self._start_s, 1e-9)
        metrics = TrainerMetrics(
            samples=res.samples,
            loss=loss,
            samples_per_s=rate,
            completed=res.completed,
            failed=res.failed,
            in_flight=res.started - res.completed - res.failed,
            retries=self.caller.stats.retries,
            timeouts=self.caller.stats.timeouts,
            peers_per_stage=list(self.table.peers_per_stage()),
        )
        logger.info(
            "samples %d loss %.4f samples/s %.1f peers/stage %s in-flight %d failed %d",
            metrics.samples,
            loss,
            rate,
            metrics.peers_per_stage,
            metrics.in_flight,
            metrics.failed,
        )
        logger.info("%s", metrics.log_line())
        await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: self.records.publish_metrics(
                f"trainer-{self.options.trainer_id}", metrics.to_dict(), 3 * self.options.log_period_s
            ),
        )


async def train_async(
    cfg: RunConfig,
    options: TrainerOptions,
    dht,
    batches_from,
    val_set=None,
    initial_peers=None,
    identity=None,
) -> dict:
    import signal

    trainer = SwarmTrainer(cfg, options, dht, identity)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, trainer.stopping.set)
    await trainer.setup()
    remember_group_sockets()
    # a cut link can leave our DHT node knowing nobody (net/dht_rejoin.py)
    rejoining = asyncio.create_task(keep_joined(dht, initial_peers, cfg.swarm.announce_period_s))
    evaluating = bool(options.eval_samples and val_set is not None)
    # a close to a server reachable only through a relay is retried until the relay is reserved
    result = await trainer.train(batches_from, CLOSE_RETRY_S if evaluating else CLOSE_EXIT_WAIT_S)
    validation_error = None
    if evaluating and not trainer.stopping.is_set():
        try:
            result.val_loss = await trainer.evaluate(val_set, options.eval_samples)
        except ValidationFailed as exc:  # said, and the summary of the training is still written
            validation_error = str(exc)
            logger.warning("validation failed: %s", exc)
    summary = result.summary()
    summary["validation_error"] = validation_error
    if result.val_loss is not None:
        from swarmtrain.data import unigram_entropy_nats

        # the loss of predicting the corpus's token frequencies: a model must beat it to have learned
        summary["byte_frequency_val_loss"] = unigram_entropy_nats(val_set)
    summary.update(
        codec=trainer.codec,
        trainer_id=options.trainer_id,
        transport=transport_summary(trainer.client.stats),
        **trainer.caller.stats.summary(),
        rpc=trainer.caller.peers.timing_summary(),
    )
    trainer.ledger.close()
    trainer.caller.client.close()  # the data-plane links
    rejoining.cancel()
    return summary


def run_trainer(cfg: RunConfig, options: TrainerOptions, initial_peers: list[str]) -> dict:
    """Blocking entry point: DHT (client mode), data, train, optional evaluation; returns the summary."""
    from swarmtrain.data import build_datasets, iterate_batches
    from swarmtrain.net.engine import peer_identity, shutdown_quietly, start_dht
    from swarmtrain.runtime.procs import forked_children_die_with_me, reap_own_group

    forked_children_die_with_me()
    train_set, val_set = build_datasets(cfg)

    def batches_from(skip_samples: int):
        return iterate_batches(
            train_set,
            cfg.training.micro_batch_size,
            seed=cfg.training.seed,
            shard_index=options.shard_index,
            shard_count=options.shard_count,
            skip_samples=skip_samples,
        )

    identity = peer_identity(options.network) if options.data_plane else None
    dht = start_dht(initial_peers, options.network, client_mode=True, identity=identity)
    try:
        return asyncio.run(train_async(cfg, options, dht, batches_from, val_set, initial_peers, identity))
    finally:
        shutdown_quietly(dht)
        reap_own_group()
