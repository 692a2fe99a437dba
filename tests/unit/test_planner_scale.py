"""Placement at the scale of real fleets: incremental pricing equals full recosting, device classes,
structured layouts, the search against them at 1,024 devices, and compute-aware plans that fit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_planner_search import random_fleet

from swarmtrain.config import get_preset
from swarmtrain.planner import graph
from swarmtrain.planner.cost import (
    CostModel,
    Workload,
    interchangeable_classes,
    labels_to_groups,
    workload_from_model,
)
from swarmtrain.planner.generated_fleets import FLEET_SHAPES, generated_fleet
from swarmtrain.planner.graph import shortest_open_path
from swarmtrain.planner.hetero import ComputeModel, compare_compute_plans, compute_profile
from swarmtrain.planner.incremental import OrderedLayout
from swarmtrain.planner.scenarios import COMMUNICATION_SCENARIOS, ScenarioError, relabel
from swarmtrain.planner.search import SearchConfig, search_placement
from swarmtrain.planner.structured import structured_layouts

pytestmark = pytest.mark.unit

WORKLOAD = Workload(0.471283, 0.65)
EVALS_ONLY = dict(budget_s=1e9)  # evaluation budgets only: a time budget would depend on machine load


@functools.lru_cache(maxsize=4)
def gpt3_xl_model(shape: str, num_devices: int, num_stages: int = 16) -> CostModel:
    """The DT-FM cost model of a generated fleet with gpt3-xl's sizes, as `swarmtrain plan` builds it."""
    preset = get_preset("gpt3-xl")
    scenario = generated_fleet(shape, num_devices, num_stages)
    samples = preset.training.global_batch_size // scenario.group_size
    return CostModel(scenario, workload_from_model(preset.model, num_stages, samples))


def best_structured_cost(model: CostModel) -> float:
    scenario = model.scenario
    layouts = structured_layouts(model.pp_link_s, model.device_class, scenario.num_stages, scenario.sites)
    return min(model.cost(labels_to_groups(labels, scenario.num_stages)) for labels in layouts)


@pytest.mark.parametrize("fleet", ["random", "volunteers"])
def test_incremental_price_equals_full_recost_over_random_swaps(fleet):
    if fleet == "random":
        model = CostModel(random_fleet(48, 6, seed=3), WORKLOAD)
    else:
        model = gpt3_xl_model("volunteers", 256)
    n, s = model.scenario.num_devices, model.scenario.num_stages
    rng = np.random.default_rng(0)
    groups = labels_to_groups(rng.permutation(np.arange(n) % s), s)
    _, order = shortest_open_path(model.edge_matrix(groups))
    layout = OrderedLayout(model, [groups[k] for k in order])
    # In the best order the ordered price is the DT-FM cost itself.
    assert layout.cost_s == pytest.approx(model.cost(groups), rel=1e-12)
    for step in range(60):
        x = int(rng.integers(n))
        y = int(rng.choice(np.flatnonzero(layout.position != layout.position[x])))
        priced = layout.price_swap(x, y)
        labels = layout.labels()
        labels[x], labels[y] = labels[y], labels[x]
        full = model.ordered_score(labels_to_groups(labels, s))  # label = pipeline position
        assert (priced.cost_s, priced.tie_break) == pytest.approx(full, rel=1e-12)
        if step % 2 == 0:
            layout.apply(priced)
            assert (layout.cost_s, layout.tie_break) == pytest.approx(
                model.ordered_score(layout.groups), rel=1e-12
            )
    with pytest.raises(ValueError):
        layout.price_swap(layout.groups[0][0], layout.groups[0][1])


def brute_force_classes(matrices: list[np.ndarray]) -> list[int]:
    """The definition: a device joins the first class all of whose members it can swap with."""
    count = matrices[0].shape[0]
    classes: list[list[int]] = []
    out = []
    for x in range(count):
        for k, members in enumerate(classes):
            if all(
                all(np.array_equal(np.delete(m[x], [x, y]), np.delete(m[y], [x, y])) for m in matrices)
                for y in members
            ):
                members.append(x)
                out.append(k)
                break
        else:
            out.append(len(classes))
            classes.append([x])
    return out


