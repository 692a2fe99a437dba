"""Live adaptive rebalancing: does the swarm move a server to its bottleneck stage, and does throughput
rise as the simulator predicts?

Each server runs in its own cgroup limited to --cpus-per-server cores (runtime/harness/cpu_quota.py: servers
behave like separate equal machines instead of sharing 2 cores). By default the model has 8 blocks, stage 1
holds 7 of them, and 4 servers on stage 0 with 1 on stage 1 make stage 1 the bottleneck by the servers'
own capacity figures (with `tiny`'s 4 blocks cut 1,3, at 0.25 CPU a stage-0 server, two calls per
micro-batch, costs about as much per sample as a stage-1 one, and 4+1 was balanced: nobody moved). The
global batch is 128 samples (16 micro-batches, 16 in flight): a step's gradient exchange between a
stage's replicas is per step, and with 4 micro-batches per step it ate what a second stage-1 replica
adds. Two runs, one swarm at a time:

- `imbalanced`: N+1 servers (`--stage0-servers N`, default 4) with `--rebalance-period-s P`; the
  trainer's throughput is measured while N+1 (after warm-up, before the move) and after the moved
  server serves stage 1 (N-1+2);
- `auto`: N+1 servers started one after another with `--stage auto` (no rebalancing).

The prediction: the simulator (mode swarm-no-rebalance, the same code as `swarmtrain simulate`) on a
fleet of pinned peers with each stage's measured seconds per sample at the quota (the CPU time of the
server's whole cgroup per forwarded sample, divided by its cores, from the stage's busiest server over
both runs: the imbalanced run's servers that did not move, before the move, and the auto run's) and the measured per-call overhead as link latency (as
experiments/calibrate_demo.py does), for N+1 and for N-1+2. Needs root for the cgroups (it says so and exits 2 otherwise).

    python bench/rebalance_live.py [--cpus-per-server 0.25] [--rebalance-period-s 10] [--summary-json P]
                                   [--layers-per-stage 1,7] [--global-batch-size 128] [--keep-logs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from swarmtrain.config import load_run_config
from swarmtrain.runtime.harness.cpu_quota import CpuQuota, CpuQuotaError
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, write_run_toml
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.server.capacity import MIN_WORK_SHARE
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

METRICS = re.compile(r"metrics stage=(\d+) .*?samples_forward=(\d+) busy_s=([\d.]+)")
LOOPBACK_BYTES_PER_S = 10e9 / 8
WARMUP_S = 8.0
IDLE_WINDOW_S = 6.0  # servers ready, no trainer yet: their idle CPU baseline
MOVED = "rebalancing: moved here "
STAGE0_NAMES = "abcdefg"


def window_samples_per_s(ledger: Path, start_t: float, end_t: float) -> float:
    """The trainer's completed samples per second between two wall-clock times."""
    done = [e for e in read_ledger(ledger) if e["e"] == "done" and start_t <= e["t"] <= end_t]
    if len(done) < 3:
        return float("nan")
    return sum(e["n"] for e in done[1:]) / (done[-1]["t"] - done[0]["t"])


def cpu_snapshot(swarm: LocalSwarm, names: list[str]) -> dict[str, tuple[float, int, float]]:
    """Per server: (CPU seconds of its whole cgroup, samples it has forwarded per its last metrics line,
    wall clock)."""
    out = {}
    for name in names:
        points = METRICS.findall(swarm.processes[name].log_text())
        out[name] = (swarm.quotas[name].cpu_s(), int(points[-1][1]) if points else 0, time.monotonic())
    return out


def idle_cpu_per_s(first: dict, last: dict) -> dict[str, float]:
    """Each server's CPU seconds per second with no trainer (DHT upkeep, announcements, p2pd)."""
    return {name: (last[name][0] - c0) / max(last[name][2] - t0, 1e-9) for name, (c0, _, t0) in first.items()}


