"""The four modes on small fleets: conservation, the optimum, failures, rebalancing, calibration."""

from dataclasses import replace

import numpy as np
import pytest

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import ChurnEvent, ChurnSchedule
from swarmtrain.sim.costs import compute_s_per_sample, rate_table
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.fleet import with_measured_compute_times
from swarmtrain.sim.optimal import optimal_allocation
from swarmtrain.sim.runner import costs_for, run_simulation

pytestmark = pytest.mark.unit

GPT2 = get_preset("gpt2-small")  # 4 stages; the last (LM head) is ~2.5x the others


def make_fleet(spec, latency_s=0.005):
    peers = [PeerSpec.from_device(f"{d}{i}", DEVICE_TYPES[d], 0) for d, count in spec for i in range(count)]
    return Fleet(tuple(peers), single_location(latency_s=latency_s))


MIXED = make_fleet([("a100", 4), ("v100", 6), ("t4", 8)])


def simulate(
    fleet=MIXED, mode="swarm", schedule=None, duration_s=120.0, run=GPT2, global_batch_size=None, **kw
):
    config = SimConfig(
        mode=mode, duration_s=duration_s, chunk_samples=kw.pop("chunk_samples", 32), audit=True, **kw
    )
    return run_simulation(fleet, run, config, schedule, global_batch_size)


def fail_at(fleet, time_s, peer_ids, event="fail"):
    index = fleet.index_of()
    return ChurnSchedule(tuple(ChurnEvent(time_s, index[p], event) for p in peer_ids))


def test_heterogeneous_fleet_without_churn_reaches_its_optimum_within_5_percent():
    result = simulate()
    summary = result.summary
    assert summary["steady_fraction_of_optimal"] == pytest.approx(1.0, abs=0.05)
    assert summary["fraction_of_optimal"] > 0.9  # including the pipeline filling up at the start
    assert summary["samples_lost"] == 0 and summary["timeouts"] == 0


def test_every_completed_micro_batch_went_through_every_stage_once():
    churn = fail_at(MIXED, 60.0, ["t40", "v1001", "a1001"])
    for mode in ("swarm", "swarm-no-rebalance", "gpipe"):
        audit = simulate(mode=mode, schedule=churn).summary["audit"]
        assert audit["chunks"] > 100, mode
        assert audit["violations"] == 0, mode


def test_samples_counted_equal_audited_micro_batches():
    summary = simulate(duration_s=60.0).summary
    assert summary["samples"] == summary["audit"]["chunks"] * summary["chunk_samples"]


def test_failed_peers_work_is_retried_elsewhere_and_their_gradients_lost():
    churn = fail_at(MIXED, 60.0, ["v1002"])
    before = simulate(global_batch_size=8192).summary
    after = simulate(schedule=churn, global_batch_size=8192).summary
    assert after["failures"] == 1 and after["reroutes"] > 0
    assert after["samples_lost"] > 0
    assert after["samples"] < before["samples"]


def test_rebalancing_refills_a_stage_that_lost_most_of_its_peers():
    fleet = make_fleet([("t4", 16)])
    # kill every peer but one at the heaviest stage (the last); only moves can bring capacity back
    costs = costs_for(GPT2)
    table = rate_table(list(fleet.peers), [compute_s_per_sample(p, costs) for p in fleet.peers])
    alloc = optimal_allocation(table, costs)
    last = [fleet.peers[i].peer_id for i, s in enumerate(alloc.stage_of.tolist()) if s == 3]
    assert len(last) >= 3
    churn = fail_at(fleet, 30.0, last[1:])
    moved = simulate(fleet, "swarm", churn, duration_s=600.0, rebalance_period_s=30.0).summary
    stuck = simulate(fleet, "swarm-no-rebalance", churn, duration_s=600.0).summary
    assert moved["moves"] >= 1 and stuck["moves"] == 0
    assert moved["steady_fraction_of_optimal"] > 0.85
    assert stuck["steady_fraction_of_optimal"] < 0.6
    assert moved["bytes_by_kind"]["state"] > 0  # each move downloads the target stage's state


