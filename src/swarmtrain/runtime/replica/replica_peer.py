"""`swarmtrain replica`: an asynchronous full replica (ATOM's mode) synchronized with DiLoCo.

A replica trains the whole model on its data shard (`replica_inner.InnerTrainer`) and, every
`diloco.inner_steps` inner steps, joins an outer round: its pseudo-gradient (round start minus now)
is all-reduced with the replicas that reach the same round, weighted by samples, and every member
applies the mean to the round's starting weights with the outer optimizer (`model/diloco.py`).

Who takes part, and how replicas stay equal:
- Each replica publishes `{outer_step, inner_step, fp}` to the DHT every `log_period_s / 2`; `fp` is
  a fingerprint of the anchor (the weights the round started from). Records expire, so a dead
  replica stops being waited for after `RECORD_TTL_S`.
- At a round's end a replica waits until the live replicas of its outer step have reached the round's
  end too (their records say so), at most `diloco.matchmaking_time_s`: a dead replica stops being
  waited for when its record expires, a slower one is left out and catches up by download. Then it
  asks hivemind for a group of exactly the arrived ones. Alone, its weights become the next anchor as they are.
- Members gather each other's `(outer_step, fp)`. Members that started the round from the same
  anchor as the reference member (highest outer step, then lowest peer id; fingerprints within the
  codec's rounding, `planner/outer_rounds.py`) apply the mean; any other member, and a replica that
  finds the others already past its round, downloads the state (anchor, outer momentum, AdamW) of a
  replica that has applied the round instead.
- A joiner downloads that state from a live replica and starts at the others' current inner step,
  so it ends the round with them and contributes the samples it trained (its weight is smaller).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError
from swarmtrain.model.device import CPU_FP32, ComputeDevice
from swarmtrain.model.diloco import OuterOptimizer
from swarmtrain.model.optim import adam_state_tensors, load_adam_state
from swarmtrain.net.engine import PeerNetwork
from swarmtrain.net.outer_averaging import WIRE_BYTES_PER_ELEMENT, RoundResult
from swarmtrain.net.robust import norm_of
from swarmtrain.planner import download_deadline as downloads
from swarmtrain.planner.outer_rounds import (
    INITIAL_LINEAGE,
    RoundState,
    member_weight,
    next_lineage,
    round_state,
    started_from_reference,
)
from swarmtrain.runtime.faults import NO_FAULTS, FaultHooks
from swarmtrain.runtime.replica.download_set_aside import DownloadSetAside
from swarmtrain.runtime.replica.replica_inner import InnerTrainer
from swarmtrain.runtime.replica.replica_metrics import log_progress
from swarmtrain.runtime.replica.round_repair import RoundRepair
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

RECORD_TTL_S = 6.0
PEER_POLL_S = 0.2
# everyone expected is already at the round's end: hivemind's matchmaking only has to gather them
MATCHMAKING_S = 1.0
GROUP_TIMEOUT_S = 10.0
ROUND_WEIGHT_FLOOR = 1e-3  # a joiner at the round's end trained nothing in it: a small weight, not zero
LINGER_S = 30.0  # at the run's end: how long a replica stays for another still finishing its last round
ANCHOR_NORM_RATIO = 3.0  # a downloaded model whose norm is beyond this many times ours is refused
# after a refused donor state, the next resyncs go on without a download, 2 then 4, ... at most 32:
# hivemind serves the same donor's state first each time (the highest sharing priority)


@dataclass
class ReplicaOptions:
    shard_index: int = 0
    shard_count: int = 1
    max_samples: int | None = None  # of the whole run: stop at inner step max_samples / global batch
    wait_for_replicas: int = 1  # start training once this many replicas are announced
    duration_s: float | None = None
    eval_samples: int = 0
    log_period_s: float = 5.0
    threads: int | None = None
    swap_budget_bytes: float | None = None  # stream the blocks through `compute.device` within this budget
    compute: ComputeDevice = CPU_FP32
    init_from_hf: str | None = None  # initial weights from this Hugging Face model directory (--init-from-hf)
    download_rule: downloads.DownloadRule = downloads.DEFAULT_RULE  # --state-download-min-mbit, -base-s
    faults: FaultHooks = NO_FAULTS  # a faulty replica, for tests (runtime/faults.py)


@dataclass
class ReplicaSummary:
    replica_id: str
    shard: str
    start_inner_step: int = 0
    inner_steps: int = 0  # trained by this replica
    samples: int = 0  # trained by this replica
    outer_steps: int = 0  # the run's outer step at the end
    rounds_averaged: int = 0  # rounds applied with at least one other replica
    rounds_alone: int = 0
    rounds_resynced: int = 0  # rounds replaced by a download (behind or diverged)
    rounds_partial: int = 0  # rounds whose all-reduce kept some parts local (hivemind)
    rounds_repaired: int = 0  # partial rounds filled from a member's mean (round_repair.py)
    group_sizes: list[int] = field(default_factory=list)
    # what became of each outer round this replica ended, by outer step: averaged | repaired | partial
    # (left unlike the group) | alone | resynced (replaced by a download)
    round_outcomes: dict[str, str] = field(default_factory=dict)
    corrupted_rounds_sent: int = 0  # rounds a faulty replica (runtime/faults.py) sent scaled or NaN
    sync_bytes_sent: float = 0.0  # pseudo-gradient bytes this replica put on the wire (estimated)
    state_bytes_received: int = 0  # state downloads (joining, resyncs)
    repair_bytes_received: int = 0  # round means fetched to repair partial rounds
    joined_from: str = "fresh"  # fresh | peers
    initial_loss: float | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float = 0.0
    wall_s: float = 0.0
    fingerprint: float = 0.0
    final_inner_step: int = 0  # the global local step it stopped at (max_samples / global batch at the end)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fingerprint(tensors: list[torch.Tensor]) -> float:
    """float64 sum of |x| over tensors: equal weights give bitwise-equal sums."""
    return float(sum(float(torch.linalg.vector_norm(t, 1, dtype=torch.float64)) for t in tensors))


class ReplicaPeer:
    """One replica: inner trainer + outer optimizer + averager + DHT records. `run()` trains to the end."""

    def __init__(
        self, cfg: RunConfig, options: ReplicaOptions, dht, records, averager_factory, repair_factory
    ) -> None:
        self.cfg, self.options, self.records, self.dht = cfg, options, records, dht
        self.digest = cfg.digest()
        self.peer_id = str(dht.peer_id)
        self.inner = InnerTrainer(
            cfg,
            options.shard_index,
            options.shard_count,
            swap_budget_bytes=options.swap_budget_bytes,
            compute=options.compute,
            init_from_hf=options.init_from_hf,
        )
        if self.inner.swapped is not None:
            plan = self.inner.swapped.plan
            logger.info(
                "model swapping: %d blocks stream through %s in %d groups %s (peak %.1f MB of the budget)",
                cfg.model.num_layers,
                options.compute.device,
                plan.num_groups,
                list(plan.groups),
                plan.peak_bytes / 2**20,
            )
        d = cfg.diloco
        self.outer = OuterOptimizer(self.inner.params(), d.outer_learning_rate, d.outer_momentum)
        self.state_params = sum(map(torch.numel, self.outer.anchor))  # what the download rule sizes
        self.state_lock = threading.Lock()  # the state provider runs on hivemind's thread
        self.lineage = INITIAL_LINEAGE  # which rounds, applied by whom, made the anchor
        self.averager = averager_factory(self.outer.anchor, self._export_state)
        # after the averager's fork: the repair's RPC runs on an event loop thread
        self.repair: RoundRepair = repair_factory()
        self.summary = ReplicaSummary(
            replica_id=self.peer_id, shard=f"{options.shard_index}/{options.shard_count}"
        )
        t = cfg.training
        self.stop_step = (options.max_samples or t.max_samples) // t.global_batch_size
        self.round_samples = 0
        self._sent: list[torch.Tensor] = []  # this round's pseudo-gradients as sent to the all-reduce
        self.set_aside = DownloadSetAside()  # resyncs without a download after a refused state

    # state for joiners ------------------------------------------------------------------------
    def _export_state(self) -> tuple[dict, list[torch.Tensor]]:
        with self.state_lock:
            params = self.inner.params()
            tensors = [a.clone() for a in self.outer.anchor]
            tensors += [m.clone() for m in self.outer.momentum_buffers()]
            tensors += adam_state_tensors(self.inner.optimizer, params)
            meta = {
                "digest": self.digest,
                "outer_step": self.outer.outer_step,
                "lineage": self.lineage,
            }
        return meta, tensors

    def _import_state(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        n = len(self.outer.anchor)
        if meta.get("digest") != self.digest or len(tensors) != 5 * n:
            raise UserError("downloaded replica state does not match this run (digest or size)")
        _check_plausible(tensors[:n], self.outer.anchor)
        with self.state_lock:
            self.outer.load(tensors[:n], tensors[n : 2 * n], int(meta["outer_step"]))
            self.lineage = str(meta.get("lineage", ""))
            load_adam_state(self.inner.optimizer, self.inner.params(), tensors[2 * n :])

    def _download(self, reason: str, retry: bool = False, left_s: float = math.inf) -> str:
        """ "done", "failed" (no donor answered in time) or "refused" (a donor's state this replica will not
        load: another run's, or implausible weights). `retry`: a repeated try of one resync (logged at
        debug); `left_s`: the time left to its deadline."""
        plan = downloads.replica_plan(self.state_params, left_s, self.options.download_rule)
        loaded = self.averager.download_state(*plan)
        if loaded is None:
            logger.log(
                logging.DEBUG if retry else logging.WARNING, "replica state download failed (%s)", reason
            )
            return "failed"
        self.summary.state_bytes_received += sum(t.numel() * t.element_size() for t in loaded[1])
        try:
            self._import_state(*loaded)
        except (UserError, ValueError) as exc:
            logger.warning("downloaded replica state refused (%s): %s", reason, exc)
            return "refused"
        logger.info("replica state downloaded (%s): outer step %d", reason, self.outer.outer_step)
        return "done"

    # records ----------------------------------------------------------------------------------
    def _others(self) -> dict[str, dict]:
        return {k: v for k, v in self.records.replicas(self.digest).items() if k != self.peer_id}

    def _publish_periodically(self, stop: threading.Event) -> None:
        """Keeps this replica's record alive while the main thread waits in a round (longer than the
        record's TTL at times): the others must not take a waiting replica for a dead one."""
        while not stop.wait(RECORD_TTL_S / 4):
            self.publish()

    def publish(self) -> None:
        with self.state_lock:
            anchor_fp = fingerprint(self.outer.anchor)
        record = {
            "digest": self.digest,
            "outer_step": self.outer.outer_step,
            "inner_step": self.inner.step,
            "fp": anchor_fp,
            "samples_per_s": self.summary.samples_per_s,
            "loss": self.summary.final_loss,
        }
        self.records.publish_replica(self.peer_id, record, RECORD_TTL_S)

    # joining ----------------------------------------------------------------------------------
    def wait_for_replicas(self, count: int, timeout_s: float = 300.0) -> None:
        """Before training: until `count` replicas (this one included) are announced, so replicas started
        together begin together (one that starts a few seconds late would join by download and skip
        the samples the others trained meanwhile). Replicas already past their first round end it."""
        if count <= 1:
            return
        self.publish()
        deadline = time.monotonic() + timeout_s
        logger.info("waiting for %d replica(s) before training", count)
        while len(others := self._others()) + 1 < count:
            if any(v["inner_step"] > 0 for v in others.values()):
                return  # training has started without us: join it
            if time.monotonic() > deadline:
                raise UserError(
                    f"--wait-for-replicas {count}: only {len(others) + 1} after {timeout_s:.0f} s"
                )
            time.sleep(PEER_POLL_S)

    def join(self) -> None:
        """Take the live replicas' outer state and inner position, or start fresh when there are none."""
        state_bytes = downloads.state_bytes(self.state_params, downloads.REPLICA_COPIES)
        logger.info("state downloads: %s", downloads.describe(state_bytes, self.options.download_rule))
        others = self._others()
        if (
            others
            and max(v["outer_step"] for v in others.values()) > 0
            and self._download("joining") == "done"
        ):
            self.summary.joined_from = "peers"
            self._adopt_position(self._others())
        elif others:  # the others have not finished a round yet: start their first round with them
            self.inner.seek(max(v["inner_step"] for v in others.values()))
        self.summary.start_inner_step = self.inner.step
        self.publish()

    def _adopt_position(self, others: dict[str, dict]) -> None:
        """After a download: train on from the others' inner step in this outer step, so this replica
        reaches the round's end with them (the skipped samples are theirs to train)."""
        start = self.outer.outer_step * self.cfg.diloco.inner_steps
        at_round = [v["inner_step"] for v in others.values() if v["outer_step"] == self.outer.outer_step]
        self.inner.seek(max([start, *at_round]))

    # the outer round --------------------------------------------------------------------------
    def outer_round(self) -> None:
        k = self.outer.outer_step
        try:
            self._outer_round(k)
        finally:
            self.repair.round_done(k)  # a member asking for this round's mean is answered at once now

    def _outer_round(self, k: int) -> None:
        self.publish()  # tells the others this replica is at the round's end
        others = self._wait_for_peers(k)
        if any(v["outer_step"] > k for v in others.values()):
            self._resync(k, f"the others are past outer step {k}")
            return
        arrived = [
            p for p, v in others.items() if v["outer_step"] == k and v["inner_step"] >= self.inner.step
        ]
        result = self._average(len(arrived) + 1, k) if arrived else None
        if result is None:
            with self.state_lock:
                self.outer.rebase()
                self.lineage = next_lineage(k, [self.peer_id], self.lineage)
            self.summary.rounds_alone += 1
            self.summary.round_outcomes[str(k)] = "alone"
        elif self._is_reference_member(result.gathered, k):
            repaired = not result.complete
            if repaired:
                result = self._repaired(result, k)
            with self.state_lock:
                self.outer.apply(result.averaged)
                # a partial all-reduce the members' means could not fill leaves this member unlike the
                # others: a lineage of its own makes the next round resync whoever is not the reference
                members = list(result.gathered) if result.complete else [self.peer_id]
                self.lineage = next_lineage(k, members, self.lineage)
            if not result.complete:
                logger.warning("outer step %d: part of the all-reduce never came back; resync next round", k)
            self.summary.round_outcomes[str(k)] = _averaged_outcome(result, repaired)
            self.summary.rounds_averaged += 1
            self.summary.group_sizes.append(result.group_size)
            self._count_bytes(result.group_size)
        else:
            self._count_bytes(result.group_size)
            self._resync(k, f"started outer step {k} from other weights than the group")
            return
        self.round_samples = 0
        self._advertise_state()
        self.publish()  # the others must not wait for this replica at a round it has left

    def _wait_for_peers(self, k: int) -> dict[str, dict]:
        """Until every live replica of outer step k has reached this round's end, at most
        `diloco.matchmaking_time_s`: a dead one's record expires (RECORD_TTL_S) and stops the wait,
        a slower one is left out and catches up by download."""
        deadline = time.monotonic() + self.cfg.diloco.matchmaking_time_s
        while True:
            others = self._others()
            position = (k, self.inner.step)
            behind = [p for p, v in others.items() if (v["outer_step"], v["inner_step"]) < position]
            if not behind or time.monotonic() >= deadline:
                return others
            time.sleep(PEER_POLL_S)

    @property
    def _weight(self) -> float:
        """This replica's weight in the round's all-reduce: the samples it trained in the round."""
        return float(self.round_samples or ROUND_WEIGHT_FLOOR)

    def _average(self, group_target: int, k: int) -> RoundResult | None:
        self.averager.set_group_target(group_target)
        gather = {
            "outer_step": k,
            "lineage": self.lineage,
            "fp": fingerprint(self.outer.anchor),
            "samples": self.round_samples,
            "serves": self.serves_state,
        }
        honest = self.outer.pseudo_gradients()
        self._sent = self.options.faults.corrupted(honest, k)
        self.summary.corrupted_rounds_sent += self._sent is not honest
        result = self.averager.average(
            self._sent, weight=self._weight, gather=gather, timeout_s=GROUP_TIMEOUT_S
        )
        if result is not None:
            self.repair.offer(k, result.averaged, self._sent)  # members whose round came back partial may ask
        return result

    def _repaired(self, result: RoundResult, k: int) -> RoundResult:
        """A partial round with the values that stayed local filled from the other members' means of it;
        `result` unchanged (still partial) when they could not fill it."""
        self.summary.rounds_partial += 1
        before = self.repair.bytes_received
        # the weights the all-reduce used: each member's samples of the round (ours as `_average` gave it)
        weights = {p: member_weight(g, ROUND_WEIGHT_FLOOR) for p, g in result.gathered.items()}
        weights[self.peer_id] = self._weight
        merged = self.repair.repair(k, self._sent, result.averaged, weights, self.peer_id)
        self.summary.repair_bytes_received += self.repair.bytes_received - before
        if merged is None:
            return result
        self.summary.rounds_repaired += 1
        self.repair.offer(k, merged, self._sent)
        logger.info("outer step %d: partial all-reduce repaired from a member's mean", k)
        return dataclasses.replace(result, averaged=merged, complete=True)

    def _is_reference_member(self, gathered: dict[str, dict], k: int) -> bool:
        states = {p: round_state(g) for p, g in gathered.items()}
        states[self.peer_id] = RoundState(k, self.lineage, fingerprint(self.outer.anchor), self.serves_state)
        return started_from_reference(states, self.peer_id)

    def _resync(self, k: int, reason: str) -> None:
        """Replace round k by the state of a replica that has applied it (or a later one)."""
        self.summary.rounds_resynced += 1
        self.summary.round_outcomes[str(k)] = "resynced"
        if not self.set_aside.take():  # taken: a donor's state was refused lately, not downloaded again yet
            self._download_past(k, reason)
        self._adopt_position(self._others())
        self.round_samples = 0
        self._advertise_state()
        self.publish()

    def _download_past(self, k: int, reason: str) -> None:
        """Download the state of a replica past round k, within the download rule's deadline."""
        target = self.outer.outer_step + 1
        rule = self.options.download_rule
        deadline = time.monotonic() + downloads.replica_deadline_s(self.state_params, rule)
        tried = False
        while time.monotonic() < deadline:
            steps = [v["outer_step"] for v in self._others().values()]
            if not any(step >= target for step in steps):
                if any(step == k for step in steps):
                    # the reference of round k may still be applying it (it publishes the next outer
                    # step after): giving up now would leave this replica on other weights for good
                    time.sleep(PEER_POLL_S)
                    continue
                # the replicas ahead left (their records expired): nobody to download from
                logger.warning("no live replica past outer step %d to download from: this one goes on", k)
                return
            outcome = self._download(reason, tried, deadline - time.monotonic())
            if outcome == "done" and self.outer.outer_step >= target:
                self.set_aside.loaded()
                return
            if outcome == "refused":
                logger.warning(
                    "the replica ahead serves a state this one refuses: this one goes on, and skips the "
                    "download of its next %d resync(s)",
                    self.set_aside.refused(),
                )
                return
            tried = True
            time.sleep(PEER_POLL_S)  # the donor is still applying the round

    @property
    def serves_state(self) -> bool:
        """Whether others can download this replica's state: a client-mode replica (behind a NAT)
        accepts no connections."""
        return not self.averager.client_mode

    def _advertise_state(self) -> None:
        """Late joiners download from the replica furthest ahead. A replica that serves no download
        advertises nothing (hivemind raises on a priority for a client-mode one)."""
        if self.serves_state:
            self.averager.state_sharing_priority = float(self.outer.outer_step)

    def _count_bytes(self, group_size: int) -> None:
        # butterfly all-reduce: each member sends (n-1)/n of the vector to reduce and as much of the
        # reduced result back
        elements = sum(t.numel() for t in self.outer.anchor)
        per_element = WIRE_BYTES_PER_ELEMENT[self.cfg.diloco.compression]
        self.summary.sync_bytes_sent += 2 * elements * per_element * (group_size - 1) / group_size

    # the run ----------------------------------------------------------------------------------
    def run(self, stop_event: threading.Event | None = None) -> ReplicaSummary:
        stop_event = stop_event or threading.Event()
        start = time.monotonic()
        next_log = start
        publishing = threading.Event()
        threading.Thread(target=self._publish_periodically, args=(publishing,), daemon=True).start()
        try:
            return self._train(stop_event, start, next_log)
        finally:
            publishing.set()

    def _train(self, stop_event: threading.Event, start: float, next_log: float) -> ReplicaSummary:
        opts, d, t = self.options, self.cfg.diloco, self.cfg.training
        losses: list[float] = []
        while self.inner.step < self.stop_step and not stop_event.is_set():
            if self._round_due():  # a download put us at a round's end where the others wait
                self.outer_round()
                continue
            if opts.duration_s is not None and time.monotonic() - start >= opts.duration_s:
                break
            with self.state_lock:
                loss = self.inner.train_step()
            losses.append(loss)
            self.round_samples += self.inner.batch_samples
            self.summary.samples += self.inner.batch_samples
            self.summary.inner_steps += 1
            if self.summary.initial_loss is None:
                self.summary.initial_loss = loss
            if self._round_due():
                self.outer_round()
            now = time.monotonic()
            self.summary.samples_per_s = self.summary.samples / max(now - start, 1e-9)
            self.summary.final_loss = sum(losses[-10:]) / len(losses[-10:])
            if now >= next_log:
                log_progress(
                    self.summary, self.inner.step, self.stop_step, self.outer.outer_step, t.global_batch_size
                )
                next_log = now + opts.log_period_s
        if self.round_samples and self.inner.step % d.inner_steps:
            self.outer_round()  # stopped mid-round (duration or Ctrl-C): the others get its samples
        self.summary.wall_s = time.monotonic() - start
        self.summary.outer_steps = self.outer.outer_step
        self.summary.final_inner_step = self.inner.step
        self.summary.fingerprint = fingerprint(self.outer.anchor)
        if opts.eval_samples:
            self.summary.val_loss = self.inner.val_loss(opts.eval_samples)
        self.publish()
        if not stop_event.is_set():
            self._serve_the_last_round(stop_event)
        return self.summary

    def _serve_the_last_round(self, stop_event: threading.Event) -> None:
        """At the run's end, stay (at most LINGER_S) while a live replica is still behind this one's
        outer step: it resyncs from a replica past its round, and with the last round's reference gone
        it would stay on its own weights for good."""
        deadline = time.monotonic() + LINGER_S
        while not stop_event.is_set():
            behind = [p for p, v in self._others().items() if v["outer_step"] < self.outer.outer_step]
            if not behind:
                return
            if time.monotonic() >= deadline:
                logger.info("leaving with %d replica(s) still behind this one's last round", len(behind))
                return
            time.sleep(PEER_POLL_S)

    def _round_due(self) -> bool:
        """At the end of this replica's current round: local step (outer step + 1) x H, or the last."""
        end = (self.outer.outer_step + 1) * self.cfg.diloco.inner_steps
        return self.inner.step >= min(end, self.stop_step) and self.inner.step > 0


