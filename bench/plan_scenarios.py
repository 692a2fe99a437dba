"""Placement search on the five DT-FM scenarios, against random placement and the two rank conventions,
and compute-aware plans against communication-only plans on the mixed-GPU fleets.

    python bench/plan_scenarios.py [--seeds 5] [--budget-s 10] [--budget-evals 20000]
        [--activation-gb 0.471283] [--gradient-gb 0.65] [--ablation] [--compute-seeds 3]
        [--summary-json PATH]

Table 1, per scenario over seeds: best DT-FM cost (mean, min), evaluations and seconds until the final
best was found, wall time of the whole run (the budget), and cost ratios baseline / plan for random
placement (mean of 100 random balanced placements per seed), stage = rank mod 8, stage = rank div 8.
`--ablation` adds the same search started from random partitions only (no constructive seeds).
Table 2 (`--compute-seeds 0` skips it): gpt3-xl on the mixed-GPU fleets (128 samples per macro-batch,
8 micro-batches, 40% of peak), predicted iteration time of the communication-only plan with even layers,
the same placement with balanced layers, and the compute-aware joint plan. Runs on one core.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # "on one core": keep BLAS from spreading out

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

from swarmtrain.config import get_preset  # noqa: E402
from swarmtrain.planner.cost import CostModel, Workload, labels_to_groups, workload_from_model  # noqa: E402
from swarmtrain.planner.fleets import MIXED_SCENARIOS  # noqa: E402
from swarmtrain.planner.hetero import ComputeModel, compare_compute_plans, compute_profile  # noqa: E402
from swarmtrain.planner.scenarios import COMMUNICATION_SCENARIOS  # noqa: E402
from swarmtrain.planner.search import SearchConfig, random_placement_costs, search_placement  # noqa: E402
from swarmtrain.planner.seeds import rank_div_labels, rank_mod_labels  # noqa: E402

RANDOM_SAMPLES = 100


def run_scenario(name: str, workload: Workload, config: SearchConfig, seeds: int) -> dict:
    model = CostModel(COMMUNICATION_SCENARIOS[name](), workload)
    mod = model.cost(labels_to_groups(rank_mod_labels(64, 8), 8))
    div = model.cost(labels_to_groups(rank_div_labels(64, 8), 8))
    runs = []
    for seed in range(seeds):
        result = search_placement(model, config, seed)
        random_mean = float(random_placement_costs(model, seed, RANDOM_SAMPLES).mean())
        runs.append({
            "seed": seed, "cost_s": result.cost_s, "evaluations": result.evaluations,
            "evaluations_to_best": result.evaluations_to_best, "time_to_best_s": result.time_to_best_s,
            "wall_s": result.wall_s, "random_mean_cost_s": random_mean,
        })  # fmt: skip
    costs = np.array([r["cost_s"] for r in runs])
    return {
        "scenario": name, "runs": runs, "best_mean_s": float(costs.mean()), "best_min_s": float(costs.min()),
        "evaluations_to_best_mean": float(np.mean([r["evaluations_to_best"] for r in runs])),
        "time_to_best_mean_s": float(np.mean([r["time_to_best_s"] for r in runs])),
        "time_to_best_max_s": float(np.max([r["time_to_best_s"] for r in runs])),
        "wall_mean_s": float(np.mean([r["wall_s"] for r in runs])),
        "evaluations_mean": float(np.mean([r["evaluations"] for r in runs])),
        "random_mean_cost_s": float(np.mean([r["random_mean_cost_s"] for r in runs])),
        "rank_mod_cost_s": mod, "rank_div_cost_s": div,
        "random_over_plan": float(np.mean([r["random_mean_cost_s"] / r["cost_s"] for r in runs])),
        "rank_mod_over_plan": float(np.mean(mod / costs)), "rank_div_over_plan": float(np.mean(div / costs)),
    }  # fmt: skip


def print_communication_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    header = (
        f"{'scenario':17s} {'best mean':>9s} {'best min':>9s} {'evals->best':>11s} {'s->best':>7s} "
        f"{'s->best max':>11s} {'wall s':>6s} {'evals':>6s} {'random':>8s} {'rank mod':>8s} {'rank div':>8s} "
        f"{'rand/plan':>9s} {'mod/plan':>8s} {'div/plan':>8s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['scenario']:17s} {r['best_mean_s']:9.3f} {r['best_min_s']:9.3f} {r['evaluations_to_best_mean']:11.0f} "
            f"{r['time_to_best_mean_s']:7.2f} {r['time_to_best_max_s']:11.2f} {r['wall_mean_s']:6.1f} "
            f"{r['evaluations_mean']:6.0f} {r['random_mean_cost_s']:8.3f} {r['rank_mod_cost_s']:8.3f} "
            f"{r['rank_div_cost_s']:8.3f} {r['random_over_plan']:8.2f}x {r['rank_mod_over_plan']:7.2f}x "
            f"{r['rank_div_over_plan']:7.2f}x"
        )


def run_compute(name: str, config: SearchConfig, seeds: int) -> dict:
    preset = get_preset("gpt3-xl")
    scenario = MIXED_SCENARIOS[name]()
    samples = preset.training.global_batch_size // scenario.group_size
    workload = workload_from_model(preset.model, scenario.num_stages, samples)
    compute = ComputeModel(CostModel(scenario, workload), compute_profile(preset.model, samples))
    runs = []
    for seed in range(seeds):
        c = compare_compute_plans(compute, config, seed)
        runs.append({
            "seed": seed, "even_s": c.comm_only_even.iteration_s, "balanced_s": c.comm_only_balanced.iteration_s,
            "joint_s": c.joint.iteration_s, "joint_layers": c.joint.layers_per_stage,
            "balanced_layers": c.comm_only_balanced.layers_per_stage,
            "joint_gpus": [sorted({scenario.gpu_names[d] for d in g}) for g in c.joint_groups],
            "joint_time_to_best_s": c.joint_search.time_to_best_s,
        })  # fmt: skip
    mean = {key: float(np.mean([r[key] for r in runs])) for key in ("even_s", "balanced_s", "joint_s")}
    return {"scenario": name, "runs": runs, **mean}


def print_compute_table(rows: list[dict]) -> None:
    print("\ncompute-aware planning, gpt3-xl, predicted iteration time in s (mean over seeds)")
    header = (
        f"{'scenario':17s} {'comm-only even':>14s} {'comm-only balanced':>18s} {'joint':>8s} "
        f"{'even/joint':>10s}  joint layers (seed 0)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['scenario']:17s} {r['even_s']:14.2f} {r['balanced_s']:18.2f} {r['joint_s']:8.2f} "
            f"{r['even_s'] / r['joint_s']:9.2f}x  {r['runs'][0]['joint_layers']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=10.0)
    parser.add_argument("--budget-evals", type=int, default=20_000)
    parser.add_argument("--activation-gb", type=float, default=0.471283)
    parser.add_argument("--gradient-gb", type=float, default=0.65)
    parser.add_argument("--ablation", action="store_true", help="also run the search from random starts only")
    parser.add_argument("--compute-seeds", type=int, default=3)
    parser.add_argument("--summary-json", default=None)
    args = parser.parse_args()
    workload = Workload(args.activation_gb, args.gradient_gb)
    config = SearchConfig(budget_evals=args.budget_evals, budget_s=args.budget_s)
    print(
        f"DT-FM cost, activation {args.activation_gb} GB, gradient {args.gradient_gb} GB, {args.seeds} seeds, "
        f"budget {args.budget_evals} evaluations or {args.budget_s} s per run; costs in s per iteration"
    )
    summary: dict = {"args": vars(args)}
    summary["search"] = [run_scenario(n, workload, config, args.seeds) for n in COMMUNICATION_SCENARIOS]
    print_communication_table(summary["search"], "memetic search (constructive + random starts)")
    if args.ablation:
        random_only = replace(config, constructive_seeds=False)
        summary["ablation"] = [
            run_scenario(n, workload, random_only, args.seeds) for n in COMMUNICATION_SCENARIOS
        ]
        print_communication_table(summary["ablation"], "ablation: the same search from random starts only")
    if args.compute_seeds > 0:
        summary["compute"] = [run_compute(n, config, args.compute_seeds) for n in MIXED_SCENARIOS]
        print_compute_table(summary["compute"])
    if args.summary_json:
        with open(args.summary_json, "w") as handle:
            json.dump(summary, handle, indent=2)


if __name__ == "__main__":
    main()