def test_joining_peers_download_state_then_serve():
    fleet = make_fleet([("t4", 10)])
    index = fleet.index_of()
    late = ChurnSchedule(
        (ChurnEvent(60.0, index["t49"], "join"),), initially_offline=frozenset({index["t49"]})
    )
    summary = simulate(fleet, schedule=late, duration_s=200.0).summary
    assert summary["joins"] == 1
    assert summary["bytes_by_kind"]["state"] > 0


def test_gpipe_stalls_until_a_spare_replaces_the_dead_peer():
    fleet = make_fleet([("t4", 9)])  # 2 pipelines of 4 and one spare
    churn = fail_at(fleet, 50.0, ["t40"])
    summary = simulate(fleet, "gpipe", churn, duration_s=200.0).summary
    clean = simulate(fleet, "gpipe", duration_s=200.0).summary
    assert summary["stalls"] == 1
    assert summary["bytes_by_kind"]["state"] > 0  # the spare downloaded the stage
    assert 0.5 * clean["samples"] < summary["samples"] < clean["samples"]


def test_fixed_pipelines_lose_more_to_latency_than_swarm():
    near = make_fleet([("t4", 8)], latency_s=0.0)
    far = make_fleet([("t4", 8)], latency_s=0.2)
    ratio = {}
    for mode in ("swarm", "gpipe"):
        fast = simulate(near, mode, duration_s=100.0, chunk_samples=8).summary["samples_per_s"]
        slow = simulate(far, mode, duration_s=100.0, chunk_samples=8).summary["samples_per_s"]
        ratio[mode] = slow / fast
    assert ratio["swarm"] > 0.95
    assert ratio["gpipe"] < ratio["swarm"] - 0.1


def test_async_replicas_run_the_whole_model_and_average_over_the_network():
    summary = simulate(mode="async-replicas", duration_s=600.0, average_every_steps=5).summary
    assert summary["samples"] > 0
    assert summary["bytes_by_kind"]["averaging"] > 0
    assert summary["bytes_by_kind"]["activations"] == 0


def test_measured_compute_times_set_the_predicted_throughput():
    tiny = get_preset("tiny")  # 2 stages, micro-batch 8
    peers = [PeerSpec.from_device(f"cpu{s}", DEVICE_TYPES["cpu"], 0) for s in range(2)]
    fleet = Fleet(tuple(replace(p, stage=s) for s, p in enumerate(peers)), single_location())  # --stage N
    fleet = with_measured_compute_times(fleet, {"cpu0": [0.01, None], "cpu1": [None, 0.03]})
    # one peer per stage; with many micro-batches in flight the slower stage rules
    pipelined = simulate(fleet, duration_s=120.0, run=tiny, chunk_samples=8, in_flight=16).summary
    assert pipelined["samples_per_s"] == pytest.approx(1 / 0.03, rel=0.02)
    # one micro-batch at a time: forward + backward of both stages back to back
    serial = simulate(fleet, duration_s=120.0, run=tiny, chunk_samples=8, in_flight=1, num_trainers=1).summary
    assert serial["samples_per_s"] == pytest.approx(1 / (0.01 + 0.03), rel=0.02)


def _two_cpu_stages(latency_s=0.0):
    tiny = get_preset("tiny")
    peers = [PeerSpec.from_device(f"cpu{s}", DEVICE_TYPES["cpu"], 0) for s in range(2)]
    fleet = Fleet(
        tuple(replace(p, stage=s) for s, p in enumerate(peers)), single_location(latency_s=latency_s)
    )
    return tiny, with_measured_compute_times(fleet, {"cpu0": [0.02, None], "cpu1": [None, 0.02]})


def test_variability_keeps_the_mean_time_of_a_serial_pipeline():
    tiny, fleet = _two_cpu_stages(latency_s=0.01)
    kw = dict(duration_s=600.0, run=tiny, chunk_samples=8, in_flight=1, num_trainers=1)
    steady = simulate(fleet, **kw).summary["samples_per_s"]
    jittery = simulate(fleet, compute_cv=1.0, latency_cv=1.0, **kw).summary["samples_per_s"]
    # one micro-batch at a time never queues: only the mean of each duration matters
    assert steady == pytest.approx(8 / (8 * 0.04 + 3 * 0.01), rel=0.02)
    assert jittery == pytest.approx(steady, rel=0.05)


