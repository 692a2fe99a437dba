"""`swarmtrain simulate`: what would this fleet do? A discrete-event simulation on a virtual clock."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from swarmtrain.cli.common import (
    add_command,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    write_summary_json,
)
from swarmtrain.config.errors import UserError

MODE_CHOICES = ("swarm", "swarm-no-rebalance", "gpipe", "async-replicas", "all")
CHURN_CHOICES = ("none", "preemptible", "exponential", "diurnal", "regional-outage")
DEFAULT_H_VALUES = (1, 2, 5, 10, 20, 50, 100)  # as sim.mode_choice (not imported: --help stays fast)
DEFAULT_DURATION_S = 3600.0
DEFAULT_EVENT_BUDGET = 1_500_000
CHOOSE_DURATION_S = 600.0  # --choose-mode: SWARM's simulated seconds (replicas run whole rounds)
CHOOSE_EVENT_BUDGET = 300_000

DESCRIPTION = """\
Simulate training on a fleet you may not have: thousands of heterogeneous, preemptible peers on
several continents, on a virtual clock (deterministic for a seed). Compares SWARM with and without
rebalancing, fixed GPipe pipelines and asynchronous full replicas on the same fleet and churn, against
the fleet's optimal throughput at every moment.

--choose-mode answers "SWARM or asynchronous full replicas, and averaging every how many local steps
(H)?": it simulates SWARM (--duration-s, default 600 s) and replicas at each H of --h-values (a whole
number of averaging rounds each), prints samples/s and synchronization bytes per sample of each, the
recommendation and why (memory, bandwidth, device speed). The smallest H within 10% of the best
replica throughput is chosen (rarer averaging costs convergence, which is not simulated), and replicas
only when they beat SWARM by 10% or more. --summary-json writes the same as JSON.

examples:
  swarmtrain simulate --num-peers 1000 --churn preemptible --plot sim.png
  swarmtrain simulate --scenario world-wide --mode all --duration-s 1800
  swarmtrain simulate --fleet my_fleet.toml --trace outages.csv --summary-json out.json
  swarmtrain simulate --scenario world-wide --model gpt2-small --choose-mode --h-values 1,10,100
