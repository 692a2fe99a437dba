"""`/metrics`: the Prometheus text rendering, read back with prometheus_client's own parser."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmtrain.monitor.history import SwarmHistory
from swarmtrain.monitor.prometheus import render_metrics

pytestmark = pytest.mark.unit


def sample_snapshot(time_s=10.0, samples=640):
    return {
        "run_id": "run",
        "time": time_s,
        "stages": [
            {
                "index": 0,
                "peers": [
                    {
                        "peer_id": "QmA",
                        "throughput_samples_per_s": 50.0,
                        "queue": 2,
                        "epoch": 7,
                        "state": "online",
                        "same_config": True,
                    },
                    {
                        "peer_id": "QmB",
                        "throughput_samples_per_s": 40.0,
                        "queue": 0,
                        "epoch": 7,
                        "state": "joining",
                        "same_config": False,
                    },
                ],
                "throughput_samples_per_s": 50.0,
            },
            {"index": 1, "peers": [], "throughput_samples_per_s": 0.0},
        ],
        "bottleneck": 1,
        # a trainer id with characters the text format must escape
        "trainers": [
            {"trainer_id": 'odd "id"\\x', "loss": 2.5, "samples_per_s": 30.0, "samples": samples},
            {"trainer_id": "fresh", "loss": float("nan"), "samples_per_s": None, "samples": 0},
        ],
        "replicas": [{"peer_id": "QmR", "outer_step": 3, "loss": 2.2}],
        "work": {"microbatches_failed": 2, "samples_lost": 16, "retries": None},
    }


def parse(view):
    text = render_metrics(view).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def test_metrics_round_trip_through_the_reference_parser():
    history = SwarmHistory()
    history.add(sample_snapshot(5.0, 320))
    history.add(sample_snapshot())
    text, samples = parse(history.view())
    assert samples[("swarmtrain_monitor_polls_total", ())] == 2
    assert samples[("swarmtrain_monitor_events_total", (("kind", "start"),))] == 1
    assert samples[("swarmtrain_monitor_events_total", (("kind", "move"),))] == 0
    assert samples[("swarmtrain_snapshot_timestamp_seconds", ())] == 10.0
    assert samples[("swarmtrain_stage_peers", (("stage", "0"),))] == 2
    assert samples[("swarmtrain_stage_peers", (("stage", "1"),))] == 0
    assert samples[("swarmtrain_stage_throughput_samples_per_second", (("stage", "0"),))] == 50.0
    assert samples[("swarmtrain_stage_is_bottleneck", (("stage", "1"),))] == 1
    assert samples[("swarmtrain_stage_is_bottleneck", (("stage", "0"),))] == 0
    a = (("peer_id", "QmA"), ("stage", "0"))
    assert samples[("swarmtrain_peer_queue_length", a)] == 2 and samples[("swarmtrain_peer_step", a)] == 7
    info = (("peer_id", "QmB"), ("same_config", "false"), ("stage", "0"), ("state", "joining"))
    assert samples[("swarmtrain_peer_info", info)] == 1
    odd = (("trainer", 'odd "id"\\x'),)
    assert samples[("swarmtrain_trainer_loss", odd)] == 2.5
    assert samples[("swarmtrain_trainer_samples_total", odd)] == 640
    assert ("swarmtrain_trainer_loss", (("trainer", "fresh"),)) not in samples  # no loss yet: no sample
    assert samples[("swarmtrain_replica_outer_step", (("peer_id", "QmR"),))] == 3
    assert samples[("swarmtrain_microbatches_failed_total", ())] == 2
    assert samples[("swarmtrain_samples_lost_total", ())] == 16
    assert "swarmtrain_retries_total" not in text  # nobody reports it: absent, not 0
    assert (
        "# TYPE swarmtrain_stage_peers gauge" in text
        and "# TYPE swarmtrain_trainer_samples_total counter" in text
    )


def test_metrics_before_the_first_snapshot():
    text, samples = parse(SwarmHistory().view())
    assert samples[("swarmtrain_monitor_polls_total", ())] == 0
    assert "swarmtrain_stage_peers" not in text
