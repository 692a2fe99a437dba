"""`/metrics`: the monitor's view of the swarm in the Prometheus text exposition format.

Rendered with `prometheus_client` (families built from the view on every scrape, a fresh registry each
time) rather than by hand: label escaping, HELP/TYPE lines, counter `_total` naming and float formatting
are then the reference implementation's, and scrapers never see a subtly malformed line.
"""

from __future__ import annotations

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from swarmtrain.monitor.events import KINDS

CONTENT_TYPE = CONTENT_TYPE_LATEST

# work totals (snapshot["work"]) exported as counters: key -> help text
WORK_COUNTERS = {
    "microbatches_completed": "micro-batches the trainers completed",
    "microbatches_failed": "micro-batches that failed for good (trainers)",
    "retries": "calls retried on another peer (trainers that publish the counter)",
    "samples_lost": "samples of unapplied gradients lost with dead, moved or resynced replicas",
    "state_downloads": "stage states downloaded from peers (replicas resyncing; simulator: joins and moves)",
    "duplicates": "requests a server had already applied (retries of work that had landed)",
}


def render_metrics(view: dict) -> bytes:
    """The text exposition of a `SwarmHistory.view()`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ViewCollector(view))
    return generate_latest(registry)


class _ViewCollector:
    def __init__(self, view: dict) -> None:
        self.view = view

    def collect(self):
        snapshot = self.view.get("snapshot")
        yield from _monitor_families(self.view)
        if snapshot is not None:
            yield from _stage_families(snapshot)
            yield from _peer_families(snapshot)
            yield from _trainer_families(snapshot)
            yield from _replica_families(snapshot)
            yield from _work_families(snapshot.get("work") or {})


def _add(family, labels: list[str], value) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        family.add_metric(labels, value)


def _monitor_families(view: dict):
    polls = CounterMetricFamily("swarmtrain_monitor_polls", "snapshots the monitor has taken")
    polls.add_metric([], view.get("polls", 0))
    events = CounterMetricFamily(
        "swarmtrain_monitor_events", "events derived between snapshots, by kind", labels=["kind"]
    )
    counts = view.get("event_counts") or {}
    for kind in KINDS:
        events.add_metric([kind], counts.get(kind, 0))
    yield polls
    yield events
    snapshot = view.get("snapshot")
    if snapshot is not None:
        stamp = GaugeMetricFamily(
            "swarmtrain_snapshot_timestamp_seconds",
            "when the latest snapshot was taken (simulated s in a replay)",
        )
        _add(stamp, [], snapshot.get("time"))
        yield stamp


def _stage_families(snapshot: dict):
    peers = GaugeMetricFamily("swarmtrain_stage_peers", "peers announced at the stage", labels=["stage"])
    throughput = GaugeMetricFamily(
        "swarmtrain_stage_throughput_samples_per_second",
        "summed throughput of the stage's online peers of this run's config",
        labels=["stage"],
    )
    bottleneck = GaugeMetricFamily(
        "swarmtrain_stage_is_bottleneck", "1 for the stage with the least throughput", labels=["stage"]
    )
    for stage in snapshot["stages"]:
        label = [str(stage["index"])]
        _add(peers, label, len(stage["peers"]))
        _add(throughput, label, stage["throughput_samples_per_s"])
        _add(bottleneck, label, int(stage["index"] == snapshot.get("bottleneck")))
    yield from (peers, throughput, bottleneck)


def _peer_families(snapshot: dict):
    labels = ["stage", "peer_id"]
    throughput = GaugeMetricFamily(
        "swarmtrain_peer_throughput_samples_per_second", "throughput the peer announces", labels=labels
    )
    queue = GaugeMetricFamily("swarmtrain_peer_queue_length", "requests queued at the peer", labels=labels)
    step = GaugeMetricFamily("swarmtrain_peer_step", "the peer's parameter version (step)", labels=labels)
    info = GaugeMetricFamily(
        "swarmtrain_peer_info",
        "1 per announced peer, with its state",
        labels=[*labels, "state", "same_config"],
    )
    for stage in snapshot["stages"]:
        for peer in stage["peers"]:
            label = [str(stage["index"]), peer["peer_id"]]
            _add(throughput, label, peer.get("throughput_samples_per_s"))
            _add(queue, label, peer.get("queue"))
            _add(step, label, peer.get("epoch"))
            _add(info, [*label, str(peer.get("state")), str(bool(peer.get("same_config"))).lower()], 1)
    yield from (throughput, queue, step, info)


def _trainer_families(snapshot: dict):
    loss = GaugeMetricFamily("swarmtrain_trainer_loss", "recent training loss", labels=["trainer"])
    rate = GaugeMetricFamily(
        "swarmtrain_trainer_throughput_samples_per_second", "samples per second", labels=["trainer"]
    )
    samples = CounterMetricFamily("swarmtrain_trainer_samples", "samples trained", labels=["trainer"])
    for trainer in snapshot.get("trainers", []):
        label = [trainer["trainer_id"]]
        _add(loss, label, trainer.get("loss"))
        _add(rate, label, trainer.get("samples_per_s"))
        _add(samples, label, trainer.get("samples"))
    yield from (loss, rate, samples)


def _replica_families(snapshot: dict):
    outer = GaugeMetricFamily("swarmtrain_replica_outer_step", "averaging rounds done", labels=["peer_id"])
    loss = GaugeMetricFamily("swarmtrain_replica_loss", "recent training loss", labels=["peer_id"])
    for replica in snapshot.get("replicas", []):
        _add(outer, [replica["peer_id"]], replica.get("outer_step"))
        _add(loss, [replica["peer_id"]], replica.get("loss"))
    yield from (outer, loss)


def _work_families(work: dict):
    for key, text in WORK_COUNTERS.items():
        if work.get(key) is not None:
            family = CounterMetricFamily(f"swarmtrain_{key}", text)
            _add(family, [], work[key])
            yield family