def test_variability_makes_a_balanced_pipeline_queue():
    tiny, fleet = _two_cpu_stages()
    kw = dict(duration_s=600.0, run=tiny, chunk_samples=8, in_flight=2, num_trainers=1)
    steady = simulate(fleet, **kw).summary["samples_per_s"]
    jittery = simulate(fleet, compute_cv=1.0, **kw).summary["samples_per_s"]
    again = simulate(fleet, compute_cv=1.0, **kw).summary["samples_per_s"]
    # two equal stages, two micro-batches in flight: deterministic, each stage is busy all the time;
    # with jitter one often waits for the other (a closed two-station network with exponential service
    # runs at 2/3 of capacity)
    assert steady == pytest.approx(1 / 0.02, rel=0.03)
    assert jittery == pytest.approx(steady * 2 / 3, rel=0.1)
    assert again == jittery  # seeded


def test_variability_must_be_a_sane_coefficient_of_variation():
    with pytest.raises(ValueError, match="compute_cv"):
        SimConfig(compute_cv=-0.5)


@pytest.mark.parametrize("fleet", [MIXED, make_fleet([("t4", 12)])], ids=["mixed", "uniform"])
def test_a_balanced_fleet_makes_no_move_in_30_minutes_at_the_default_period(fleet):
    """Issue 40: rebalancing is on by default, so its hysteresis must keep a balanced swarm still. The
    fleet starts at the best allocation; 30 simulated minutes at the default period (60 s, as servers)."""
    from swarmtrain.config import SwarmConfig

    assert SimConfig().rebalance_period_s == SwarmConfig().rebalance_period_s == 60.0
    summary = simulate(fleet, "swarm", duration_s=1800.0).summary
    assert summary["moves"] == 0 and summary["samples"] > 0


def _greedy_by_scan(rates):
    """The greedy as it was written first: every peer scans every stage (the reference)."""
    caps, stage_of = [0.0] * rates.shape[1], [-1] * rates.shape[0]
    for p in np.argsort(-rates.max(axis=1), kind="stable").tolist():
        row = rates[p].tolist()
        best, best_cap = -1, float("inf")
        for s in range(len(row)):
            if row[s] > 0 and caps[s] < best_cap:
                best, best_cap = s, caps[s]
        if best >= 0:
            stage_of[p] = best
            caps[best] += row[best]
    return stage_of, caps


@pytest.mark.parametrize("seed,stages", [(seed, 7) for seed in range(5)] + [(5, 20), (6, 70)])
def test_the_greedy_allocates_as_the_scan_did_bit_for_bit(seed, stages):
    """Equal rows (ties), peers that can serve only some stages and none at all; above the polish size;
    stages found by a table of codes (7), by sorting the codes (20), and more stages than a row's bit
    code holds (70)."""
    from swarmtrain.sim.optimal import POLISH_MAX_PEERS, greedy_allocation

    rng = np.random.default_rng(seed)
    kinds = rng.choice([1.0, 2.5, 4.0], size=(POLISH_MAX_PEERS + 300, 1)) * rng.choice(
        [1.0, 0.5], size=(1, stages)
    )
    rates = kinds * (rng.random(kinds.shape) > 0.05)  # a few infeasible stages
    rates[:5] = 0.0  # peers that fit no stage
    stage_of, caps = _greedy_by_scan(rates)
    result = greedy_allocation(rates)
    assert result.stage_of.tolist() == stage_of and list(result.capacities) == caps


def test_the_simulator_keeps_freed_memory_where_the_c_library_is_glibc():
    """`swarmtrain simulate` raises glibc's malloc thresholds (sim/heap.py: at 10,000 peers the kernel's
    page faults were 11.5 of 53 s); in a child process, so this one's allocator is left alone."""
    import platform
    import subprocess
    import sys

    code = "from swarmtrain.sim.heap import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    expected = platform.libc_ver()[0] == "glibc"
    assert out.stdout.strip() == str(expected)
