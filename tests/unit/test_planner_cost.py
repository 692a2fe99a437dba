"""DT-FM cost model on hand-computed cases, its exact sub-solvers against brute force, relabelling invariance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from swarmtrain.config import get_preset
from swarmtrain.planner.cost import CostModel, LayoutError, Workload, validate_layout, workload_from_model
from swarmtrain.planner.graph import bottleneck_matching, shortest_open_path, shortest_open_path_cost
from swarmtrain.planner.scenarios import COMMUNICATION_SCENARIOS, Scenario, relabel

pytestmark = pytest.mark.unit


def four_devices(num_stages: int = 2) -> Scenario:
    latency_ms = np.array([[0, 10, 50, 30], [10, 0, 40, 60], [50, 40, 0, 20], [30, 60, 20, 0]], dtype=float)
    bandwidth_gbps = np.array([[1, 8, 2, 4], [8, 1, 8, 1], [2, 8, 1, 4], [4, 1, 4, 1]], dtype=float)
    return Scenario("four", latency_ms, bandwidth_gbps, num_stages=num_stages)


def test_two_groups_cost_by_hand():
    # activation 1 GB = 8 Gbit, gradient 2 GB = 16 Gbit, D_DP = 2.
    model = CostModel(four_devices(), Workload(activation_gb=1.0, gradient_gb=2.0))
    plan = model.describe([[0, 1], [2, 3]])
    # DP {0,1}: 2 * (0.010 + 16 / (2 * 8)) = 2.02; DP {2,3}: 2 * (0.020 + 16 / (2 * 4)) = 4.04.
    assert sorted(plan.group_dp_costs_s) == pytest.approx([2.02, 4.04])
    assert plan.dp_cost_s == pytest.approx(4.04)
    # PP links: 0-2 4.05, 0-3 2.03, 1-2 1.04, 1-3 8.06; matchings {0-2, 1-3} -> 8.06, {0-3, 1-2} -> 2.03.
    assert plan.pp_cost_s == pytest.approx(2.03)
    assert plan.cost_s == pytest.approx(4.04 + 2 * 2.03)
    assert sorted(sorted(p) for p in plan.pipelines) == [[0, 3], [1, 2]]


def test_other_split_by_hand():
    model = CostModel(four_devices(), Workload(activation_gb=1.0, gradient_gb=2.0))
    plan = model.describe([[0, 2], [1, 3]])
    # DP {0,2}: 2 * (0.05 + 16/4) = 8.1; DP {1,3}: 2 * (0.06 + 16/2) = 16.12.
    assert plan.dp_cost_s == pytest.approx(16.12)
    # Links 0-1 1.01, 0-3 2.03, 2-1 1.04, 2-3 2.02: best bottleneck {0-1, 2-3} = 2.02.
    assert plan.pp_cost_s == pytest.approx(2.02)
    assert model.cost([(0, 2), (1, 3)]) == pytest.approx(16.12 + 4.04)


def test_dp_cost_is_the_worst_member_of_one_group():
    # One stage of four devices: member i pays the sum over the other three of 2 (lat + 16 / (4 bw)).
    model = CostModel(four_devices(num_stages=1), Workload(activation_gb=1.0, gradient_gb=2.0))
    lat, bw = four_devices().latency_ms / 1000, four_devices().bandwidth_gbps
    sums = [sum(2 * (lat[i, j] + 16 / (4 * bw[i, j])) for j in range(4) if j != i) for i in range(4)]
    plan = model.describe([[0, 1, 2, 3]])
    assert plan.dp_cost_s == pytest.approx(max(sums))
    assert plan.pp_cost_s == 0.0
    assert plan.cost_s == pytest.approx(max(sums))


@pytest.mark.parametrize("name", list(COMMUNICATION_SCENARIOS))
def test_cost_is_invariant_under_relabelling(name):
    scenario = COMMUNICATION_SCENARIOS[name]()
    workload = Workload(0.471283, 0.65)
    shuffled, old_of_new = relabel(scenario, seed=3)
    new_of_old = np.argsort(old_of_new)
    original, renamed = CostModel(scenario, workload), CostModel(shuffled, workload)
    rng = np.random.default_rng(0)
    for _ in range(3):
        labels = rng.permutation(np.arange(64) % 8)
        groups = [np.flatnonzero(labels == k).tolist() for k in range(8)]
        moved = [[int(new_of_old[d]) for d in g] for g in groups]
        assert renamed.describe(moved).cost_s == pytest.approx(original.describe(groups).cost_s, rel=1e-12)
    assert sorted(shuffled.sites) == sorted(scenario.sites)
    assert not np.array_equal(shuffled.bandwidth_gbps, scenario.bandwidth_gbps)


def test_bottleneck_matching_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        # Small integers make many ties, the hard case for threshold search.
        cost = rng.integers(0, 6, size=(n, n)).astype(float) if rng.random() < 0.5 else rng.random((n, n))
        value, row_to_col = bottleneck_matching(cost)
        brute = min(max(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert value == brute
        assert sorted(row_to_col) == list(range(n))
        assert max(cost[i, row_to_col[i]] for i in range(n)) == value


def test_held_karp_matches_brute_force():
    rng = np.random.default_rng(2)
    for _ in range(100):
        n = int(rng.integers(1, 8))
        upper = rng.random((n, n))
        weights = np.triu(upper, 1) + np.triu(upper, 1).T
        cost, order = shortest_open_path(weights)
        brute = min(
            sum(weights[p[i], p[i + 1]] for i in range(n - 1)) for p in itertools.permutations(range(n))
        )
        assert cost == pytest.approx(brute, abs=1e-12)
        assert sorted(order) == list(range(n))
        assert sum(weights[order[i], order[i + 1]] for i in range(n - 1)) == pytest.approx(cost)
        assert shortest_open_path_cost(weights) == pytest.approx(brute, abs=1e-12)


def test_known_layouts_on_datacenter():
    # Rank-div puts each machine in one group (fast all-reduce, slow edges): DP 7 * 2 * 5.2/800,
    # 7 edges of 3.77026 / 3.125. Rank-mod spreads groups over machines: DP 7 * 2 * 5.2/25, edges in-machine.
    model = CostModel(COMMUNICATION_SCENARIOS["datacenter"](), Workload(0.471283, 0.65))
    act_gbit, grad_gbit = 0.471283 * 8, 0.65 * 8
    div = model.describe([list(range(8 * k, 8 * k + 8)) for k in range(8)])
    assert div.dp_cost_s == pytest.approx(7 * 2 * grad_gbit / (8 * 100))
    assert div.pp_cost_s == pytest.approx(7 * act_gbit / 3.125)
    mod = model.describe([list(range(k, 64, 8)) for k in range(8)])
    assert mod.dp_cost_s == pytest.approx(7 * 2 * grad_gbit / (8 * 3.125))
    assert mod.pp_cost_s == pytest.approx(7 * act_gbit / 100)
    assert all(len({d // 8 for d in pipeline}) == 1 for pipeline in mod.pipelines)  # wired inside machines


def test_workload_from_gpt3_xl():
    model = get_preset("gpt3-xl").model
    workload = workload_from_model(model, num_stages=8, macro_batch_samples=61)
    assert workload.gradient_gb == pytest.approx(3 * 50_358_272 * 4 / 1e9)  # 3 layers of fp32 params
    assert workload.activation_gb == pytest.approx(61 * 2048 * 2048 * 2 / 1e9)


def test_layout_validation():
    scenario = four_devices()
    assert validate_layout([[0, 1], [2, 3]], scenario) == [[0, 1], [2, 3]]
    bad = {
        "expected 2": [[0, 1, 2, 3]],
        "has 3 devices": [[0, 1, 2], [3]],
        "appears twice": [[0, 1], [1, 3]],
        "not a device index": [[0, 1], [2, 7]],
    }
    for message, layout in bad.items():
        with pytest.raises(LayoutError, match=message):
            validate_layout(layout, scenario)
