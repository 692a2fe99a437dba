"""Trainer and replica metrics: typed objects logged as `metrics {json}` lines (runtime/metrics_log.py)
that benches read back by role, and the trainer's DHT record that the monitor reads (`samples`)."""

import math

import pytest

from swarmtrain.config import get_preset
from swarmtrain.monitor.snapshot import swarm_snapshot
from swarmtrain.runtime.replica.replica_metrics import ReplicaMetrics, replica_metrics_from_log
from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.runtime.trainer.trainer_metrics import TrainerMetrics, trainer_metrics_from_log

pytestmark = pytest.mark.unit

TRAINER = TrainerMetrics(
    samples=640,
    loss=2.5,
    samples_per_s=31.5,
    completed=20,
    failed=1,
    in_flight=4,
    retries=3,
    timeouts=1,
    peers_per_stage=[2, 1],
)
REPLICA = ReplicaMetrics(
    shard="0/2",
    inner_step=12,
    stop_step=64,
    samples=384,
    outer_step=3,
    loss=float("nan"),
    samples_per_s=80.0,
    rounds_averaged=2,
    rounds_alone=1,
    rounds_resynced=0,
)


def _log(*lines: str) -> str:
    return "\n".join(f"12:00:{i:02d} I swarmtrain.x: {line}" for i, line in enumerate(lines))


def test_each_role_reads_back_only_its_own_metrics_lines():
    later = TrainerMetrics(**{**TRAINER.to_dict(), "samples": 704, "loss": 2.4})
    log = _log(
        "samples 640 loss 2.5000 samples/s 31.5 peers/stage [2, 1] in-flight 4 failed 1",
        TRAINER.log_line(),
        REPLICA.log_line(),
        "metrics {cut off by a kill",
        later.log_line(),
    )
    assert trainer_metrics_from_log(log) == [TRAINER, later]
    [replica] = replica_metrics_from_log(log)
    assert replica.shard == "0/2" and replica.samples == 384 and math.isnan(replica.loss)
    assert metrics_from_log(log) == []  # no server line among them


def test_a_field_a_newer_writer_adds_is_ignored_by_an_older_reader():
    line = TRAINER.log_line().replace('"role"', '"added_later":1,"role"')
    assert trainer_metrics_from_log(_log(line)) == [TRAINER]


def test_the_monitor_shows_the_trainer_record_s_samples():
    class Records:  # the DHT records a snapshot reads: one trainer, no stage peers yet
        def stage_peers(self, stage):
            return {}

        def stage_progress(self, stage):
            return {}

        def metrics(self):
            return {"trainer-t1": TRAINER.to_dict()}

        def replicas(self, digest):
            return {}

        def moves(self):
            return {}

    [trainer] = swarm_snapshot(get_preset("tiny"), Records())["trainers"]
    assert trainer["samples"] == 640 and trainer["completed"] == 20 and trainer["loss"] == 2.5
