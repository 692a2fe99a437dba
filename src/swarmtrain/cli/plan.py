"""`swarmtrain plan`: place devices into pipeline stages with the DT-FM cost model and an evolutionary search.

Sizes come from a model preset (`--model`, evenly cut stages, `--macro-batch-samples` per pipeline) or
from `--activation-gb/--gradient-gb`. `--evaluate` scores a given layout instead of searching;
`--compute` also chooses layers per stage from device speed and memory and compares the result with the
communication-only plan. `--json` prints one JSON object, `--plot` draws best cost vs evaluations.

`--sizes` needs no fleet: it prints the model's GPU memory per stage of a cut (weights, gradients, AdamW
state, activations; planner/memory.py) and the fewest even stages that fit 16 and 24 GB GPUs.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from swarmtrain.cli.common import add_command, non_negative_float, positive_float, positive_int
from swarmtrain.config.errors import UserError
from swarmtrain.config.presets import preset_names

DEFAULT_BUDGET_EVALS = 20_000
DEFAULT_BUDGET_S = 10.0
RANDOM_BASELINE_SAMPLES = 100
RANDOM_BASELINE_MIN_SAMPLES = 5
RANDOM_BASELINE_DEVICE_SAMPLES = 25_600  # devices x samples: 100 up to 256 devices, 25 at 1,024

DESCRIPTION = """\
Choose which devices serve which pipeline stage so that gradient all-reduce inside each stage group
and activations between consecutive groups cost the least (Yuan et al. 2022, "Decentralized Training
of Foundation Models in Heterogeneous Environments"). Built-in fleets: datacenter, spot,
multi-university, regional, world-wide (communication only) and mixed-regional, mixed-world,
mixed-volunteers (with GPU speed and memory, for --compute).

Your own fleet (--fleet FILE.toml): the simulator's fleet file (locations, latency_ms, bandwidth_mbit_s,
[[peers]] with device, count, location; see docs/simulator.md and examples/fleet.toml). Devices take
peak TFLOPS and memory from the shared device table; --num-stages cuts them into stages (default 8).

The older form (--scenario-file), one JSON object; links are symmetric, latency >= 0, bandwidth > 0:
  {"name": "labs", "num_stages": 2,                        (default 8; must divide the devices)
   "devices": [{"site": "a", "gpu": "A100", "tflops": 312, "memory_gb": 80}, ...],   (or a count)
   "sites": ["a", "b"],                  (optional: then the matrices are site x site, the diagonal
                                          being the link between two devices of one site)
   "latency_ms": [[1, 30], [30, 1]], "bandwidth_gbps": [[100, 1], [1, 100]]}
A layout (--evaluate) is a JSON list with one list of device indices per stage group.

