"""Compute-aware planning: exact layer allocation, memory limits, the DT-FM limit, and the comparison."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from swarmtrain.config import get_preset
from swarmtrain.config.errors import UserError
from swarmtrain.planner.cost import CostModel, Workload
from swarmtrain.planner.fleets import builtin_scenario
from swarmtrain.planner.hetero import (
    INFEASIBLE_S,
    ComputeModel,
    ComputeProfile,
    compare_compute_plans,
    compute_profile,
    even_layers,
)
from swarmtrain.planner.scenarios import Scenario
from swarmtrain.planner.search import SearchConfig

pytestmark = pytest.mark.unit


def small_fleet(seed: int, memory_gb: float = 80.0) -> Scenario:
    rng = np.random.default_rng(seed)
    latency = rng.uniform(1, 50, (8, 8))
    bandwidth = rng.uniform(0.5, 10, (8, 8))
    latency, bandwidth = np.minimum(latency, latency.T), np.minimum(bandwidth, bandwidth.T)
    tflops = rng.choice([65.0, 125.0, 312.0], size=8)
    return Scenario("small", latency, bandwidth, num_stages=4, tflops=tflops, memory_gb=np.full(8, memory_gb))


def profile(**changes) -> ComputeProfile:
    values = dict(
        num_layers=9, layer_flops_per_sample=7e11, head_flops_per_sample=1.2e12, layer_gradient_gb=0.2,
        first_extra_gradient_gb=0.4, last_extra_gradient_gb=0.4, layer_memory_gb=2.0,
        first_extra_memory_gb=1.7, last_extra_memory_gb=1.6, samples_per_macro_batch=64, micro_batches=4,
    )  # fmt: skip
    values.update(changes)
    return ComputeProfile(**values)


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_allocation_is_exact(seed):
    compute = ComputeModel(CostModel(small_fleet(seed, memory_gb=12.0), Workload(0.3, 0.6)), profile())
    groups = [(0, 1), (2, 3), (4, 5), (6, 7)]
    ordered, plan = compute.plan(groups)
    best = min(
        compute.evaluate_layers(direction, layers).iteration_s
        for direction in (ordered, ordered[::-1])
        for layers in compositions(9, 4)
    )
    assert plan.fits
    assert plan.iteration_s == pytest.approx(best, rel=1e-12)
    assert sum(plan.layers_per_stage) == 9 and min(plan.layers_per_stage) >= 1


def test_memory_limits_layers():
    groups = [(0, 1), (2, 3), (4, 5), (6, 7)]

    def plan_with(fast_memory_gb: float):
        fleet = small_fleet(0)
        tflops = np.array([1000.0, 1000.0] + [50.0] * 6)  # devices 0 and 1 are 20x faster
        memory = np.array([fast_memory_gb] * 2 + [80.0] * 6)
        fleet = Scenario("small", fleet.latency_ms, fleet.bandwidth_gbps, 4, tflops=tflops, memory_gb=memory)
        compute = ComputeModel(CostModel(fleet, Workload(0.3, 0.6)), profile())
        ordered, plan = compute.plan(groups)
        return plan, plan.layers_per_stage[ordered.index((0, 1))], ordered.index((0, 1))

    roomy, roomy_layers, _ = plan_with(80.0)
    assert roomy_layers >= 5  # the fast group takes most layers when it can hold them
    # 7 GB x 0.9 headroom at 2 GB per layer: 3 layers, or 2 next to the 1.7 GB of embeddings or head.
    tight, tight_layers, position = plan_with(7.0)
    assert tight.fits and tight_layers == (3 if 0 < position < 3 else 2)
    assert tight.iteration_s > roomy.iteration_s
    # 3 GB devices cannot hold a layer at all: the placement is infeasible.
    small, _, _ = plan_with(3.0)
    assert not small.fits and small.iteration_s == INFEASIBLE_S


def test_without_compute_it_is_the_dtfm_cost():
    """M = 1, no FLOPs, no embeddings: the iteration time is DP + 2 x PP of the DT-FM model."""
    scenario = small_fleet(3)
    no_compute = profile(
        num_layers=8, layer_flops_per_sample=0.0, head_flops_per_sample=0.0, layer_gradient_gb=0.3,
        first_extra_gradient_gb=0.0, last_extra_gradient_gb=0.0, micro_batches=1,
    )  # fmt: skip
    cost_model = CostModel(scenario, Workload(activation_gb=0.5, gradient_gb=0.6))  # 2 layers x 0.3 GB
    compute = ComputeModel(cost_model, no_compute)
    plan = cost_model.describe([[0, 7], [1, 6], [2, 5], [3, 4]])
    ordered = [tuple(g) for g in plan.groups]
    layered = compute.evaluate_layers(ordered, even_layers(8, 4))
    assert layered.iteration_s == pytest.approx(plan.cost_s, rel=1e-12)


def test_compute_profile_of_gpt3_xl():
    p = compute_profile(get_preset("gpt3-xl").model, samples_per_macro_batch=128)
    assert p.layer_flops_per_sample == pytest.approx(721.554505728e9)
    assert p.layer_gradient_gb == pytest.approx(50_358_272 * 4 / 1e9)
    assert p.layer_memory_gb == pytest.approx(50_358_272 * 16 / 1e9 + 128 * 2048 * 2048 * 2 / 1e9)
    with pytest.raises(UserError):
        compute_profile(get_preset("gpt3-xl").model, 128, utilization=1.5)


def test_compute_aware_plan_beats_communication_only_on_mixed_gpus():
    scenario = builtin_scenario("mixed-regional")
    model = get_preset("gpt3-xl").model
    cost_model = CostModel(scenario, Workload(0.471283, 0.65))
    compute = ComputeModel(cost_model, compute_profile(model, samples_per_macro_batch=128))
    config = SearchConfig(budget_evals=250, budget_s=1e9, local_search_patience=15)
    result = compare_compute_plans(compute, config, seed=0)
    assert result.joint.fits and result.comm_only_even.layers_per_stage == [3] * 8
    assert result.comm_only_balanced.iteration_s <= result.comm_only_even.iteration_s
    assert result.joint.iteration_s < 0.95 * result.comm_only_even.iteration_s
    assert sum(result.joint.layers_per_stage) == 24


def test_scenario_without_compute_is_a_user_error():
    cost_model = CostModel(builtin_scenario("regional"), Workload(0.5, 0.6))
    with pytest.raises(UserError, match="no device tflops"):
        ComputeModel(cost_model, profile())
