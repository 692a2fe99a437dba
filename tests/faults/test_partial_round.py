"""A partial outer round, made deterministic: replica 1's averager reduces its part of the second
all-reduce but sends no results back (what a broken result stream does under load; hivemind then keeps
those values local on replica 0 and raises nothing). Replica 0 detects it, fills the missing values from
replica 1's mean of that round (message kind `round_mean`) and applies the round with it: no state
download, no resync, about one mean's bytes, and both replicas end with the same weights."""

import json

import pytest

from swarmtrain.model import build_model
from swarmtrain.net.outer_averaging import WIRE_BYTES_PER_ELEMENT
from swarmtrain.runtime.faults import FaultHooks

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

SAMPLES = 2048


def test_a_partial_round_is_repaired_from_the_other_members_mean(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": SAMPLES}, "diloco": {"inner_steps": 8}})
    swarm.start_dht()
    common = ("--threads", "1", "--wait-for-replicas", "2", "--eval-samples", "64")
    swarm.start_replica("replica0", "0/2", *common)
    swarm.start_replica("replica1", "1/2", *common, faults=FaultHooks(drop_results_in=2))
    for name in ("replica0", "replica1"):
        assert swarm.wait_exit(name, 240) == 0, swarm.processes[name].log_text()[-3000:]
    a, b = (json.loads(swarm.summary_path(f"replica{k}").read_text()) for k in range(2))

    # pytest cuts a long assertion message short: on a failure the outcomes and both logs are in the output
    for r in (a, b):
        print(
            {
                k: r[k]
                for k in ("round_outcomes", "rounds_partial", "rounds_repaired", "repair_bytes_received")
            }
        )
    logs = [swarm.processes[f"replica{k}"].log_text() for k in range(2)]
    try:
        check_outcomes(a, b, cfg)
    except AssertionError:
        for k, log in enumerate(logs):
            print(f"--- replica{k}\n{log}")
        raise
    for log in logs:  # the repair's P2P client is closed on exit (asyncio reported its tasks pending)
        assert "Task was destroyed" not in log and "Exception ignored" not in log, log[-3000:]


def check_outcomes(a: dict, b: dict, cfg) -> None:
    """`a`, `b`: the summaries of replica 0 and of replica 1 (which withholds results once)."""
    rounds = SAMPLES // cfg.training.global_batch_size // cfg.diloco.inner_steps  # 8
    assert a["outer_steps"] == b["outer_steps"] == rounds
    # the injected round: replica 0 repairs it from replica 1's mean, and replica 1 (which got replica
    # 0's results) applies it as a full round: neither downloads a state for it
    repaired = [k for k, outcome in a["round_outcomes"].items() if outcome == "repaired"]
    # (a round that came back partial on its own may be repaired too, on both replicas: CI once saw 2)
    assert any(b["round_outcomes"][k] == "averaged" for k in repaired), (
        a["round_outcomes"],
        b["round_outcomes"],
    )
    # Under CI's load a round was also lost naturally, in 3 CI runs of many (hivemind's reducer got 50% of
    # its inputs; or replica 0 averaged a round alone and replica 1 resynced: docs/LOG.md, 2026-11-23 and
    # 2026-11-24). That is the designed recovery, not the repair under test: allow one such round, and a
    # state download only by a replica that resynced a round.
    natural = {int(k) for r in (a, b) for k, outcome in r["round_outcomes"].items() if outcome != "averaged"}
    natural -= {int(k) for k in repaired}
    # one lost round is one event with its recovery: a resync in the next round is that recovery (under
    # load replica 1's all-reduce failed alone in round 6 and it resynced round 7: docs/LOG.md)
    events = [k for k in natural if not (k - 1 in natural and _only_resynced(a, b, k))]
    assert len(events) <= 1, (a["round_outcomes"], b["round_outcomes"])
    for r in (a, b):
        assert (r["state_bytes_received"] > 0) == (r["rounds_resynced"] > 0), r
    # each repair fetched one mean in the run's codec and a bit per value (where that mean is the member's
    # own value): about one round's payload, not the 5x-model state
    elements = sum(p.numel() for p in build_model(cfg.model).parameters())
    one_mean = elements * (WIRE_BYTES_PER_ELEMENT[cfg.diloco.compression] + 1 / 8)
    assert 0.5 * one_mean <= a["repair_bytes_received"] / a["rounds_repaired"] <= 1.1 * one_mean
    assert a["fingerprint"] == pytest.approx(b["fingerprint"], rel=5e-3)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=5e-3)


def _only_resynced(a: dict, b: dict, k: int) -> bool:
    """Round k was averaged or resynced on both replicas (no new loss in it)."""
    return all(r["round_outcomes"].get(str(k)) in ("averaged", "resynced") for r in (a, b))