def test_device_classes_match_the_definition_at_any_size():
    rng = np.random.default_rng(1)
    for count in (12, 30):
        site = rng.integers(0, 4, count)
        site_links = rng.choice([1.0, 2.0, 5.0], (4, 4))
        latency = np.minimum(site_links, site_links.T)[np.ix_(site, site)]
        np.fill_diagonal(latency, 0.0)
        bandwidth = np.ones((count, count))
        assert interchangeable_classes(latency, bandwidth) == brute_force_classes([latency, bandwidth])
    for name, make in COMMUNICATION_SCENARIOS.items():
        scenario, _ = relabel(make(), seed=2)
        matrices = [scenario.latency_ms, scenario.bandwidth_gbps]
        assert interchangeable_classes(*matrices) == brute_force_classes(matrices), name
    # Above the old 512-device cut-off classes still form: one per place of the four-place fleet.
    assert max(gpt3_xl_model("four-places", 1024).device_class) + 1 == 4
    # Attributes split a class: same links, different GPUs.
    latency, bandwidth = np.zeros((4, 4)), np.ones((4, 4))
    assert interchangeable_classes(latency, bandwidth, attributes=[np.array([1.0, 1.0, 2.0, 2.0])]) == [
        0,
        0,
        1,
        1,
    ]


def test_large_groups_use_the_compiled_matching_with_the_same_bottleneck():
    rng = np.random.default_rng(4)
    for size in (40, 100):
        cost = rng.integers(0, 30, (size, size)).astype(float)
        value, row_to_col = graph.bottleneck_matching(cost)
        assert sorted(row_to_col) == list(range(size))
        assert cost[np.arange(size), row_to_col].max() == value
        default = graph.BITMASK_MATCHING_MAX
        try:
            graph.BITMASK_MATCHING_MAX = 10**6
            assert graph.bottleneck_matching(cost)[0] == value
        finally:
            graph.BITMASK_MATCHING_MAX = default


def _is_pure(groups, sites) -> bool:
    return all(len({sites[d] for d in g}) == 1 for g in groups)


def test_structured_layouts_are_location_pure_and_ignore_numbering():
    model = gpt3_xl_model("four-places", 1024)
    scenario = model.scenario
    layouts = structured_layouts(model.pp_link_s, model.device_class, 16, scenario.sites)
    first = labels_to_groups(layouts[0], 16)  # the pure layouts come first
    assert _is_pure(first, scenario.sites)
    assert all(list(g) == list(range(g[0], g[0] + 64)) for g in first)  # consecutive index order
    assert not all(_is_pure(labels_to_groups(labels, 16), scenario.sites) for labels in layouts)  # + banded
    # Volunteers: every datacenter group is whole 8-GPU machines, every home group one region and tier.
    volunteers = gpt3_xl_model("volunteers", 256)
    sites = volunteers.scenario.sites
    first = structured_layouts(volunteers.pp_link_s, volunteers.device_class, 16, sites)[0]
    for group in labels_to_groups(first, 16):
        sites = [volunteers.scenario.sites[d] for d in group]
        gpus = {volunteers.scenario.gpu_names[d] for d in group}
        assert len(gpus) == 1
        if sites[0].startswith("dc"):
            assert all(sites.count(site) == 8 for site in sites)  # whole machines
        else:
            assert len(set(sites)) == 1  # one region
    # Renumbering the devices renumbers the structured layout, so its cost is unchanged.
    shuffled, _ = relabel(scenario, seed=5)
    model_shuffled = CostModel(shuffled, model.workload)
    assert best_structured_cost(model_shuffled) == pytest.approx(best_structured_cost(model), rel=1e-12)


