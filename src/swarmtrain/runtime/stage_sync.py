"""Intra-stage synchronization: when the replicas of a stage have together processed the global batch,
average their gradients (weighted by samples) and step; keep lagging or diverged replicas in line.

The request path only accumulates and counts (runtime/stage_worker.py). This loop runs on its own
thread and drives everything from shared state in the DHT, not from traffic (notes 3.2):
- each replica publishes `{epoch, samples, ready, grad_fp}` under `{run}.stage{i}.progress`;
- when the sum of samples at this epoch reaches `global_batch_size`, or any peer at this epoch says
  `ready`, the replica takes its gradients out (snapshot) and joins a round whose group size is
  the number of replicas at this epoch and whose group key is the epoch;
- a failed round puts the snapshot back and is retried; a dead peer drops out of the count when
  its progress record expires, and the survivors then step without it;
- a partial round (fewer peers than expected) is counted; afterwards replicas compare a
  fingerprint of the averaged gradients, and the one with the larger peer id resyncs on mismatch;
- a replica that sees a peer at a higher epoch stops serving, drops its accumulation (recorded
  as lost), downloads parameters and optimizer state (`load_state_from_peers`) and serves again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from swarmtrain.runtime.compute import PRIORITY_SYNC, ComputeWorker
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.stage_worker import Snapshot, StageWorker
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

FINGERPRINT_RTOL = 1e-3


@dataclass
class SyncSettings:
    global_batch_size: int
    tick_s: float = 0.25
    heartbeat_s: float = 1.0
    progress_ttl_s: float = 4.0
    find_group_timeout_s: float = 5.0
    averaging_timeout_s: float = 30.0
    download_timeout_s: float = 60.0
    compute_timeout_s: float = 120.0
    view_max_age_s: float = 3.0  # decisions use the background view while it is this fresh


@dataclass
class SyncCounters:
    rounds: int = 0
    partial_rounds: int = 0
    failed_rounds: int = 0
    solo_steps: int = 0
    resyncs: int = 0
    lost_samples: int = 0
    last_group_size: int = 0
    last_round_s: float = 0.0
    extra: dict = field(default_factory=dict)


class StageSynchronizer:
    def __init__(
        self,
        worker: StageWorker,
        compute: ComputeWorker,
        averager,
        records,
        peer_id: str,
        digest: str,
        settings: SyncSettings,
        ledger: Ledger | None = None,
    ) -> None:
        self.worker, self.compute, self.averager, self.records = worker, compute, averager, records
        self.peer_id, self.digest, self.settings = peer_id, digest, settings
        self.stage = worker.spec.index
        self.ledger = ledger or Ledger(None)
        self.counters = SyncCounters()
        self.serving = threading.Event()
        self.stop_event = threading.Event()
        self._grad_fp: list[float] | None = None
        self._ready = False
        self._publish_now = threading.Event()
        self._view: dict[str, dict] = {}
        self._known_epochs: dict[str, int] = {}  # peers seen in our rounds: at least this epoch
        self._hints: dict[
            str, tuple[int, float]
        ] = {}  # peer -> (epoch, time) of a round it told us it started
        self.notify_peers = None  # callback(peers, epoch): tell stage peers a round starts (direct RPC)
        self._view_time_s = float("-inf")
        self._last_view_s = 0.0
        self._threads: list[threading.Thread] = []
        self._wake = threading.Event()
        worker.on_accumulate = self._wake.set  # the worker froze a global batch: start the round now

    # life cycle ---------------------------------------------------------------------------------
    def join(self) -> None:
        """Before serving: catch up with the stage if its replicas have already stepped."""
        self._start_thread(self._publish_loop, "stage-progress")
        self.publish(force=True)
        others = self._others()
        if any(p["epoch"] > self.worker.epoch for p in others.values()):
            self.resync("joining a stage that has already trained")
        self.averager.state_sharing_priority = float(self.worker.epoch)
        self.serving.set()
        self.publish(force=True)

    def start(self) -> None:
        """Start the decision loop and the DHT reader (the publisher already runs since `join`)."""
        self._start_thread(self._loop, "stage-sync")
        self._start_thread(self._view_loop, "stage-view")

    def _view_loop(self) -> None:
        """Keep the view of the stage's progress fresh, so decisions never wait for a DHT read."""
        while not self.stop_event.is_set():
            try:
                self._others()
                self._wake.set()
            except Exception:
                logger.exception("reading stage progress failed")
            self.stop_event.wait(self.settings.tick_s)

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        self._wake.set()
        self._publish_now.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.tick()
            except Exception:  # keep syncing; a bug here must not silently stop training
                logger.exception("stage sync tick failed")
            self._wake.wait(self.settings.tick_s)
            self._wake.clear()

    # one decision -------------------------------------------------------------------------------
    def on_round_hint(self, peer: str, epoch: int) -> None:
        """A stage peer says it started the round of `epoch` (called from the RPC handler)."""
        self._hints[peer] = (epoch, time.monotonic())
        self._wake.set()

    def tick(self) -> None:
        epoch = self.worker.epoch
        # a hint is good for one round attempt: a peer that died after sending it must not keep
        # pulling us into rounds it will never join
        oldest = time.monotonic() - self.settings.find_group_timeout_s
        self._hints = {p: (e, t) for p, (e, t) in self._hints.items() if e >= epoch and t >= oldest}
        hinted = {p for p, (e, _t) in self._hints.items() if e == epoch}
        view_same = {
            p for p, v in self._view.items() if max(v["epoch"], self._known_epochs.get(p, -1)) == epoch
        }
        if hinted:  # join a round a peer started, without waiting for the DHT to show it
            for peer in hinted:
                del self._hints[peer]
            self.run_round(1 + len(hinted | view_same), [])
            return
        if self.worker.frozen is not None and self._view_fresh():
            # fast path: the cut is made and the view is recent; no DHT round trip before the round
            self.run_round(1 + len(view_same), sorted(view_same))
            return
        others = self._adjusted(self._view) if self._view_fresh(check_ahead=False) else self._others()
        ahead = {p: v["epoch"] for p, v in others.items() if v["epoch"] > epoch}
        if ahead:
            self.resync(f"peers are ahead (epochs {sorted(set(ahead.values()))} > {epoch})")
            return
        same = {p: v for p, v in others.items() if v["epoch"] == epoch}
        if self._diverged_from(same):
            self.resync("parameters diverged from a peer after a partial round")
            return
        self.worker.others_samples = sum(v["samples"] for v in same.values())
        total = self.worker.unapplied_samples + self.worker.others_samples
        if total >= self.settings.global_batch_size or any(v.get("ready") for v in same.values()):
            self.run_round(1 + len(same), list(same))
        else:
            self.publish()

    def run_round(self, group_size: int, notify: list[str]) -> None:
        epoch, start = self.worker.epoch, time.monotonic()
        self.publish(ready=True, force=True)
        if notify and self.notify_peers is not None:
            self.notify_peers(notify, epoch)
        snapshot: Snapshot = self._on_compute(self.worker.take_round_snapshot)
        means = [
            g / snapshot.samples if snapshot.samples else torch.zeros_like(g) for g in snapshot.grad_sums
        ]
        if group_size == 1:
            averaged, gathered = means, {self.peer_id: {"epoch": epoch, "samples": snapshot.samples}}
            self.counters.solo_steps += 1
        else:
            self.averager.configure_round(epoch, group_size)
            result = self.averager.average(
                means,
                snapshot.samples,
                {"epoch": epoch, "samples": snapshot.samples},
                find_group_timeout_s=self.settings.find_group_timeout_s,
                allreduce_timeout_s=self.settings.averaging_timeout_s,
            )
            if result is None or {g.get("epoch") for g in result.gathered.values()} != {epoch}:
                self._on_compute(lambda: self.worker.restore_snapshot(snapshot))
                self.counters.failed_rounds += 1
                logger.warning("round at epoch %d failed (expected %d peers); retrying", epoch, group_size)
                return
            averaged, gathered = result.averaged, result.gathered
            if result.group_size < group_size:
                self.counters.partial_rounds += 1
                logger.warning(
                    "partial round at epoch %d: %d of %d peers", epoch, result.group_size, group_size
                )
        averaged_at = time.monotonic()
        group_samples = sum(int(g.get("samples", 0)) for g in gathered.values())
        if group_samples == 0:
            self._on_compute(lambda: self.worker.restore_snapshot(snapshot))
            return
        self._on_compute(lambda: self.worker.apply_update(averaged, group_samples))
        self._grad_fp = self.worker.grad_fingerprint(averaged)
        self._known_epochs.update({peer: epoch + 1 for peer in gathered if peer != self.peer_id})
        self.averager.state_sharing_priority = float(self.worker.epoch)
        self.counters.rounds += 1
        self.counters.last_group_size = len(gathered)
        self.counters.last_round_s = time.monotonic() - start
        timings = {
            "wait_s": round(start - snapshot.taken_at_s, 3),
            "avg_s": round(averaged_at - start, 3),
            "apply_s": round(time.monotonic() - averaged_at, 3),
            "view_s": round(self._last_view_s, 3),
        }
        self.ledger.write(
            "round",
            **timings,
            epoch=epoch,
            mbs=snapshot.micro_batch_ids,
            n=snapshot.samples,
            group_samples=group_samples,
            group={p: int(g.get("samples", 0)) for p, g in gathered.items()},
            expected=group_size,
        )
        self.publish(force=True)

    def resync(self, reason: str) -> None:
        """Stop serving, drop local accumulation, download the stage state from peers, serve again."""
        logger.warning("resync of stage %d replica: %s", self.stage, reason)
        self.serving.clear()
        self.averager.state_sharing_priority = -1.0  # never be picked as a donor while stale
        self.publish(force=True)
        lost_samples, lost_ids = self._on_compute(self.worker.drop_pending)
        if lost_ids:
            self.counters.lost_samples += lost_samples
            self.ledger.write("lost", mbs=lost_ids, n=lost_samples, reason=reason)
        loaded = self.averager.download_state(self.settings.download_timeout_s)
        if loaded is None:
            logger.error("state download failed; serving the local state and retrying later")
        else:
            self._on_compute(lambda: self.worker.import_state(*loaded))
            self.counters.resyncs += 1
            self.ledger.write("resync", epoch=self.worker.epoch, reason=reason)
        self._grad_fp = None
        self._view_time_s = float("-inf")
        self.averager.state_sharing_priority = float(self.worker.epoch)
        self.serving.set()
        self.publish(force=True)

    # helpers ------------------------------------------------------------------------------------
    def _others(self) -> dict[str, dict]:
        """Progress of the stage's other replicas (a DHT read); also kept as the latest view."""
        others, read_start = {}, time.monotonic()
        progress = self.records.stage_progress(self.stage)
        self._last_view_s = time.monotonic() - read_start
        for peer, value in progress.items():
            if peer != self.peer_id and value.get("digest") == self.digest:
                others[peer] = value
        self._view, self._view_time_s = others, time.monotonic()
        return self._adjusted(others)

    def _adjusted(self, view: dict[str, dict]) -> dict[str, dict]:
        """A peer that stepped with us is at least at the epoch after that round, even while its
        record still shows the old epoch (and the old epoch's samples)."""
        adjusted = {}
        for peer, value in view.items():
            known = self._known_epochs.get(peer, -1)
            if value["epoch"] < known:
                value = dict(value, epoch=known, samples=0, ready=False, grad_fp=None)
            adjusted[peer] = value
        return adjusted

    def _view_fresh(self, check_ahead: bool = True) -> bool:
        """The last DHT view is young enough to decide on (`view_max_age_s`) and, for the fast path,
        shows no replica ahead of us (that case needs a resync)."""
        if time.monotonic() - self._view_time_s >= self.settings.view_max_age_s:
            return False
        return not check_ahead or all(
            max(v["epoch"], self._known_epochs.get(p, -1)) <= self.worker.epoch for p, v in self._view.items()
        )

    def _diverged_from(self, same: dict[str, dict]) -> bool:
        if self._grad_fp is None:
            return False
        for peer, value in same.items():
            theirs = value.get("grad_fp")
            if peer < self.peer_id and isinstance(theirs, list) and len(theirs) == 2:
                if any(
                    abs(a - b) > FINGERPRINT_RTOL * (abs(a) + abs(b) + 1e-12)
                    for a, b in zip(theirs, self._grad_fp, strict=True)
                ):
                    return True
        return False

    def _on_compute(self, fn):
        return self.compute.submit(fn, PRIORITY_SYNC).result(timeout=self.settings.compute_timeout_s)

    def publish(self, ready: bool = False, force: bool = False) -> None:
        """Request a progress update; the publisher thread stores it (DHT latency stays off the
        round's critical path). Without `force` it goes out with the next heartbeat."""
        if ready != self._ready or force:
            self._ready = ready
            self._publish_now.set()

    def _publish_loop(self) -> None:
        while not self.stop_event.is_set():
            self._publish_now.wait(self.settings.heartbeat_s)
            self._publish_now.clear()
            if self.stop_event.is_set():
                break
            value = {
                "epoch": self.worker.epoch,
                "samples": self.worker.unapplied_samples,
                "ready": self._ready,
                "digest": self.digest,
                "serving": self.serving.is_set(),
                "grad_fp": self._grad_fp,
            }
            self.records.publish_progress(self.stage, self.peer_id, value, self.settings.progress_ttl_s)