def server_costs(first: dict, last: dict, names: list[str], cpus: float, idle: dict) -> dict[str, float]:
    """What one sample costs each server at its quota: CPU seconds of work per sample of its whole
    process tree (compute, serialization, p2pd, DHT) over the cores its quota leaves beside its idle
    baseline. The compute thread's busy time alone left out the rest of the tree (the simulator then
    predicted twice the measured rate); the whole tree's CPU per sample, baseline included, made the
    lightly loaded servers of a well-served stage look 2-3x slower than they are."""
    costs = {}
    for name in names:
        (c0, n0, t0), (c1, n1, t1) = first[name], last[name]
        if n1 > n0:
            work_s = max(c1 - c0 - idle[name] * (t1 - t0), MIN_WORK_SHARE * (c1 - c0))
            costs[name] = work_s / (n1 - n0) / max(cpus - idle[name], 0.1 * cpus)
    return costs


def stage_costs(runs: list[tuple[dict[str, int], dict[str, float]]], num_stages: int) -> list[float]:
    """Each stage's seconds per sample: its busiest server's figure over both runs (a server with a
    quarter of its stage's traffic still pays the per-step work, closes and its replicas' exchange, so
    its cost per sample read 2.8x a lone server's: the simulator then predicted 25.8 samples/s for the
    `--stage auto` fleet that measured 73.1)."""
    best: list[float] = [float("inf")] * num_stages
    for stage_of, costs in runs:
        for name, cost in costs.items():
            best[stage_of[name]] = min(best[stage_of[name]], cost)
    return best


def predict(cfg, per_stage_s: list[float], counts: list[int], latency_s: float, in_flight: int) -> float:
    peers = []
    for stage, count in enumerate(counts):
        for i in range(count):
            times = tuple(per_stage_s[s] if s == stage else None for s in range(len(counts)))
            spec = PeerSpec.from_device(f"stage{stage}-{i}", DEVICE_TYPES["cpu"], 0)
            fields = {
                **spec.__dict__,
                "uplink_bytes_per_s": LOOPBACK_BYTES_PER_S,
                "downlink_bytes_per_s": LOOPBACK_BYTES_PER_S,
                "compute_s_per_sample": times,
                "stage": stage,
                "home_stage": stage,
            }
            peers.append(PeerSpec(**fields))
    # as the runtime does it: the trainer relays every boundary tensor, so a micro-batch makes
    # 2 (2S - 1) - 1 transfers for the 2S - 1 calls whose overhead was measured; steps are synchronous
    calls = 2 * len(counts) - 1
    per_transfer_s = latency_s * calls / (2 * calls - 1)
    fleet = Fleet(tuple(peers), single_location(latency_s=per_transfer_s), "local swarm (measured)")
    config = SimConfig(
        mode="swarm-no-rebalance",
        duration_s=300.0,
        chunk_samples=cfg.training.micro_batch_size,
        in_flight=in_flight,
        num_trainers=1,
        relay_via_trainer=True,
        trainer_link_bytes_per_s=LOOPBACK_BYTES_PER_S,
        max_staleness=cfg.training.max_staleness,
    )
    return run_simulation(fleet, cfg, config).summary["samples_per_s"]


def next_move_at(swarm: LocalSwarm, names: list[str], after_t: float) -> float | None:
    """Wall time of the first move decision after `after_t` among these servers (their ledgers)."""
    times = [
        e["t"]
        for name in names
        for e in read_ledger(swarm.ledger_path(name))
        if e["e"] == "move" and e["t"] > after_t
    ]
    return min(times, default=None)


def hop_latency_s(trainer_summary: dict) -> float:
    rpc = trainer_summary["rpc"]
    calls = sum(v["calls"] for v in rpc.values())
    return sum(v["calls"] * v["mean_overhead_s"] for v in rpc.values()) / calls


