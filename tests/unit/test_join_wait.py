"""How long a joining stage replica reads the stage's records again when no serving replica shows
(`StageSynchronizer._stage_epochs`): a live replica's record can lapse for seconds, so a joiner of a swarm
that has stepped reads again for `missing_replica_wait_s`; one of a swarm restarting from its checkpoints
(another stage's replica restored at the swarm's step, not stepped since, and the joiner's own checkpoint
at that step) does not: nothing found could change its start. Counted in DHT reads, not seconds."""

from types import SimpleNamespace

import pytest

from swarmtrain.runtime.server import stage_sync
from swarmtrain.runtime.server.stage_sync import StageSynchronizer, SyncSettings


@pytest.fixture(autouse=True)
def _no_pause_between_reads(monkeypatch):
    monkeypatch.setattr(stage_sync, "JOIN_RETRY_S", 0.001)


def _joiner(own: list[dict[str, dict]], other_stage: dict[str, dict]):
    """A stage-1 synchronizer's stand-in: its own stage's records answer `own` in turn (the last one from
    then on; the reads are counted), stage 0's records are `other_stage`."""
    reads = []

    def recorded_peers():
        reads.append(1)
        return own[min(len(reads), len(own)) - 1]

    joiner = SimpleNamespace(
        settings=SyncSettings(missing_replica_wait_s=5.0, num_stages=2),
        stage=1,
        digest="d",
        recorded_peers=recorded_peers,
        records=SimpleNamespace(stage_progress=lambda stage: other_stage if stage == 0 else {}),
    )
    joiner._other_stage_records = lambda: StageSynchronizer._other_stage_records(joiner)
    return joiner, reads


def _record(epoch: int, restored: bool | None) -> dict:
    record = {"epoch": epoch, "samples": 0, "digest": "d", "serving": True}
    return record if restored is None else dict(record, restored=restored)


RESTORED = {"X": _record(32, True), "Y": _record(32, False)}  # one restored, one that downloaded from it


def test_a_restarting_swarm_and_a_checkpoint_at_its_step_read_once():
    for checkpoint_step in (32, 40):
        joiner, reads = _joiner([{}], RESTORED)
        assert StageSynchronizer._stage_epochs(joiner, 32, checkpoint_step) == [] and len(reads) == 1


def test_a_swarm_that_trains_on_or_an_older_checkpoint_reads_again():
    late = {"A": _record(32, False)}
    trained = {"X": _record(32, False), "Z": _record(31, True)}  # the restored one is behind: stepped since
    for checkpoint_step, other_stage in (
        (None, RESTORED),
        (30, RESTORED),
        (32, trained),
        (32, {"X": _record(32, None)}),
    ):
        joiner, reads = _joiner([{}, {"A": dict(_record(0, False), serving=False)}, late], other_stage)
        assert StageSynchronizer._stage_epochs(joiner, 32, checkpoint_step) == [32], checkpoint_step
        assert len(reads) == 3, (checkpoint_step, other_stage)


def test_a_new_run_reads_once():
    joiner, reads = _joiner([{}], {})
    assert StageSynchronizer._stage_epochs(joiner, 0, None) == [] and len(reads) == 1
