"""Placement search at the scale of real fleets: generated fleets of 64 to 4,096 devices, 16 stages.

    python bench/plan_scale.py [--sizes 64,256,1024,4096] [--shapes one-site,four-places,volunteers]
        [--num-stages 16] [--budget-s S] [--today-max-devices 1024] [--seed 0] [--quick]
        [--summary-json PATH]

Per fleet (size x shape, `planner.generated_fleets`; DT-FM sizes of gpt3-xl with the preset's global
batch split over the D_DP pipelines, as `swarmtrain plan --fleet` uses them), all in this one run:
- setup s: building the fleet and the cost model (link matrices, device classes), which `plan` also pays;
- structured: the cheapest structured layout (`planner.structured`: clusters cut into consecutive
  groups, location-pure where places divide into whole groups), each priced in its best pipeline order;
- search: `search_placement` with the time budget (default 10 s, 60 s from 4,096 devices; the issue's
  targets): its cost, evaluations, and seconds (from the search's start) and evaluations to its best;
- today: the search as it was before issue 41 (no structured seeds, every candidate scored in full,
  `at_scale=False`) with the same budget and seed; it still profits from this change's device classes
  and compiled matching, so it is faster here than it was. Above --today-max-devices it is skipped by
  default: its first seed alone (the striped seed's cluster scan, quadratic per cluster) took 47.8 s at
  4,096 devices on this machine (0.5 s at 1,024), most of the 60 s budget before one evaluation;
- ratios: search / structured (<= 1 is the target) and today / search.
The budget is wall time, so on a loaded machine the evaluations (not the costs of structured fleets,
whose best is found at once) drop; timings are upper bounds of an idle machine's.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core, like bench/plan_scenarios.py

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from swarmtrain.config import get_preset  # noqa: E402
from swarmtrain.planner.cost import CostModel, labels_to_groups, workload_from_model  # noqa: E402
from swarmtrain.planner.generated_fleets import FLEET_SHAPES, generated_fleet  # noqa: E402
from swarmtrain.planner.search import SearchConfig, search_placement  # noqa: E402
from swarmtrain.planner.structured import structured_layouts  # noqa: E402

LARGE_FLEET = 4096  # from this size on the default budget is 60 s (the target)


def build_model(shape: str, num_devices: int, num_stages: int) -> CostModel:
    preset = get_preset("gpt3-xl")
    scenario = generated_fleet(shape, num_devices, num_stages)
    samples = max(1, preset.training.global_batch_size // scenario.group_size)
    return CostModel(scenario, workload_from_model(preset.model, num_stages, samples))


def best_structured(model: CostModel) -> tuple[float, int]:
    """(cost of the cheapest structured layout, number of distinct structured layouts)."""
    scenario = model.scenario
    layouts = structured_layouts(model.pp_link_s, model.device_class, scenario.num_stages, scenario.sites)
    return min(model.cost(labels_to_groups(labels, scenario.num_stages)) for labels in layouts), len(layouts)


def run_fleet(shape: str, num_devices: int, args: argparse.Namespace) -> dict:
    budget_s = args.budget_s or (60.0 if num_devices >= LARGE_FLEET else 10.0)
    start_s = time.perf_counter()
    model = build_model(shape, num_devices, args.num_stages)
    setup_s = time.perf_counter() - start_s
    structured_s, layouts = best_structured(model)
    result = search_placement(model, SearchConfig(budget_s=budget_s), args.seed)
    row = {
        "shape": shape, "devices": num_devices, "budget_s": budget_s, "setup_s": setup_s,
        "classes": max(model.device_class) + 1, "structured_layouts": layouts, "structured_cost_s": structured_s,
        "cost_s": result.cost_s, "evaluations": result.evaluations,
        "evaluations_to_best": result.evaluations_to_best, "time_to_best_s": result.time_to_best_s,
        "search_over_structured": result.cost_s / structured_s, "today_cost_s": None,
        "today_evaluations": None, "today_wall_s": None, "today_over_search": None,
    }  # fmt: skip
    if num_devices <= args.today_max_devices:
        today_config = SearchConfig(budget_s=budget_s, structured_seeds=False, at_scale=False)
        today = search_placement(model, today_config, args.seed)
        row.update(
            today_cost_s=today.cost_s,
            today_evaluations=today.evaluations,
            today_wall_s=today.wall_s,
            today_over_search=today.cost_s / result.cost_s,
        )
    return row


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':12s} {'devices':>7s} {'setup s':>7s} {'classes':>7s} {'structured':>10s} {'search':>9s} "
        f"{'s->best':>7s} {'evals->best':>11s} {'evals':>6s} {'budget s':>8s} {'today':>9s} {'today evals':>11s} "
        f"{'search/struct':>13s} {'today/search':>12s}"
    )
    print("\n" + header)
    print("-" * len(header))
    for r in rows:
        today = f"{r['today_cost_s']:9.3f}" if r["today_cost_s"] is not None else f"{'-':>9s}"
        today_evals = f"{r['today_evaluations']:11d}" if r["today_evaluations"] is not None else f"{'-':>11s}"
        ratio = f"{r['today_over_search']:11.2f}x" if r["today_over_search"] is not None else f"{'-':>12s}"
        print(
            f"{r['shape']:12s} {r['devices']:7d} {r['setup_s']:7.1f} {r['classes']:7d} {r['structured_cost_s']:10.3f} "
            f"{r['cost_s']:9.3f} {r['time_to_best_s']:7.2f} {r['evaluations_to_best']:11d} {r['evaluations']:6d} "
            f"{r['budget_s']:8.0f} {today} {today_evals} {r['search_over_structured']:12.4f}x {ratio}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default=None, help="devices per fleet, multiples of 32 (default 64,256,1024,4096)"
    )
    parser.add_argument("--shapes", default=",".join(FLEET_SHAPES), help="fleet shapes to generate")
    parser.add_argument("--num-stages", type=int, default=16)
    parser.add_argument(
        "--budget-s", type=float, default=None, help="per search (default 10 s, 60 s at 4,096+)"
    )
    parser.add_argument(
        "--today-max-devices", type=int, default=1024, help="largest fleet to run today's search on"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="64 and 256 devices, 3 s budgets")
    parser.add_argument("--summary-json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.budget_s = args.sizes or "64,256", args.budget_s or 3.0
    args.sizes = args.sizes or "64,256,1024,4096"
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = args.shapes.split(",")
    print(f"gpt3-xl, {args.num_stages} stages, seed {args.seed}; costs are DT-FM seconds per iteration")
    rows = []
    for num_devices in sizes:
        for shape in shapes:
            print(f"  {shape} x {num_devices} ...", flush=True)
            rows.append(run_fleet(shape, num_devices, args))
            r = rows[-1]
            print(
                f"    search {r['cost_s']:.3f} s (best after {r['time_to_best_s']:.2f} s, {r['evaluations']} evaluations), "
                f"structured {r['structured_cost_s']:.3f} s, today {r['today_cost_s']}",
                flush=True,
            )
    print_table(rows)
    if args.summary_json:
        with open(args.summary_json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
