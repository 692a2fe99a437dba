"""`sim.mode_choice` and `swarmtrain simulate --choose-mode`: SWARM or async replicas, which H, and why."""

import json
import math
from dataclasses import replace

import pytest

from swarmtrain.cli import simulate as simulate_cli
from swarmtrain.cli.main import main
from swarmtrain.config import get_preset, sizes
from swarmtrain.sim import mode_choice
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.costs import full_model_s_per_sample
from swarmtrain.sim.entities import DEVICE_TYPES, GB, MBIT_S, Fleet, PeerSpec, single_location
from swarmtrain.sim.mode_choice import (
    REPLICAS,
    SWARM,
    choose_mode,
    crossover_bandwidth,
    log_crossovers,
    recommend,
    smallest_good_h,
)
from swarmtrain.sim.runner import costs_for

pytestmark = pytest.mark.unit

XL = get_preset("gpt3-xl")  # 1.3B, 8 stages: 26 GB of training state, a stage fits a 16 GB V100
FAST = SimConfig(duration_s=600.0, event_budget=100_000, num_samples=30)


def v100_fleet(num_peers: int, mbit_s: float, host_memory_gb: float | None = None) -> Fleet:
    peers = []
    for i in range(num_peers):
        spec = PeerSpec.from_device(f"v{i}", DEVICE_TYPES["v100"], 0)
        spec = replace(spec, uplink_bytes_per_s=mbit_s * MBIT_S, downlink_bytes_per_s=mbit_s * MBIT_S)
        if host_memory_gb is not None:
            spec = replace(spec, host_memory_bytes=host_memory_gb * GB)
        peers.append(spec)
    return Fleet(tuple(peers), single_location(latency_s=0.02), f"{num_peers} x v100 at {mbit_s} Mb/s")


def test_slow_links_recommend_replicas_with_rare_averaging():
    fleet = v100_fleet(16, 10)
    choice = choose_mode(fleet, XL, FAST)
    assert choice.recommended_mode == REPLICAS and choice.recommended_h is not None
    assert choice.recommended_h > 1
    # the replicas' samples/s is the analytic rate of identical peers: H local steps, then the all-reduce
    costs = costs_for(XL)
    local = costs.global_batch_size // 16
    step_s = local * full_model_s_per_sample(fleet.peers[0], costs)
    avg_s = 2 * costs.model_params * sizes.FP16_BYTES * 15 / 16 / (10 * MBIT_S)
    for h, c in choice.replicas.items():
        assert c.samples_per_s == pytest.approx(16 * h * local / (h * step_s + avg_s), rel=0.005)
        # sync bytes: every replica sends 2 x fp16 parameters x (n-1)/n per round of 16 x H x local samples
        assert c.sync_bytes_per_sample == pytest.approx(16 * avg_s * 10 * MBIT_S / (16 * h * local), rel=1e-6)
    # SWARM is hopeless at 10 Mb/s: 2 x 4.3 MB of activations per sample and peer
    assert choice.swarm.samples_per_s < 0.1 < choice.replicas[1].samples_per_s
    rates = {h: c.samples_per_s for h, c in choice.replicas.items()}
    best = max(rates.values())
    assert rates[choice.recommended_h] >= 0.9 * best
    assert all(rates[h] < 0.9 * best for h in rates if h < choice.recommended_h)
    text = " ".join(choice.reasons)
    assert "link-bound" in text and "16 of 16 peers hold it in host memory" in text
    assert (
        "x SWARM); replicas must beat SWARM by 10% (SWARM keeps one synchronous model): async replicas"
        in text
    )
    # deterministic
    assert choose_mode(fleet, XL, FAST) == choice


def test_fast_links_recommend_swarm():
    choice = choose_mode(v100_fleet(64, 10_000), XL, FAST, h_values=(1, 10, 100))
    assert choice.recommended_mode == SWARM and choice.recommended_h is None
    # replicas stream the 1.3B model over PCIe for every sample (swap-bound); SWARM's stages fit the GPU
    assert choice.swarm.samples_per_s > 1.1 * max(c.samples_per_s for c in choice.replicas.values())
    assert 140 < choice.swarm.samples_per_s < 170
    assert choice.facts.replica_swap_bound_peers == 64 and choice.facts.stage_gpu_peers == 64
    text = " ".join(choice.reasons)
    assert "PCIe streaming is the bottleneck on 64 of them" in text
    assert "compute-bound" in text and "decision: replicas with H=1" in text and text.endswith(": SWARM")


def test_host_memory_too_small_makes_replicas_impossible():
    choice = choose_mode(v100_fleet(16, 1000, host_memory_gb=8), XL, FAST, h_values=(1, 10))
    assert choice.facts.replica_capable_peers == 0
    assert choice.recommended_mode == SWARM and choice.swarm.samples_per_s > 0
    assert all(c.samples_per_s == 0 and c.sync_bytes_per_sample is None for c in choice.replicas.values())
    memory = choice.reasons[0]
    assert memory.startswith("memory:") and "no peer's host memory holds it" in memory
    assert "async replicas are impossible" in memory and "largest 8 GB" in memory
    # half the fleet could be replicas: counted, and the others would idle
    small = v100_fleet(16, 1000, host_memory_gb=8)
    peers = small.peers[:8] + tuple(replace(p, host_memory_bytes=128 * GB) for p in small.peers[8:])
    fleet = Fleet(peers, small.locations)
    facts = mode_choice.fleet_facts(fleet, XL)
    assert facts.replica_capable_peers == 8
    assert (
        "8 of 16 peers hold it in host memory and can be replicas (8 would idle)"
        in (mode_choice.fleet_reasons(facts)[0])
    )