def run_imbalanced(args, config_path: Path, workdir: Path) -> dict:
    with LocalSwarm(workdir, config_path, cpus_per_server=args.cpus_per_server) as swarm:
        swarm.start_dht()
        stage0 = STAGE0_NAMES[: args.stage0_servers]
        servers = {**{name: 0 for name in stage0}, "z": 1}
        for name, stage in servers.items():
            swarm.start_server(
                name, stage, "--rebalance-period-s", str(args.rebalance_period_s), "--metrics-period-s", "1"
            )
        swarm.wait_ready(list(servers))
        quiet = cpu_snapshot(swarm, list(servers))
        time.sleep(IDLE_WINDOW_S)
        idle = idle_cpu_per_s(quiet, cpu_snapshot(swarm, list(servers)))
        trainer_args = ["--duration-s", str(args.duration_s), "--in-flight", str(args.in_flight)]
        swarm.start_trainer("trainer", *trainer_args, "--log-period-s", "2")
        started = time.time()
        deadline = time.monotonic() + args.duration_s
        time.sleep(WARMUP_S)
        first = last = cpu_snapshot(swarm, list(servers))
        mover, moved_at = None, None
        while time.monotonic() < deadline and moved_at is None:
            if not any("rebalancing: moving" in swarm.processes[n].log_text() for n in stage0):
                last = cpu_snapshot(swarm, list(servers))
            for name in stage0:
                text = swarm.processes[name].log_text()
                if MOVED in text:
                    mover, moved_at = name, time.time()
                    cost = json.loads(text.split(MOVED)[1].splitlines()[0])
            time.sleep(0.5)
        if moved_at is None:
            raise RuntimeError(f"no server moved within {args.duration_s:.0f} s")
        decided_at = moved_at - cost["seconds"]
        print(
            f"  {mover} moved to stage 1: {cost['seconds']:.1f} s, {cost['bytes'] / 1e6:.2f} MB downloaded",
            flush=True,
        )
        swarm.wait_exit("trainer", args.duration_s + 120)
        ledger = swarm.ledger_path("trainer")
        before = window_samples_per_s(ledger, started + WARMUP_S, decided_at)
        # until a second server decides to move (the policy may go on towards its balance): that
        # move's drain, download and replays are a transition, not the allocation after this move
        second = next_move_at(swarm, [n for n in stage0 if n != mover], decided_at)
        after_end = second if second is not None else time.time()
        after = window_samples_per_s(ledger, moved_at + WARMUP_S / 2, after_end)
        summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
        stayed = [n for n in stage0 if n != mover]
        cpus = args.cpus_per_server
        costs = server_costs(first, last, [*stayed, "z"], cpus, idle)
        return {
            "server_stage": {name: servers[name] for name in costs},
            "server_costs_s_per_sample": costs,
            "mover": mover,
            "move_cost": cost,
            "before_samples_per_s": before,
            "after_samples_per_s": after,
            "before_window_s": decided_at - started - WARMUP_S,
            "after_window_s": after_end - moved_at - WARMUP_S / 2,
            "second_move_decided_after_s": None if second is None else second - moved_at,
            "idle_cpu_per_s": idle,
            "hop_latency_s": hop_latency_s(summary),
            "in_flight": args.in_flight,
        }