def _averaged_outcome(result: RoundResult, repair_tried: bool) -> str:
    if not result.complete:
        return "partial"  # the members' means could not fill it
    return "repaired" if repair_tried else "averaged"


def _check_plausible(anchor: list[torch.Tensor], own: list[torch.Tensor]) -> None:
    """Refuse a donor's weights that are non-finite or far larger than ours: a faulty replica (one
    whose rounds were dropped as non-finite or clipped) serves state too, and an honest replica that
    resynced from it ended at val loss 4e5 (tests/faults/test_byzantine_replica.py). Training moves
    a model's norm by far less than ANCHOR_NORM_RATIO, from initial weights (a joiner) included."""
    if not all(bool(torch.isfinite(t).all()) for t in anchor):
        raise ValueError("the donor's weights are not finite")
    theirs, mine = norm_of(anchor), norm_of(own)
    if theirs > ANCHOR_NORM_RATIO * mine:
        raise ValueError(f"the donor's weights have norm {theirs:.3g}, ours {mine:.3g}: implausible")


def run_replica(
    cfg: RunConfig, options: ReplicaOptions, initial_peers: list[str], network: PeerNetwork | None = None
) -> dict:
    """Blocking entry point: DHT, averager, join, train to the end; returns the summary. SIGINT/SIGTERM
    end the run after the current inner step, with a last outer round so the others keep its samples."""
    import signal

    from swarmtrain.net.dht_records import RunRecords, replicas_key
    from swarmtrain.net.engine import shutdown_quietly, start_dht
    from swarmtrain.net.outer_averaging import OuterAverager
    from swarmtrain.runtime.procs import forked_children_die_with_me, reap_own_group

    forked_children_die_with_me()
    if options.threads:
        torch.set_num_threads(options.threads)
    d = cfg.diloco
    dht = start_dht(initial_peers, network)
    averager = None

    def make_averager(anchor, state_provider):
        nonlocal averager
        averager = OuterAverager(
            anchor,
            dht,
            prefix=f"{cfg.swarm.run_id}_replicas_{cfg.digest()}",
            state_provider=state_provider,
            compression=d.compression,
            matchmaking_time_s=MATCHMAKING_S,
            allreduce_timeout_s=d.averaging_timeout_s,
            members_keys=(replicas_key(cfg.swarm.run_id),) if network and network.run_key else (),
            client_mode=bool(network and network.client_mode),
            drop_results_in=options.faults.drop_results_in,
        )
        return averager

    def make_repair():
        nonlocal repair
        repair = RoundRepair(cfg, dht, d.compression, network.run_key if network else None)
        return repair

    repair: RoundRepair | None = None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        records = RunRecords(dht, cfg.swarm.run_id)
        peer = ReplicaPeer(cfg, options, dht, records, make_averager, make_repair)
        peer.wait_for_replicas(options.wait_for_replicas)
        peer.join()
        return peer.run(stop).to_dict()
    finally:
        if repair is not None:
            repair.close()
        shutdown_quietly(averager, dht)
        reap_own_group()