def test_churn_compares_samples_kept():
    choice = choose_mode(v100_fleet(16, 10), XL, FAST, h_values=(1, 100), churn="exponential")
    rare = choice.replicas[100]
    assert rare.samples_lost > 0  # failures lose up to 100 local steps of un-averaged work
    assert rare.kept_samples_per_s == pytest.approx(
        rare.samples_per_s - rare.samples_lost / rare.simulated_s, rel=1e-9
    )
    assert any(
        r.startswith("churn (exponential): candidates are compared on samples/s kept") for r in choice.reasons
    )


def test_h_rule_picks_the_smallest_h_within_the_tolerance():
    rates = {1: 50.0, 2: 80.0, 5: 91.0, 10: 99.0, 20: 100.0}
    assert smallest_good_h(rates) == 5  # 91 >= 0.9 x 100; 80 is not
    assert smallest_good_h(rates, h_tolerance=0.0) == 20
    assert smallest_good_h(rates, h_tolerance=0.25) == 2
    assert smallest_good_h({1: 0.0, 10: 0.0}) is None
    # replicas only if the chosen H beats SWARM by the margin
    assert recommend(90.0, rates) == (SWARM, None)  # H=5 gives 91 < 1.1 x 90
    assert recommend(82.0, rates) == (REPLICAS, 5)  # 91 >= 90.2
    assert recommend(83.0, rates) == (SWARM, None)  # 91 < 91.3 even though H=20 would beat SWARM by 20%
    assert recommend(83.0, rates, replica_margin=0.0) == (REPLICAS, 5)
    assert recommend(1.0, {1: 0.0}) == (SWARM, None)
    with pytest.raises(ValueError, match="h_values"):
        choose_mode(v100_fleet(2, 10), XL, FAST, h_values=(0, 5))


def test_log_crossovers():
    assert log_crossovers((10, 1000), (1.0, 3.0), (2.0, 2.0)) == (pytest.approx((100.0, SWARM)),)
    assert log_crossovers((10, 100, 1000), (1.0, 1.0, 1.0), (2.0, 3.0, 4.0)) == ()


def test_crossover_bandwidth_lies_between_the_sweep_ends():
    def fleet_at(mbit_s):
        return v100_fleet(64, mbit_s)

    # 64 V100s: replicas lead at 10 Mb/s (SWARM's activations do not get through), SWARM at 10 Gb/s
    sweep = mode_choice.bandwidth_sweep(fleet_at, XL, 10, (10, 300, 10_000), FAST)
    assert sweep.replicas[0] > 10 * sweep.swarm[0] and sweep.swarm[-1] > sweep.replicas[-1]
    (point, leader_above), *_ = sweep.crossovers()
    assert 10 < point < 10_000 and leader_above == SWARM
    assert crossover_bandwidth(fleet_at, XL, 10, (10, 300, 10_000), FAST) == (point,)
    # 16 peers at 10-100 Mb/s: replicas lead throughout
    assert crossover_bandwidth(lambda b: v100_fleet(16, b), XL, 10, (10, 100), FAST) is None


def run_cli(capsys, *argv):
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_choose_mode_table_and_json(tmp_path, capsys):
    fleet = tmp_path / "slow.toml"
    fleet.write_text('[[peers]]\ndevice = "v100"\ncount = 16\nuplink_mbit_s = 10\ndownlink_mbit_s = 10\n')
    path = tmp_path / "choice.json"
    code, out, err = run_cli(
        capsys, "--fleet", str(fleet), "--choose-mode", "--h-values", "10,1", "--summary-json", str(path)
    )
    assert code == 0, err
    choice = json.loads(path.read_text())
    for key in ("recommended_mode", "recommended_h", "candidates", "reasons"):
        assert key in choice
    assert choice["recommended_mode"] == "async-replicas" and choice["recommended_h"] == 10
    assert [(c["mode"], c["h"]) for c in choice["candidates"]] == [
        ("swarm", None),
        *((REPLICAS, h) for h in (1, 10)),
    ]
    assert all(c["samples_per_s"] > 0 and c["sync_bytes_per_sample"] > 0 for c in choice["candidates"])
    assert choice["reasons"] and all(isinstance(r, str) for r in choice["reasons"])
    assert "sync bytes/sample" in out
    chosen = [line.split() for line in out.splitlines() if line.startswith("async-replicas *")]
    assert len(chosen) == 1 and chosen[0][2] == "10"
    assert "recommended (*): async full replicas, averaging every H=10 local steps" in out
    assert all(f"  - {r}" in out for r in choice["reasons"])


def test_cli_default_h_values_match_the_module():
    assert simulate_cli.DEFAULT_H_VALUES == mode_choice.DEFAULT_H_VALUES
    assert math.isclose(simulate_cli.CHOOSE_DURATION_S, mode_choice.DEFAULT_BASE_CONFIG.duration_s)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--choose-mode", "--h-values", "1,x"], "expected positive integers separated by commas"),
        (["--choose-mode", "--h-values", "0,5"], "expected positive integers separated by commas"),
        (["--choose-mode", "--h-values", ""], "expected positive integers separated by commas"),
        (["--h-values", "1,2"], "--h-values goes with --choose-mode"),
        (["--choose-mode", "--mode", "gpipe"], "drop --mode"),
        (["--choose-mode", "--trace", "t.csv"], "drop --trace (use --churn MODEL)"),
        (["--choose-mode", "--plot", "p.png"], "drop --plot"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, "--num-peers", "4", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