def test_search_at_1024_devices_is_no_worse_than_the_best_structured_layout():
    model = gpt3_xl_model("four-places", 1024)
    result = search_placement(model, SearchConfig(budget_evals=150, **EVALS_ONLY), seed=0)
    assert result.evaluations == 150
    assert sorted(d for g in result.groups for d in g) == list(range(1024))
    assert result.cost_s == pytest.approx(model.cost(result.groups), rel=1e-12)
    assert result.cost_s <= best_structured_cost(model) * (1 + 1e-12)
    # Today's search (no structured seeds, full recosting) on the same budget mixes places and loses.
    today = search_placement(
        model, SearchConfig(budget_evals=3, structured_seeds=False, at_scale=False, **EVALS_ONLY), seed=0
    )
    assert today.cost_s > 1.5 * result.cost_s


def test_search_at_scale_improves_an_unstructured_fleet_and_returns_exact_costs():
    model = CostModel(random_fleet(96, 12, seed=7), WORKLOAD)
    for budget in (40, 400):  # 40: the budget ends inside a local search, whose result is scored in full
        result = search_placement(model, SearchConfig(budget_evals=budget, **EVALS_ONLY), seed=1)
        assert result.cost_s == pytest.approx(model.cost(result.groups), rel=1e-12)
        assert np.all(np.diff(result.best_cost_history_s) <= 0)
        assert result.cost_s <= best_structured_cost(model) * (1 + 1e-12)
    assert result.cost_s < 0.95 * result.best_cost_history_s[0]


def test_compute_plans_at_1024_devices_fit_memory():
    model = gpt3_xl_model("four-places", 1024)
    preset = get_preset("gpt3-xl")
    samples = preset.training.global_batch_size // model.scenario.group_size
    compute = ComputeModel(model, compute_profile(preset.model, samples))
    comparison = compare_compute_plans(compute, SearchConfig(budget_evals=20, **EVALS_ONLY), seed=0)
    plan, groups = comparison.joint, comparison.joint_groups
    assert plan.fits and sum(plan.layers_per_stage) == preset.model.num_layers
    assert (
        plan.iteration_s <= comparison.comm_only_balanced.iteration_s <= comparison.comm_only_even.iteration_s
    )
    profile = compute.profile
    for k, (group, layers) in enumerate(zip(groups, plan.layers_per_stage, strict=True)):
        extra = (profile.first_extra_memory_gb if k == 0 else 0.0) + (
            profile.last_extra_memory_gb if k == len(groups) - 1 else 0.0
        )
        assert layers * profile.layer_memory_gb + extra <= compute.memory_gb[list(group)].min()


def test_generated_fleets_have_their_shapes():
    for shape in FLEET_SHAPES:
        scenario = generated_fleet(shape, 64, 8)
        assert scenario.num_devices == 64 and scenario.has_compute and scenario.group_size == 8
    four = generated_fleet("four-places", 64, 8)
    assert [four.gpu_names[d] for d in (0, 16, 32, 48)] == ["a100", "v100", "t4", "rtx4090"]
    assert four.bandwidth_gbps[48, 0] == pytest.approx(0.3)  # the home's 300 Mbit/s uplink caps it
    with pytest.raises(ScenarioError):
        generated_fleet("four-places", 100, 4)
    with pytest.raises(ScenarioError):
        generated_fleet("moon-base", 64, 8)


@pytest.mark.parametrize(
    ("name", "best_known_s"),
    [
        ("datacenter", 3.440),
        ("spot", 31.636),
        ("multi-university", 16.088),
        ("regional", 34.804),
        ("world-wide", 49.220),
    ],
)
def test_banded_structured_layouts_hold_the_dt_fm_best_known_costs(name, best_known_s):
    scenario, _ = relabel(COMMUNICATION_SCENARIOS[name](), seed=1)  # numbering must not matter
    assert best_structured_cost(CostModel(scenario, WORKLOAD)) == pytest.approx(best_known_s, abs=5e-4)