def run_auto(args, config_path: Path, workdir: Path) -> dict:
    with LocalSwarm(workdir, config_path, cpus_per_server=args.cpus_per_server) as swarm:
        swarm.start_dht()
        names = STAGE0_NAMES[: args.stage0_servers + 1]
        for name in names:
            swarm.start_server(name, "auto", "--metrics-period-s", "1")
            swarm.wait_ready([name])
        stages = [int(re.search(r"serving stage (\d+)", swarm.processes[n].log_text())[1]) for n in names]
        quiet = cpu_snapshot(swarm, names)
        time.sleep(IDLE_WINDOW_S)
        idle = idle_cpu_per_s(quiet, cpu_snapshot(swarm, names))
        duration_s = args.duration_s / 2
        swarm.start_trainer("trainer", "--duration-s", str(duration_s), "--in-flight", str(args.in_flight))
        started = time.time()
        time.sleep(WARMUP_S)
        first = cpu_snapshot(swarm, names)
        swarm.wait_exit("trainer", duration_s + 120)
        last = cpu_snapshot(swarm, names)
        rate = window_samples_per_s(swarm.ledger_path("trainer"), started + WARMUP_S, time.time())
        costs = server_costs(first, last, names, args.cpus_per_server, idle)
        return {
            "stages": stages,
            "samples_per_s": rate,
            "server_stage": {name: stage for name, stage in zip(names, stages, strict=True) if name in costs},
            "server_costs_s_per_sample": costs,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--cpus-per-server", type=float, default=0.25)
    parser.add_argument("--rebalance-period-s", type=float, default=10.0)
    parser.add_argument("--duration-s", type=float, default=90.0, help="the imbalanced run's training time")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument(
        "--stage0-servers",
        type=int,
        default=4,
        choices=range(2, len(STAGE0_NAMES) + 1),
        metavar="N",
        help="servers started on stage 0 (stage 1 gets one): N+1 -> N-1+2 after the move (default 4)",
    )
    parser.add_argument(
        "--layers-per-stage",
        default="1,7",
        metavar="A,B",
        help="layers of stage 0 and stage 1 (the model gets A+B layers; default 1,7)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=128,
        metavar="N",
        help="samples per optimizer step (default 128; tiny's own is 32 = 4 micro-batches). A step's "
        "gradient exchange between a stage's replicas is per step, so a larger batch amortizes it",
    )
    parser.add_argument("--summary-json", metavar="PATH")
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="keep both runs' peer logs and ledgers in DIR (default: deleted)"
    )
    args = parser.parse_args()
    try:
        CpuQuota("probe", 1.0).remove()
    except CpuQuotaError as exc:
        print(f"rebalance_live: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            tmp = args.keep_logs
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rebalance-live-"))
        # stage 1 holds most layers (default 3 of tiny's 4): the heavier stage, made the bottleneck by
        # N+1 servers
        layers = [int(x) for x in args.layers_per_stage.split(",")]
        training = {"max_samples": 10**7}
        if args.global_batch_size:
            training["global_batch_size"] = args.global_batch_size
        overrides = {
            "training": training,
            "model": {"num_layers": sum(layers)},
            "swarm": {"layers_per_stage": layers},
        }
        config_path = write_run_toml(Path(tmp) / "run.toml", args.preset, overrides)
        cfg = load_run_config(config_path)
        print(
            f"imbalanced swarm ({args.stage0_servers}+1, {args.cpus_per_server} CPU per server, "
            f"rebalancing every {args.rebalance_period_s} s) ...",
            flush=True,
        )
        imbalanced = run_imbalanced(args, config_path, Path(tmp) / "imbalanced")
        print("--stage auto for every server from the start ...", flush=True)
        auto = run_auto(args, config_path, Path(tmp) / "auto")
    latency = imbalanced["hop_latency_s"]
    compute = stage_costs(
        [(run["server_stage"], run["server_costs_s_per_sample"]) for run in (imbalanced, auto)],
        cfg.swarm.num_stages,
    )
    n = args.stage0_servers
    sim_before = predict(cfg, compute, [n, 1], latency, args.in_flight)
    sim_after = predict(cfg, compute, [n - 1, 2], latency, args.in_flight)
    auto_counts = [auto["stages"].count(stage) for stage in range(cfg.swarm.num_stages)]
    sim_auto = predict(cfg, compute, auto_counts, latency, args.in_flight)
    rows = [
        [f"{n}+1 (before the move)", imbalanced["before_samples_per_s"], sim_before],
        [f"{n - 1}+2 (after the move)", imbalanced["after_samples_per_s"], sim_after],
        [f"--stage auto {auto['stages']}", auto["samples_per_s"], sim_auto],
    ]
    table = [[label, f"{m:.1f}", f"{p:.1f}", f"{100 * (m / p - 1):+.1f}%"] for label, m, p in rows]
    print(format_table(["swarm", "measured samples/s", "simulator samples/s", "measured vs sim"], table))
    gain = imbalanced["after_samples_per_s"] / imbalanced["before_samples_per_s"]
    print(
        f"after / before: {gain:.2f} (simulator {sim_after / sim_before:.2f}); compute ms/sample per stage "
        f"{[round(1e3 * c, 2) for c in compute]}, per-call overhead {1e3 * latency:.1f} ms; idle CPU baseline "
        f"{sum(imbalanced['idle_cpu_per_s'].values()) / len(imbalanced['idle_cpu_per_s']):.3f} CPU s/s per server; move: "
        f"{imbalanced['move_cost']}; windows: before {imbalanced['before_window_s']:.0f} s, after "
        f"{imbalanced['after_window_s']:.0f} s"
        + (
            f" (up to a second server's move decision, {imbalanced['second_move_decided_after_s']:.0f} s "
            "after the first had moved)"
            if imbalanced["second_move_decided_after_s"] is not None
            else ""
        )
    )
    if args.summary_json:
        report = {
            "imbalanced": imbalanced,
            "auto": auto,
            "sim_before": sim_before,
            "sim_after": sim_after,
            "sim_auto": sim_auto,
            "compute_s_per_sample": compute,
        }
        Path(args.summary_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