Memory table (--sizes, no fleet): swarmtrain plan --sizes --model llama-8b [--num-stages N |
--layers-per-stage a,b,...] [--micro-batch B] [--dtype fp32|bf16|fp16] [--gpu-gb 16,24] [--json].
Per stage: parameters, weights, gradients, optimizer state (AdamW's two fp32 moments, plus fp32 master
weights with bf16/fp16 compute: 16 B per parameter in all) and the activations autograd keeps for one
micro-batch; then, for each GPU size, the fewest evenly cut stages whose largest stage fits in it after
a headroom (default 10%) for the CUDA context, allocator and transient buffers.
"""

SIZES_ONLY = ("micro_batch", "dtype", "layers_per_stage", "gpu_gb", "headroom")
NOT_WITH_SIZES = (
    "scenario", "fleet", "scenario_file", "shuffle_seed", "macro_batch_samples", "activation_gb",
    "gradient_gb", "evaluate", "compute", "plot",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "plan", run, "place devices into pipeline stages (DT-FM cost model, evolutionary search)",
        description=DESCRIPTION,
    )  # fmt: skip
    # one source is needed, except with --sizes (checked in `run`, which names the missing flags)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--scenario", metavar="NAME", help="a built-in fleet (see above)")
    source.add_argument("--fleet", metavar="FILE.toml", help="a fleet file, the one `simulate --fleet` reads")
    source.add_argument(
        "--scenario-file", metavar="PATH", help="a fleet as JSON (devices, sites, latency_ms, bandwidth_gbps)"
    )
    parser.add_argument(
        "--num-stages",
        type=positive_int,
        default=None,
        metavar="N",
        help="stages for --fleet (default 8); with --sizes, the cut to tabulate (default: the preset's)",
    )
    parser.add_argument(
        "--shuffle-seed", type=int, default=None, metavar="N", help="relabel the devices randomly first"
    )
    sizes = parser.add_argument_group("sizes")
    sizes.add_argument(
        "--model",
        "--preset",
        dest="model",
        default="gpt3-xl",
        metavar="PRESET",
        help=f"model preset for sizes: {', '.join(preset_names())} (default: gpt3-xl)",
    )
    sizes.add_argument(
        "--macro-batch-samples",
        type=positive_int,
        default=None,
        metavar="N",
        help="samples each pipeline pushes per iteration (default: the preset's global batch / pipelines)",
    )
    sizes.add_argument(
        "--activation-gb",
        type=non_negative_float,
        default=None,
        metavar="X",
        help="override: GB crossing one stage boundary per macro-batch",
    )
    sizes.add_argument(
        "--gradient-gb",
        type=non_negative_float,
        default=None,
        metavar="Y",
        help="override: GB of one stage's gradient",
    )
    table = parser.add_argument_group("memory table (no fleet needed)")
    table.add_argument(
        "--sizes",
        action="store_true",
        help="print GPU memory per stage of --model (cut by --num-stages or --layers-per-stage) and the "
        "fewest even stages that fit each --gpu-gb",
    )
    table.add_argument(
        "--layers-per-stage", default=None, metavar="A,B,...", help="an uneven cut: layers of each stage"
    )
    table.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        metavar="B",
        help="samples whose activations a stage holds (default: the preset's micro_batch_size)",
    )
    table.add_argument(
        "--dtype",
        default=None,
        metavar="fp32|bf16|fp16",
        help="compute dtype of weights, gradients and activations (default bf16; the optimizer keeps fp32)",
    )
    table.add_argument(
        "--gpu-gb", default=None, metavar="G,G,...", help="GPU sizes in GB (1e9 bytes) to fit (default 16,24)"
    )
    table.add_argument(
        "--headroom",
        type=non_negative_float,
        default=None,
        metavar="F",
        help="fraction of each GPU left free for the CUDA context, allocator and transient buffers "
        "(default 0.1)",
    )
    search = parser.add_argument_group("search")
    search.add_argument("--seed", type=int, default=0)
    search.add_argument(
        "--budget-evals",
        type=positive_int,
        default=DEFAULT_BUDGET_EVALS,
        metavar="N",
        help=f"stop after N scored placements (default {DEFAULT_BUDGET_EVALS}; --compute runs two searches)",
    )
    search.add_argument(
        "--budget-s",
        type=positive_float,
        default=DEFAULT_BUDGET_S,
        metavar="S",
        help=f"stop after S seconds (default {DEFAULT_BUDGET_S:g}; per search)",
    )
    search.add_argument(
        "--evaluate", metavar="LAYOUT.json", help="score this layout (a list of stage groups) instead"
    )
    compute = parser.add_argument_group("compute-aware planning")
    compute.add_argument(
        "--compute", action="store_true", help="also choose layers per stage from GPU speed and memory"
    )
    compute.add_argument(
        "--micro-batches",
        type=positive_int,
        default=8,
        metavar="M",
        help="micro-batches per macro-batch (default 8)",
    )
    compute.add_argument(
        "--utilization",
        type=positive_float,
        default=0.4,
        metavar="U",
        help="achieved fraction of peak TFLOPS (default 0.4)",
    )
    output = parser.add_argument_group("output")
    output.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: cost_s, dp_cost_s, pp_cost_s, groups (pipeline order), pipelines, "
        "evaluations, evaluations_to_best, time_to_best_s, wall_s (+ compute fields with --compute)",
    )
    output.add_argument("--plot", metavar="PATH", help="write best cost vs evaluations as a PNG")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.planner.cost import CostModel
    from swarmtrain.planner.search import SearchConfig

    if args.sizes:
        return run_sizes(args)
    given = [name for name in SIZES_ONLY if getattr(args, name) is not None]
    if given:
        raise UserError(f"{_flag(given[0])} applies to --sizes")
    if not (args.scenario or args.fleet or args.scenario_file):
        raise UserError(
            "give a fleet (--scenario, --fleet or --scenario-file), or --sizes for the memory table"
        )
    scenario = _load_scenario(args)
    workload, model = _workload(args, scenario)
    cost_model = CostModel(scenario, workload)
    config = SearchConfig(budget_evals=args.budget_evals, budget_s=args.budget_s)
    layout = _read_layout(args.evaluate, scenario) if args.evaluate else None
    if args.compute:
        return run_compute(args, cost_model, model, config, layout)
    return run_communication(args, cost_model, config, layout)


def _load_scenario(args: argparse.Namespace):
    from swarmtrain.planner.fleet_scenario import load_fleet_scenario
    from swarmtrain.planner.fleets import builtin_scenario
    from swarmtrain.planner.scenario_file import load_scenario_file
    from swarmtrain.planner.scenarios import DEFAULT_NUM_STAGES, relabel

    if args.num_stages is not None and not args.fleet:
        raise UserError("--num-stages applies to --fleet (a scenario file gives num_stages itself)")
    if args.fleet:
        scenario = load_fleet_scenario(args.fleet, args.num_stages or DEFAULT_NUM_STAGES)
    elif args.scenario_file:
        scenario = load_scenario_file(args.scenario_file)
    else:
        scenario = builtin_scenario(args.scenario)
    if args.shuffle_seed is not None:
        scenario, _ = relabel(scenario, args.shuffle_seed)
    return scenario


def _workload(args: argparse.Namespace, scenario):
    """The Workload (explicit sizes win over the preset's) and the model config (None if not needed)."""
    from swarmtrain.config import get_preset
    from swarmtrain.planner.cost import Workload, workload_from_model

    needs_model = args.compute or args.activation_gb is None or args.gradient_gb is None
    if not needs_model:
        return Workload(args.activation_gb, args.gradient_gb), None
    preset = get_preset(args.model)
    if args.macro_batch_samples is None:
        args.macro_batch_samples = max(1, preset.training.global_batch_size // scenario.group_size)
    derived = workload_from_model(preset.model, scenario.num_stages, args.macro_batch_samples)
    workload = Workload(
        derived.activation_gb if args.activation_gb is None else args.activation_gb,
        derived.gradient_gb if args.gradient_gb is None else args.gradient_gb,
    )
    return workload, preset.model


def _read_layout(path: str, scenario) -> list[list[int]]:
    from swarmtrain.planner.cost import LayoutError, validate_layout

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read layout {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise LayoutError(f"layout {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return validate_layout(data, scenario)


def site_summary(scenario, group) -> str:
    """'virginia:2 oregon:2 ...' for a group (first four sites, then a count)."""
    if not scenario.sites:
        return ""
    counts = Counter(scenario.sites[d] for d in group)
    parts = [f"{site}:{n}" for site, n in counts.most_common()]
    return " ".join(parts[:4]) + (f" +{len(parts) - 4} sites" if len(parts) > 4 else "")


def gpu_summary(scenario, group) -> str:
    if not scenario.gpu_names:
        return ""
    counts = Counter(scenario.gpu_names[d] for d in group)
    return " ".join(f"{gpu}:{n}" for gpu, n in counts.most_common())


def run_communication(args: argparse.Namespace, cost_model, config, layout) -> int:
    import time

    from swarmtrain.planner.search import search_placement

    start_s = time.perf_counter()
    if layout is None:
        result = search_placement(cost_model, config, args.seed)
        plan = cost_model.describe(result.groups)
        evaluations, to_best, history = (
            result.evaluations,
            result.evaluations_to_best,
            result.best_cost_history_s,
        )
        time_to_best_s = result.time_to_best_s
    else:
        plan = cost_model.describe(layout)
        evaluations, to_best, history = 1, 1, [plan.cost_s]
        time_to_best_s = time.perf_counter() - start_s
    summary = {
        "cost_s": plan.cost_s, "dp_cost_s": plan.dp_cost_s, "pp_cost_s": plan.pp_cost_s,
        "groups": plan.groups, "pipelines": plan.pipelines, "evaluations": evaluations,
        "evaluations_to_best": to_best, "time_to_best_s": time_to_best_s, "wall_s": time.perf_counter() - start_s,
    }  # fmt: skip
    baselines = _baselines(cost_model, args.seed) if (args.plot or not args.json) else {}
    if args.plot:
        _plot(args.plot, history, baselines, f"{cost_model.scenario.name}: DT-FM cost", "cost (s)")
    if args.json:
        print(json.dumps(summary))
        return 0
    _print_header(args, cost_model, "evaluated layout" if layout is not None else None, summary)
    print(f"\n{'placement':24s} {'cost_s':>9s} {'dp_cost_s':>10s} {'pp_cost_s':>10s} {'vs this':>8s}")
    print(f"{'this plan':24s} {plan.cost_s:9.3f} {plan.dp_cost_s:10.3f} {plan.pp_cost_s:10.3f} {1:7.2f}x")
    for name, cost in baselines.items():
        print(f"{name:24s} {cost:9.3f} {'':10s} {'':10s} {cost / plan.cost_s:7.2f}x")
    print(f"\n{'stage':>5s} {'dp_cost_s':>9s} {'edge_next_s':>11s}  devices  [sites]")
    edges = plan.path_edge_costs_s + [0.0]
    for k, group in enumerate(plan.groups):
        where = site_summary(cost_model.scenario, group)
        print(
            f"{k:5d} {plan.group_dp_costs_s[k]:9.3f} {edges[k]:11.3f}  {' '.join(map(str, group))}  [{where}]"
        )
    return 0


def _baselines(cost_model, seed: int) -> dict[str, float]:
    from swarmtrain.planner.cost import labels_to_groups
    from swarmtrain.planner.search import random_placement_costs
    from swarmtrain.planner.seeds import rank_div_labels, rank_mod_labels

    n, s = cost_model.scenario.num_devices, cost_model.scenario.num_stages
    # fewer on large fleets: a random layout's cost takes ~0.2 s at 1,024 devices, and 100 of them made a
    # plan of 10 s take 34 s
    samples = max(
        RANDOM_BASELINE_MIN_SAMPLES, min(RANDOM_BASELINE_SAMPLES, RANDOM_BASELINE_DEVICE_SAMPLES // n)
    )
    return {
        f"random (mean of {samples})": float(random_placement_costs(cost_model, seed, samples).mean()),
        f"rank mod {s}": cost_model.cost(labels_to_groups(rank_mod_labels(n, s), s)),
        f"rank div {n // s}": cost_model.cost(labels_to_groups(rank_div_labels(n, s), s)),
    }


def _print_header(args: argparse.Namespace, cost_model, mode: str | None, summary: dict) -> None:
    sc, w = cost_model.scenario, cost_model.workload
    relabelled = f", devices relabelled (seed {args.shuffle_seed})" if args.shuffle_seed is not None else ""
    print(
        f"scenario {sc.name}: {sc.num_devices} devices, {sc.num_stages} stages x {sc.group_size}{relabelled}"
    )
    print(
        f"sizes: activation {w.activation_gb:.6g} GB per macro-batch, gradient {w.gradient_gb:.6g} GB per stage"
    )
    if mode is None:
        print(
            f"search: seed {args.seed}, {summary['evaluations']} evaluations in {summary['wall_s']:.2f} s, "
            f"best at evaluation {summary['evaluations_to_best']} ({summary['time_to_best_s']:.2f} s)"
        )
    else:
        print(mode)


def _plot(path: str, history, baselines: dict[str, float], title: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(range(1, len(history) + 1), history, label="best so far")
    for k, (name, cost) in enumerate(baselines.items()):
        axes.axhline(cost, linestyle="--", color=f"C{k + 1}", label=name)
    axes.set_xscale("log")
    axes.set_xlabel("evaluations")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write plot {path}: {exc.strerror}") from None
    finally:
        plt.close(figure)


def run_compute(args: argparse.Namespace, cost_model, model, config, layout) -> int:
    """Compute-aware plan: layers per stage from GPU speed and memory, against the communication-only plan."""
    import time

    from swarmtrain.planner.hetero import ComputeModel, compare_compute_plans, compute_profile, even_layers

    start_s = time.perf_counter()
    profile = compute_profile(model, args.macro_batch_samples, args.micro_batches, args.utilization)
    compute = ComputeModel(cost_model, profile)
    if layout is None:
        comparison = compare_compute_plans(compute, config, args.seed)
        groups, plan = comparison.joint_groups, comparison.joint
        searches = (comparison.comm_search, comparison.joint_search)
        evaluations = sum(r.evaluations for r in searches)
        to_best, history = (
            comparison.joint_search.evaluations_to_best,
            comparison.joint_search.best_cost_history_s,
        )
        time_to_best_s = comparison.joint_search.time_to_best_s
        rows = [
            ("communication-only, even layers", comparison.comm_only_groups, comparison.comm_only_even),
            (
                "communication-only, balanced layers",
                comparison.comm_only_balanced_groups,
                comparison.comm_only_balanced,
            ),
            ("compute-aware (joint search)", groups, plan),
        ]
    else:
        groups, plan = compute.plan(layout)
        even = compute.evaluate_layers(groups, even_layers(profile.num_layers, len(groups)))
        evaluations, to_best, history = 1, 1, [plan.iteration_s]
        time_to_best_s = time.perf_counter() - start_s
        rows = [("layout, even layers", groups, even), ("layout, balanced layers", groups, plan)]
    described = cost_model.describe(groups)
    summary = {
        "cost_s": described.cost_s, "dp_cost_s": described.dp_cost_s, "pp_cost_s": described.pp_cost_s,
        "groups": [list(g) for g in groups], "pipelines": cost_model.wire_pipelines(groups),
        "evaluations": evaluations, "evaluations_to_best": to_best, "time_to_best_s": time_to_best_s,
        "wall_s": time.perf_counter() - start_s, "iteration_s": plan.iteration_s, "layers_per_stage": plan.layers_per_stage, "fits_memory": plan.fits,
        "stage_compute_s": plan.compute_s,
        "alternatives": {name: {"iteration_s": p.iteration_s, "layers_per_stage": p.layers_per_stage,
                                "fits_memory": p.fits, "cost_s": cost_model.cost(g)} for name, g, p in rows},
    }  # fmt: skip
    if args.plot:
        _plot(
            args.plot, history, {}, f"{cost_model.scenario.name}: predicted iteration time", "iteration (s)"
        )
    if args.json:
        print(json.dumps(summary))
        return 0
    _print_header(args, cost_model, "evaluated layout" if layout is not None else None, summary)
    print(f"compute: {profile.samples_per_macro_batch} samples per macro-batch in {profile.micro_batches} "
          f"micro-batches, {profile.utilization:.0%} of peak TFLOPS")  # fmt: skip
    print(f"\n{'plan':38s} {'iteration_s':>11s} {'DT-FM cost_s':>12s}  layers per stage")
    for name, g, p in rows:
        shown = f"{p.iteration_s:11.3f}" if p.fits else f"{'no fit':>11s}"
        print(f"{name:38s} {shown} {cost_model.cost(g):12.3f}  {p.layers_per_stage}")
    print(f"\n{'stage':>5s} {'layers':>6s} {'compute_s':>9s} {'stage_s':>8s}  gpus  [sites]")
    for k, group in enumerate(groups):
        sc = cost_model.scenario
        print(f"{k:5d} {plan.layers_per_stage[k]:6d} {plan.compute_s[k]:9.3f} {plan.stage_times_s[k]:8.3f}  "
              f"{gpu_summary(sc, group)}  [{site_summary(sc, group)}]")  # fmt: skip
    return 0


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers like 4,4,3, got {text!r}") from None
    if any(v < 0 for v in values):
        raise UserError(f"{flag} takes non-negative counts, got {text!r}")
    return values


def _gpu_sizes(text: str | None) -> list[float]:
    from swarmtrain.planner.memory import DEFAULT_GPU_GB

    if text is None:
        return list(DEFAULT_GPU_GB)
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--gpu-gb takes comma-separated sizes in GB like 16,24, got {text!r}") from None
    if not all(v > 0 for v in values):  # also rejects nan
        raise UserError(f"--gpu-gb sizes must be positive, got {text!r}")
    return values


def _sizes_cut(args: argparse.Namespace, model, default_stages: int):
    from swarmtrain.config.model import partition_layers

    if args.layers_per_stage is None:
        num_stages = args.num_stages or min(default_stages, model.num_layers)
        if model.tie_embeddings and args.num_stages is None:
            num_stages = 1
        return partition_layers(model.num_layers, num_stages)
    counts = _int_list(args.layers_per_stage, "--layers-per-stage")
    if args.num_stages is not None and args.num_stages != len(counts):
        raise UserError(
            f"--num-stages {args.num_stages} disagrees with --layers-per-stage ({len(counts)} stages)"
        )
    return partition_layers(model.num_layers, len(counts), counts)


def run_sizes(args: argparse.Namespace) -> int:
    """`plan --sizes`: the memory table of a model's cut and the fewest even stages per GPU size."""
    from swarmtrain.config import get_preset, sizes
    from swarmtrain.planner.memory import DEFAULT_HEADROOM, fewest_even_stages, get_precision, memory_table

    extra = [name for name in NOT_WITH_SIZES if getattr(args, name) not in (None, False)]
    if extra:
        raise UserError(f"--sizes needs no fleet or search: drop {_flag(extra[0])}")
    preset = get_preset(args.model)
    model = preset.model
    precision = get_precision(args.dtype or "bf16")
    micro_batch = args.micro_batch or preset.training.micro_batch_size
    headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
    gpus = _gpu_sizes(args.gpu_gb)
    stages = _sizes_cut(args, model, preset.swarm.num_stages)
    table = memory_table(model, stages, micro_batch, precision)
    fits = [fewest_even_stages(model, gb, micro_batch, precision, headroom) for gb in gpus]
    largest = max(m.total_bytes for m in table)
    if args.json:
        print(json.dumps({
            "model": args.model, "arch": model.arch, "total_params": sizes.total_params(model),
            "num_layers": model.num_layers, "shared_layer_repeats": model.shared_layer_repeats,
            "micro_batch": micro_batch, "dtype": precision.name,
            "bytes_per_param": {"weights": precision.compute_bytes, "gradients": precision.compute_bytes,
                                "optimizer": precision.optimizer_bytes_per_param},
            "headroom": headroom, "stages": [m.as_dict() for m in table],
            "total_bytes": sum(m.total_bytes for m in table),
            "fits": [{**f.as_dict(), "this_cut_fits": largest <= f.usable_bytes} for f in fits],
        }))  # fmt: skip
        return 0
    _print_sizes(args.model, model, precision, micro_batch, headroom, table, fits)
    return 0


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _count(value: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f}{suffix}"
    return str(value)


def _print_sizes(name, model, precision, micro_batch, headroom, table, fits) -> None:
    from swarmtrain.config import sizes

    kv = f" over {model.kv_heads} kv" if model.arch == "llama" and model.kv_heads != model.num_heads else ""
    shared = f", each applied {model.shared_layer_repeats}x" if model.shared_layer_repeats > 1 else ""
    tied = ", tied head" if model.tie_embeddings else ""
    print(
        f"{name}: {model.arch}, {_count(sizes.total_params(model))} parameters; {model.num_layers} layers{shared}, "
        f"d {model.d_model}, {model.num_heads} heads{kv}, d_ff {model.d_ff}, vocab {model.vocab_size}, "
        f"seq {model.seq_len}{tied}"
    )
    p = precision
    master = f" + fp32 master {p.master_bytes}" if p.master_bytes else ""
    print(
        f"cut into {len(table)} stages, micro-batch {micro_batch}, {p.name}: weights {p.compute_bytes} + gradients "
        f"{p.compute_bytes} + AdamW moments 8{master} = {p.bytes_per_param} B per parameter"
    )
    header = ("stage", "layers", "params", "weights", "grads", "optimizer", "activations", "total")
    widths = (5, 9, 9, 10, 10, 10, 12, 10)
    print()
    print(" ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for m in table:
        cells = (
            str(m.index), f"{m.layer_start}-{m.layer_end - 1}" if m.layer_end > m.layer_start else "-",
            _count(m.params), _gb(m.weight_bytes), _gb(m.gradient_bytes), _gb(m.optimizer_bytes),
            _gb(m.activation_bytes), _gb(m.total_bytes),
        )  # fmt: skip
        print(" ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    total = sum(m.total_bytes for m in table)
    largest = max(table, key=lambda m: m.total_bytes)
    print(f"\nall stages {_gb(total)}; largest stage {largest.index} {_gb(largest.total_bytes)}")
    print(f"per GPU size, leaving {headroom:.0%} free for the CUDA context, allocator and transient buffers: "
          "does this cut fit, and the fewest even stages that do")  # fmt: skip
    for f in fits:
        this_cut = "fits" if largest.total_bytes <= f.usable_bytes else "does not fit"
        where = f"{f.gpu_gb:g} GB GPU ({_gb(f.usable_bytes)} usable): this cut {this_cut};"
        if f.num_stages is None:
            if model.tie_embeddings:
                print(f"  {where} tied embeddings need one stage, of {_gb(f.largest_stage_bytes)}")
            else:
                print(f"  {where} no even cut fits (at one layer per stage the largest is "
                      f"{_gb(f.largest_stage_bytes)}; try --layers-per-stage)")  # fmt: skip
        else:
            stages = "stage" if f.num_stages == 1 else "stages"
            print(f"  {where} fewest even: {f.num_stages} {stages} (largest {_gb(f.largest_stage_bytes)})")