"""


def register(subparsers) -> None:
    p = add_command(
        subparsers,
        "simulate",
        run,
        "simulate a fleet (SWARM, fixed pipelines, async replicas) on a virtual clock",
        description=DESCRIPTION,
    )
    fleet = p.add_mutually_exclusive_group()
    fleet.add_argument("--scenario", metavar="NAME", help="one of the planner's five 64-device scenarios")
    fleet.add_argument("--fleet", metavar="FILE", help="a TOML fleet file (see examples/fleet.toml)")
    fleet.add_argument(
        "--num-peers",
        type=positive_int,
        metavar="N",
        help="a synthetic fleet: 5%% a100, 15%% v100, 30%% t4, 25%% rtx3090, 25%% rtx2080ti in 8 cities",
    )
    p.add_argument(
        "--model",
        default="gpt3-xl",
        metavar="PRESET|FILE",
        help="model preset or TOML run file (default gpt3-xl)",
    )
    p.add_argument("--stages", type=positive_int, metavar="S", help="override the number of pipeline stages")
    p.add_argument("--global-batch-size", type=positive_int, metavar="N", help="samples per optimizer step")
    p.add_argument(
        "--mode", choices=MODE_CHOICES, help="what to run (default swarm); `all` compares the four"
    )
    p.add_argument(
        "--choose-mode",
        action="store_true",
        help="recommend SWARM or async replicas and their H for this fleet, with reasons (see above)",
    )
    p.add_argument(
        "--h-values",
        type=_h_values,
        metavar="H,H,...",
        help=f"--choose-mode: local steps between averaging rounds to try (default {','.join(map(str, DEFAULT_H_VALUES))})",
    )
    p.add_argument(
        "--local-batch-samples",
        type=positive_int,
        metavar="N",
        help="async replicas: samples per local step (default: global batch / 16)",
    )
    churn = p.add_mutually_exclusive_group()
    churn.add_argument(
        "--churn",
        choices=CHURN_CHOICES,
        default="none",
        metavar="NAME",
        help=f"churn model: {', '.join(CHURN_CHOICES)}",
    )
    churn.add_argument("--trace", metavar="FILE", help="CSV churn trace: time_s,peer,event (join/leave/fail)")
    p.add_argument(
        "--duration-s",
        type=positive_float,
        help=f"simulated seconds (default {DEFAULT_DURATION_S:g}; {CHOOSE_DURATION_S:g} for SWARM with --choose-mode)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot", metavar="PATH", help="write a PNG of throughput, fraction of optimal, utilization"
    )
    p.add_argument("--summary-json", metavar="PATH", help="write the summary as JSON")
    p.add_argument(
        "--timeline-json",
        metavar="PATH",
        help="write every stage's peers, the bottleneck, throughput and lost work at each sample point, "
        "for `swarmtrain monitor --replay PATH` (one mode of swarm, swarm-no-rebalance, gpipe)",
    )
    p.add_argument(
        "--peer-compute-times",
        metavar="FILE",
        help="calibration: CSV peer,stage,seconds_per_sample of measured forward+backward time",
    )
    p.add_argument("--bandwidth-mbit-s", type=positive_float, metavar="X", help="set every link to X Mbit/s")
    p.add_argument("--latency-ms", type=non_negative_float, metavar="X", help="set every latency to X ms")
    p.add_argument("--save-trace", metavar="FILE", help="write the churn that was simulated as a trace file")
    p.add_argument("--in-flight", type=positive_int, metavar="N", help="micro-batches in flight (SWARM)")
    p.add_argument("--trainers", type=positive_int, metavar="N", help="number of trainers (SWARM)")
    p.add_argument(
        "--chunk-samples", type=positive_int, metavar="N", help="samples per simulated micro-batch"
    )
    p.add_argument(
        "--compute-cv",
        type=_cv,
        default=0.0,
        metavar="CV",
        help="variability of each compute task: coefficient of variation (gamma, mean kept; default 0)",
    )
    p.add_argument(
        "--latency-cv",
        type=_cv,
        default=0.0,
        metavar="CV",
        help="variability of each transfer's latency, as --compute-cv (default 0)",
    )
    p.add_argument(
        "--call-overhead-s",
        type=_overhead_s,
        default=0.0,
        metavar="T",
        help="fixed cost of every compute call on a stage peer (Python, dispatch, kernel launches), added "
        "to the samples' compute; on small micro-batches it is most of a call. A call is one simulated "
        "micro-batch (--chunk-samples, which may stand for several real ones) or a batch of them "
        "(default 0; SWARM and GPipe modes)",
    )
    p.add_argument(
        "--max-batch-samples",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="request batching, as a live server's --max-batch-tokens: a peer starting a call takes its "
        "queued micro-batches of the same stage, kind and step with it, oldest first, up to N samples, "
        "as one call (default 0: off). It saves the per-call cost only, so it helps only with "
        "--call-overhead-s > 0; each part's results wait for the whole call",
    )
    p.add_argument("--rebalance-period-s", type=positive_float, default=60.0, metavar="T")
    p.add_argument(
        "--stage-exchange",
        choices=("butterfly", "all-to-all"),
        default="butterfly",
        help="how a stage's peers exchange gradients each step. butterfly (default): SWARM's all-reduce of "
        "fp16 gradients, 2 (n-1)/n of them each way per peer; all-to-all: what the runtime does today, "
        "each peer's sums to every other peer of its stage in the run's swarm.exchange_compression "
        "((n-1) x them each way), which grows with the stage's size",
    )
    p.add_argument(
        "--event-budget",
        type=positive_int,
        metavar="N",
        help=f"target events when the micro-batch granularity is derived (default {DEFAULT_EVENT_BUDGET:,}; "
        f"{CHOOSE_EVENT_BUDGET:,} with --choose-mode)",
    )

    def one_line_error(message: str) -> None:
        print(f"swarmtrain simulate: error: {message}", file=sys.stderr)
        sys.exit(2)

    p.error = one_line_error  # bad input: exit 2 with one line, like every UserError


def _h_values(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas (e.g. 1,10,100), got {text!r}"
        )
    return values


def _cv(text: str) -> float:
    value = non_negative_float(text)
    if value >= 10:
        raise argparse.ArgumentTypeError(f"a coefficient of variation below 10 is expected, got {text}")
    return value


def _overhead_s(text: str) -> float:
    value = non_negative_float(text)
    if value == float("inf"):
        raise argparse.ArgumentTypeError("expected a finite number of seconds")
    return value


def _run_config(args):
    from swarmtrain.config import get_preset, load_run_config

    run = load_run_config(args.model) if args.model.endswith(".toml") else get_preset(args.model)
    if args.stages:
        run = run.replace(swarm=replace(run.swarm, num_stages=args.stages))
    return run


def _fleet(args, num_stages: int):
    from swarmtrain.sim import fleet as fleets
    from swarmtrain.sim.fleet_file import load_fleet_file

    if args.scenario:
        fleet = fleets.scenario_fleet(args.scenario)
    elif args.fleet:
        fleet = load_fleet_file(args.fleet)
    elif args.num_peers:
        fleet = fleets.synthetic_fleet(args.num_peers, args.seed)
    else:
        raise UserError("choose a fleet: --scenario NAME, --fleet FILE or --num-peers N")
    if args.bandwidth_mbit_s is not None or args.latency_ms is not None:
        bandwidth = args.bandwidth_mbit_s * 1e6 / 8 if args.bandwidth_mbit_s is not None else None
        latency = args.latency_ms / 1e3 if args.latency_ms is not None else None
        fleet = fleets.with_links(fleet, bandwidth, latency)
    if args.peer_compute_times:
        fleet = fleets.load_compute_times(args.peer_compute_times, fleet, num_stages)
    return fleet


def run(args: argparse.Namespace) -> int:
    from swarmtrain.sim.base import MODES, SimConfig
    from swarmtrain.sim.churn import churn_schedule, load_trace, write_trace
    from swarmtrain.sim.heap import keep_freed_memory
    from swarmtrain.sim.report import human_bytes, summaries_table
    from swarmtrain.sim.runner import run_simulation

    start = time.perf_counter()  # the CLI, not the engine, measures wall time
    keep_freed_memory()  # a large fleet's arrays are allocated and freed thousands of times a run
    if args.choose_mode:
        return _choose_mode(args, start)
    if args.h_values is not None:
        raise UserError("--h-values goes with --choose-mode")
    args.mode = args.mode or "swarm"
    args.duration_s = args.duration_s or DEFAULT_DURATION_S
    args.event_budget = args.event_budget or DEFAULT_EVENT_BUDGET
    run_cfg = _run_config(args)
    fleet = _fleet(args, run_cfg.swarm.num_stages)
    if args.trace:
        schedule, churn_name = load_trace(args.trace, fleet), f"trace {Path(args.trace).name}"
    else:
        schedule, churn_name = churn_schedule(args.churn, fleet, args.duration_s, args.seed), args.churn
    if args.save_trace:
        write_trace(args.save_trace, schedule, fleet)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    _check_timeline_mode(args)
    results, frames = [], []
    for mode in modes:
        config = SimConfig(
            mode=mode,
            duration_s=args.duration_s,
            seed=args.seed,
            chunk_samples=args.chunk_samples,
            in_flight=args.in_flight,
            num_trainers=args.trainers,
            rebalance_period_s=args.rebalance_period_s,
            event_budget=args.event_budget,
            compute_cv=args.compute_cv,
            latency_cv=args.latency_cv,
            local_batch_samples=args.local_batch_samples,
            stage_exchange=args.stage_exchange,
            call_overhead_s=args.call_overhead_s,
            max_batch_samples=args.max_batch_samples,
        )
        if args.timeline_json:
            from swarmtrain.sim.timeline import run_with_timeline

            result, frames = run_with_timeline(fleet, run_cfg, config, schedule, args.global_batch_size)
            results.append(result)
        else:
            results.append(run_simulation(fleet, run_cfg, config, schedule, args.global_batch_size))
    wall_s = time.perf_counter() - start
    counts = schedule.counts()
    print(f"fleet: {fleet.description}")
    print(
        f"model: {args.model}, {run_cfg.swarm.num_stages} stages | churn: {churn_name} ({counts['fail']} failures, "
        f"{counts['leave']} leaves, {counts['join']} joins) | {args.duration_s:g} s simulated in {wall_s:.1f} s wall"
    )
    print(summaries_table([r.summary for r in results]))
    if len(results) == 1:
        summary = results[0].summary
        util = " ".join(f"{u:.2f}" for u in summary["stage_utilization"])
        print(f"mean compute utilization per stage: {util}")
        print(
            f"peers: {summary['mean_live_peers']:.0f} live, {summary['mean_serving_peers']:.0f} serving on average "
            f"(a live peer idles when it fits no stage or its link cannot carry the stage's averaging); "
            f"{summary['chunk_samples']} samples per simulated micro-batch"
        )
        kinds = results[0].summary["bytes_by_kind"]
        print("bytes moved: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in kinds.items()))
    if args.plot:
        from swarmtrain.sim.plotting import plot_results

        plot_results(results, args.plot, title=f"{fleet.description}; churn {churn_name}")
        print(f"plot: {args.plot}")
    write_summary_json(args.summary_json, _summary(results, wall_s, fleet, churn_name))
    if args.timeline_json:
        from swarmtrain.sim.timeline import timeline_document

        description = f"{args.mode} on {fleet.description}; churn {churn_name}"
        write_summary_json(
            args.timeline_json, timeline_document(frames, args.mode, args.duration_s, description)
        )
        print(
            f"timeline: {args.timeline_json} ({len(frames)} frames; view it with `swarmtrain monitor --replay`)"
        )
    return 0


def _check_timeline_mode(args: argparse.Namespace) -> None:
    from swarmtrain.sim.timeline import TIMELINE_MODES

    if args.timeline_json and args.mode not in TIMELINE_MODES:
        raise UserError(
            f"--timeline-json records one pipeline mode ({', '.join(TIMELINE_MODES)}); --mode {args.mode} "
            "has no stages to show"
        )


def _summary(results, wall_s: float, fleet, churn_name: str) -> dict:
    best = max(results, key=lambda r: r.summary["samples_per_s"])
    top = {**best.summary, "wall_s": wall_s, "fleet": fleet.description, "churn": churn_name}
    if len(results) > 1:
        top["best_mode"] = best.mode
        top["modes"] = {r.mode: r.summary for r in results}
    return top


def _choose_mode(args: argparse.Namespace, start: float) -> int:
    from swarmtrain.sim.base import SimConfig
    from swarmtrain.sim.mode_choice import choose_mode
    from swarmtrain.sim.report import format_table, human_bytes

    for flag, given in (
        ("--mode", args.mode),
        ("--timeline-json", args.timeline_json),
        ("--trace", args.trace),
        ("--save-trace", args.save_trace),
        ("--plot", args.plot),
    ):
        if given:
            raise UserError(
                f"--choose-mode simulates SWARM and async replicas itself, each for its own duration; drop {flag}"
                + (" (use --churn MODEL)" if flag == "--trace" else "")
            )
    if args.call_overhead_s or args.max_batch_samples:
        raise UserError(
            "--choose-mode compares SWARM with async replicas, whose local steps have no per-call cost; "
            "drop --call-overhead-s and --max-batch-samples"
        )
    run_cfg = _run_config(args)
    fleet = _fleet(args, run_cfg.swarm.num_stages)
    base = SimConfig(
        mode="swarm",
        duration_s=args.duration_s or CHOOSE_DURATION_S,
        seed=args.seed,
        chunk_samples=args.chunk_samples,
        in_flight=args.in_flight,
        num_trainers=args.trainers,
        rebalance_period_s=args.rebalance_period_s,
        event_budget=args.event_budget or CHOOSE_EVENT_BUDGET,
        compute_cv=args.compute_cv,
        latency_cv=args.latency_cv,
        local_batch_samples=args.local_batch_samples,
        stage_exchange=args.stage_exchange,
        num_samples=30,
    )
    h_values = args.h_values or DEFAULT_H_VALUES
    choice = choose_mode(fleet, run_cfg, base, h_values, args.global_batch_size, churn=args.churn)
    wall_s = time.perf_counter() - start
    print(f"fleet: {fleet.description}")
    print(
        f"model: {args.model}, {run_cfg.swarm.num_stages} stages | churn: {args.churn} | SWARM vs async replicas "
        f"at H = {','.join(map(str, sorted(set(h_values))))}, simulated in {wall_s:.1f} s wall"
    )
    rows = []
    for c in choice.candidates:
        chosen = c.mode == choice.recommended_mode and c.h == choice.recommended_h
        rows.append(
            [
                c.mode + (" *" if chosen else ""),
                "-" if c.h is None else c.h,
                _samples_per_s(c.samples_per_s),
                "-" if c.sync_bytes_per_sample is None else human_bytes(c.sync_bytes_per_sample),
                round(c.simulated_s),
                *(
                    [int(c.samples_lost), _samples_per_s(c.kept_samples_per_s)]
                    if args.churn != "none"
                    else []
                ),
            ]
        )
    headers = ["mode", "H", "samples/s", "sync bytes/sample", "simulated s"]
    print(format_table(headers + (["lost", "kept/s"] if args.churn != "none" else []), rows))
    if choice.recommended_mode == "swarm":
        print("recommended (*): SWARM")
    else:
        print(f"recommended (*): async full replicas, averaging every H={choice.recommended_h} local steps")
    print("why:")
    for reason in choice.reasons:
        print(f"  - {reason}")
    summary = {
        **choice.to_dict(),
        "fleet": fleet.description,
        "model": args.model,
        "churn": args.churn,
        "wall_s": wall_s,
    }
    write_summary_json(args.summary_json, summary)
    return 0


def _samples_per_s(value: float) -> float | int:
    return round(value) if value >= 100 else value  # 3,090 rather than 3.09e+03
