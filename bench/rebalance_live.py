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
  trainer's throughput is measured while N+1 (after warm-up, before the first move decision) and once
  the swarm is rebalanced (from the last mover serving its new stage to the end of the run); the time to
  balance is from the first decision to the last mover serving;
- `auto`: N+1 servers started one after another with `--stage auto` (no rebalancing).

With `--plain` the servers get no rebalancing flag, as the README starts them (the default period,
60 s): the imbalanced fleet must be balanced within three periods of its servers being ready, and the
`auto` fleet, balanced from the start, rebalances too and must make no move (issue 40).

With `--fleet link` (issue 40) the imbalance is a link's, not compute's: on the WAN test bed (every
peer in a network namespace of its own; needs root) 2+2 servers of a model cut evenly (2,2), stage 1's
two behind `--link-mbit-s` each way and stage 0's unlimited, activations uncompressed by default (so
they, not the gradient exchange, fill the slow links). By compute the fleet is balanced; by the
servers' link figures (runtime/server/capacity.py) stage 1 is the bottleneck, and a stage-0 server must
move there. The prediction is the simulator's for the same peers and links, hand-offs direct (server
to server, as the trainer's default), with the CPU costs fitted as below from this run alone. A slow
link enters it as the TCP payload its rate carries (`netbed.tcp_payload_bytes_per_s`: the rate counts
frames) less the bytes the control plane (DHT records, announcements, lease polls: small packets,
counted with their headers) sent on it while the servers idled before training
(`WanTestbed.link_bytes`; the simulator models no control plane);
the table also gives the prediction without that last part.

The prediction: the simulator (mode swarm-no-rebalance, the same code as `swarmtrain simulate`) on a
fleet of pinned peers with each stage's measured seconds per sample at the quota and the measured
per-call overhead as link latency (as experiments/calibrate_demo.py does), for N+1 and for the
allocation rebalancing reached. A stage's cost is a per-sample part (the CPU its servers measure for
their samples' own compute and transport, runtime/server/capacity.py) plus a per-step part every
replica pays (fitted to the rest of their cgroups' CPU, idle baseline left out), over the stage's
servers in both runs (the imbalanced run's servers before and after the moves, and the auto run's). Needs root for the cgroups (it says so and exits 2 otherwise).

    python bench/rebalance_live.py [--cpus-per-server 0.25] [--rebalance-period-s 10] [--summary-json P]
                                   [--layers-per-stage 1,7] [--global-batch-size 128] [--keep-logs DIR]
                                   [--plain --duration-s 300 --auto-duration-s 600]
                                   [--fleet link --link-mbit-s 2 --link-compression none
                                    --exchange-compression 8bit]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from swarmtrain.config import load_run_config
from swarmtrain.config.run import EXCHANGE_COMPRESSION_CHOICES
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.cpu_quota import CpuQuota, CpuQuotaError
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, write_run_toml
from swarmtrain.runtime.harness.netbed import WanTestbed
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

LOOPBACK_BYTES_PER_S = 10e9 / 8
WARMUP_S = 8.0
IDLE_WINDOW_S = 10.0  # servers ready, no trainer yet: their idle CPU and (on the bed) link baseline
STAGE0_NAMES = "abcdefg"
MIN_WORK_SHARE = 0.3  # never count less than this share of a window's CPU as work (a baseline read high)


def window_samples_per_s(ledger: Path, start_t: float, end_t: float) -> float:
    """The trainer's completed samples per second between two wall-clock times."""
    done = [e for e in read_ledger(ledger) if e["e"] == "done" and start_t <= e["t"] <= end_t]
    if len(done) < 3:
        return float("nan")
    return sum(e["n"] for e in done[1:]) / (done[-1]["t"] - done[0]["t"])


def cpu_snapshot(swarm: LocalSwarm, names: list[str]) -> dict[str, tuple[float, int, int, float, float]]:
    """Per server: (CPU seconds of its whole cgroup, samples it has forwarded and the step it is at per
    its last metrics line, wall clock, CPU seconds of the work that came with those samples as the server
    measures it: compute-thread and transport thread time, runtime/server/capacity.py)."""
    out = {}
    for name in names:
        points = metrics_from_log(swarm.processes[name].log_text())
        last = points[-1] if points else None
        samples, step, work = (last.samples_forward, last.step, last.work_s) if last else (0, 0, 0.0)
        out[name] = (swarm.quotas[name].cpu_s(), samples, step, time.monotonic(), work)
    return out


def idle_cpu_per_s(first: dict, last: dict) -> dict[str, float]:
    """Each server's CPU seconds per second with no trainer (DHT upkeep, announcements, p2pd)."""
    return {
        name: (last[name][0] - c0) / max(last[name][3] - t0, 1e-9)
        for name, (c0, _, _, t0, _) in first.items()
    }


def at(snapshots: list, t: float) -> dict:
    """The first snapshot taken at or after unix time t (the last one if none)."""
    return next((snap for when, snap in snapshots if when >= t), snapshots[-1][1])


def before_t(snapshots: list, t: float) -> dict:
    """The last snapshot taken at or before unix time t (the first one if none)."""
    return next((snap for when, snap in reversed(snapshots) if when <= t), snapshots[0][1])


def server_work(first: dict, last: dict, idle: dict) -> dict[str, tuple[float, int, int, float]]:
    """Per server between two snapshots: (CPU seconds of work of its whole process tree, its idle
    baseline left out; samples forwarded; steps taken; CPU seconds of the samples' own work as the server
    measured it). A server that moved in between has counters of its new stage at the end: left out."""
    work = {}
    for name in first:
        (c0, n0, k0, t0, w0), (c1, n1, k1, t1, w1) = first[name], last[name]
        if n1 > n0 and k1 >= k0 and w1 >= w0:
            tree_s = max(c1 - c0 - idle[name] * (t1 - t0), MIN_WORK_SHARE * (c1 - c0))
            work[name] = (tree_s, n1 - n0, k1 - k0, w1 - w0)
    return work


def fit_stage_costs(runs: list[tuple[dict[str, int], dict]], num_stages: int) -> list[tuple[float, float]]:
    """Each stage's (CPU s per sample, CPU s per step) over its servers in both runs. Every replica
    applies every step (optimizer, gradient exchange) whatever its share of the samples, so a replica's
    cost per sample is a + b * replicas / global batch: taking the busiest server's figure as the stage's
    let the simulator predict 94 samples/s for 4 stage-1 replicas that did 71. `a` is what the servers
    measure exactly (the samples' own compute and transport thread time); `b` is fitted to the rest of
    their CPU, work - a * samples = b * steps. Fitting both to the CPU (steps come at a steady rate, so
    the two columns are nearly collinear) put stage 1's `a` at 1.9 ms where its compute alone takes
    3.7-4.2 ms, and `b` between 26 and 154 ms from one run to the next."""
    fits = []
    for stage in range(num_stages):
        rows = [work[name] for stage_of, work in runs for name in work if stage_of[name] == stage]
        a = sum(own for _, _, _, own in rows) / sum(n for _, n, _, _ in rows)
        rest = np.array([cpu - a * n for cpu, n, _, _ in rows])
        steps = np.array([k for _, _, k, _ in rows], dtype=float)
        b = max(0.0, float(rest @ steps / (steps @ steps))) if steps.any() else 0.0
        fits.append((a, b))
    return fits


def stage_seconds(fits, counts: list[int], batch: int, cpus: float, idle_cpu_per_s: float) -> list[float]:
    """Each stage's seconds per sample at the quota for an allocation (traffic split evenly)."""
    cores = max(cpus - idle_cpu_per_s, 0.1 * cpus)
    return [(a + b * max(n, 1) / batch) / cores for (a, b), n in zip(fits, counts, strict=True)]


def predict(cfg, per_stage_s: list[float], counts: list[int], latency_s: float, in_flight: int) -> float:
    """The simulator's samples/s for `counts` servers per stage, every link as fast as loopback."""
    peers = [(stage, LOOPBACK_BYTES_PER_S) for stage, count in enumerate(counts) for _ in range(count)]
    return predict_peers(cfg, per_stage_s, peers, latency_s, in_flight, relay=True)


def predict_peers(
    cfg,
    per_stage_s: list[float],
    peers: list[tuple[int, float]],
    latency_s: float,
    in_flight: int,
    relay: bool,
) -> float:
    """The simulator's samples/s for pinned peers given as (stage, link bytes/s each way). `relay`: the
    trainer relays every boundary tensor (the cpu fleet's model of its measured per-call overhead);
    else hand-offs go server to server, as the trainer's default `--hand-off direct` does."""
    specs = []
    num_stages = len(per_stage_s)
    for i, (stage, link_bytes_per_s) in enumerate(peers):
        times = tuple(per_stage_s[s] if s == stage else None for s in range(num_stages))
        spec = PeerSpec.from_device(f"stage{stage}-{i}", DEVICE_TYPES["cpu"], 0)
        fields = {
            **spec.__dict__,
            "uplink_bytes_per_s": link_bytes_per_s,
            "downlink_bytes_per_s": link_bytes_per_s,
            "compute_s_per_sample": times,
            "stage": stage,
            "home_stage": stage,
        }
        specs.append(PeerSpec(**fields))
    per_transfer_s = latency_s
    if relay:  # a micro-batch makes 2 (2S - 1) - 1 transfers for the 2S - 1 calls whose overhead was measured
        calls = 2 * num_stages - 1
        per_transfer_s = latency_s * calls / (2 * calls - 1)
    fleet = Fleet(tuple(specs), single_location(latency_s=per_transfer_s), "local swarm (measured)")
    config = SimConfig(
        mode="swarm-no-rebalance",
        duration_s=300.0,
        chunk_samples=cfg.training.micro_batch_size,
        in_flight=in_flight,
        num_trainers=1,
        relay_via_trainer=relay,
        trainer_link_bytes_per_s=LOOPBACK_BYTES_PER_S,
        max_staleness=cfg.training.max_staleness,
        stage_exchange="all-to-all",  # as the servers exchange their sums (swarm.exchange_compression)
    )
    return run_simulation(fleet, cfg, config).summary["samples_per_s"]


def move_events(swarm: LocalSwarm, names: list[str], kind: str) -> dict[str, float]:
    """Per server, the wall time of its first `move` (decided) or `moved` (serving its new stage) entry."""
    times = {}
    for name in names:
        found = [e["t"] for e in read_ledger(swarm.ledger_path(name)) if e["e"] == kind]
        if found:
            times[name] = min(found)
    return times


def hop_latency_s(trainer_summary: dict) -> float:
    rpc = trainer_summary["rpc"]
    calls = sum(v["calls"] for v in rpc.values())
    return sum(v["calls"] * v["mean_overhead_s"] for v in rpc.values()) / calls


def run_imbalanced(args, config_path: Path, workdir: Path, servers: dict[str, int], bed=None) -> dict:
    """`servers`: name -> the stage it starts on; with a WAN test bed `bed`, each peer in a namespace of
    its own (the DHT first, then the servers in order, the trainer last: `link_fleet`)."""
    slots = {name: i for i, name in enumerate(["dht", *servers, "trainer"])} if bed is not None else None
    with LocalSwarm(
        workdir, config_path, cpus_per_server=args.cpus_per_server, netbed=bed, netbed_peers=slots
    ) as swarm:
        swarm.start_dht()
        stage0 = [name for name, stage in servers.items() if stage == 0]
        for name, stage in servers.items():
            swarm.start_server(name, stage, *period_args(args), "--metrics-period-s", "1")
        swarm.wait_ready(list(servers))
        ready_at = time.time()
        quiet, quiet_links = cpu_snapshot(swarm, list(servers)), link_snapshot(bed, slots)
        time.sleep(IDLE_WINDOW_S)
        idle = idle_cpu_per_s(quiet, cpu_snapshot(swarm, list(servers)))
        idle_links = idle_link_bytes_per_s(quiet_links, link_snapshot(bed, slots))
        trainer_args = ["--duration-s", str(args.duration_s), "--in-flight", str(args.in_flight)]
        swarm.start_trainer("trainer", *trainer_args, "--log-period-s", "2")
        started = time.time()
        deadline = time.monotonic() + args.duration_s
        snapshots = []  # (unix time, cpu_snapshot): the cost windows are chosen once the moves are known
        while swarm.processes["trainer"].alive and time.monotonic() < deadline + 120:
            snapshots.append((time.time(), cpu_snapshot(swarm, list(servers))))
            time.sleep(1.0)
        swarm.wait_exit("trainer", 120)
        # every server may move (a stage-1 server moving back is a move a balanced fleet must not make:
        # the windows, the final allocation and the prediction follow all of them)
        moves = ledger_moves(swarm, list(servers))
        made = [(name, e) for name, events in moves.items() for e in events if e["e"] == "moved"]
        if not any(name in stage0 and e["to"] == 1 for name, e in made):
            raise RuntimeError(f"no stage-0 server moved to stage 1 within {args.duration_s:.0f} s: {moves=}")
        costs_of_moves = {name: e for name, e in sorted(made, key=lambda item: item[1]["t"])}  # the last
        undone = [name for name, events in moves.items() if events[-1]["e"] == "move"]
        for name, e in sorted(made, key=lambda item: item[1]["t"]):
            print(
                f"  {name} decided {e['decided_t'] - started:.1f} s after traffic began and served stage "
                f"{e['to']} {e['seconds']:.1f} s later ({e['bytes'] / 1e6:.2f} MB downloaded)",
                flush=True,
            )
        for name in undone:
            print(f"  {name} decided a move to stage {moves[name][-1]['to']} that the run's end cut short")
        ledger = swarm.ledger_path("trainer")
        first_decision = min(e["decided_t"] for _, e in made)
        balanced_at = max(e["t"] for _, e in made)
        before = window_samples_per_s(ledger, started + WARMUP_S, first_decision)
        after = window_samples_per_s(ledger, balanced_at + WARMUP_S / 2, time.time())
        summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
        final = {**servers, **{n: c["to"] for n, c in costs_of_moves.items()}}
        last_done = max(e["t"] for e in read_ledger(ledger) if e["e"] == "done")
        windows = [  # every server's work while 4+1 and once rebalanced (its share differs: see the fit)
            (
                servers,
                server_work(at(snapshots, started + WARMUP_S), before_t(snapshots, first_decision), idle),
            ),
            (
                final,
                server_work(at(snapshots, balanced_at + WARMUP_S / 2), before_t(snapshots, last_done), idle),
            ),
        ]
        return {
            "windows": [{"stage_of": stage_of, "work_s_samples_steps": work} for stage_of, work in windows],
            "moves": costs_of_moves,
            "move_list": [
                (name, e["from"], e["to"]) for name, e in sorted(made, key=lambda item: item[1]["t"])
            ],
            "undone_moves": undone,
            "stages_after": sorted(final.values()),
            "first_decision_after_traffic_s": first_decision - started,
            "decision_spread_s": max(e["decided_t"] for _, e in made) - first_decision,
            "time_to_balance_s": balanced_at - first_decision,
            "balanced_after_ready_s": balanced_at - ready_at,
            "longest_move_s": max(e["seconds"] for _, e in made),
            "before_samples_per_s": before,
            "after_samples_per_s": after,
            "before_window_s": first_decision - started - WARMUP_S,
            "after_window_s": time.time() - balanced_at - WARMUP_S / 2,
            "idle_cpu_per_s": idle,
            "idle_link_bytes_per_s": idle_links,
            "hop_latency_s": hop_latency_s(summary),
            "in_flight": args.in_flight,
        }


def link_snapshot(bed, slots: dict[str, int] | None) -> dict[str, tuple[float, int, int]]:
    """Per server on the test bed: (time, frame bytes uploaded, downloaded) so far; none off the bed."""
    if bed is None or slots is None:
        return {}
    return {name: (time.monotonic(), *bed.link_bytes(i)) for name, i in slots.items()}


def idle_link_bytes_per_s(first: dict, last: dict) -> dict[str, float]:
    """Per server, the busier direction's frame bytes per second between two snapshots: with no
    trainer yet, what the control plane (DHT records, announcements, pings) takes of its link."""
    out = {}
    for name, (t0, up0, down0) in first.items():
        t1, up1, down1 = last[name]
        out[name] = max(up1 - up0, down1 - down0) / max(t1 - t0, 1e-9)
    return out


def ledger_moves(swarm: LocalSwarm, names: list[str]) -> dict[str, list[dict]]:
    """Per server that decided any, its `move` (decided) and `moved` (serving the new stage: from, to,
    seconds, bytes) ledger entries in order; each `moved` also carries the time of its decision."""
    out = {}
    for name in names:
        events = [e for e in read_ledger(swarm.ledger_path(name)) if e["e"] in ("move", "moved")]
        decided_t = None
        for e in events:
            if e["e"] == "move":
                decided_t = e["t"]
            else:
                e["decided_t"] = decided_t if decided_t is not None else e["t"]
        if events:
            out[name] = events
    return out


def period_args(args) -> list[str]:
    """The servers' rebalancing flag: none with --plain (the run file's default period, as the README
    starts servers)."""
    return [] if args.plain else ["--rebalance-period-s", str(args.rebalance_period_s)]


def run_auto(args, config_path: Path, workdir: Path) -> dict:
    """N+1 servers placed by --stage auto: without --plain they never move (the fleet the simulator
    predicts); with it they rebalance at the default period, and a move is what a balanced fleet must
    not make."""
    with LocalSwarm(workdir, config_path, cpus_per_server=args.cpus_per_server) as swarm:
        swarm.start_dht()
        names = STAGE0_NAMES[: args.stage0_servers + 1]
        pinned = [] if args.plain else ["--rebalance-period-s", "0"]
        for name in names:
            swarm.start_server(name, "auto", *pinned, "--metrics-period-s", "1")
            swarm.wait_ready([name])
        stages = [swarm.ledger_events(n, "stage_choice")[0]["stage"] for n in names]
        quiet = cpu_snapshot(swarm, names)
        time.sleep(IDLE_WINDOW_S)
        idle = idle_cpu_per_s(quiet, cpu_snapshot(swarm, names))
        duration_s = args.auto_duration_s or args.duration_s / 2
        swarm.start_trainer("trainer", "--duration-s", str(duration_s), "--in-flight", str(args.in_flight))
        started = time.time()
        time.sleep(WARMUP_S)
        first = cpu_snapshot(swarm, names)
        swarm.wait_exit("trainer", duration_s + 120)
        last = cpu_snapshot(swarm, names)
        rate = window_samples_per_s(swarm.ledger_path("trainer"), started + WARMUP_S, time.time())
        work = server_work(first, last, idle)
        return {
            "stages": stages,
            "moves": sorted(move_events(swarm, names, "move")),
            "duration_s": duration_s,
            "samples_per_s": rate,
            "windows": [{"stage_of": dict(zip(names, stages, strict=True)), "work_s_samples_steps": work}],
            "idle_cpu_per_s": idle,
        }


def link_fleet(args, cfg, config_path: Path, tmp: Path) -> int:
    """`--fleet link`: 2+2 servers, stage 1's behind a slow link, on the WAN test bed; the balancer must
    move a stage-0 server to stage 1 by the servers' link figures (runtime/server/capacity.py)."""
    servers = {"a": 0, "b": 0, "y": 1, "z": 1}
    slow = {"y", "z"}
    rate = args.link_mbit_s
    limits = [rate if name in slow else None for name in ["dht", *servers, "trainer"]]
    print(
        f"link-limited swarm on the WAN test bed (2+2, stage 1's servers at {rate:g} Mbit/s each way, "
        f"{args.cpus_per_server} CPU per server, activations {args.link_compression}, gradient exchange "
        f"{args.exchange_compression}, rebalancing every "
        f"{'60 (the default)' if args.plain else args.rebalance_period_s} s) ...",
        flush=True,
    )
    with WanTestbed(len(limits), up_mbit_s=limits, down_mbit_s=limits) as bed:
        run = run_imbalanced(args, config_path, tmp / "link", servers, bed)
    fits = fit_stage_costs(
        [(w["stage_of"], w["work_s_samples_steps"]) for w in run["windows"]], cfg.swarm.num_stages
    )
    mean_idle = sum(run["idle_cpu_per_s"].values()) / len(run["idle_cpu_per_s"])
    final = {**servers, **{n: c["to"] for n, c in run["moves"].items()}}
    control = run["idle_link_bytes_per_s"]

    def predicted(stage_of: dict[str, int], less_control: bool) -> float:
        """The simulator's links carry payload; the bed's limit counts frames (headers too) and, with
        `less_control`, what the control plane took of each slow link while the servers idled."""
        counts = [list(stage_of.values()).count(stage) for stage in range(cfg.swarm.num_stages)]
        seconds = stage_seconds(fits, counts, cfg.training.global_batch_size, args.cpus_per_server, mean_idle)
        links = {
            name: netbed.tcp_payload_bytes_per_s(rate, control[name] if less_control else 0.0)
            if name in slow
            else LOOPBACK_BYTES_PER_S
            for name in servers
        }
        peers = [(stage, links[name]) for name, stage in stage_of.items()]
        return predict_peers(cfg, seconds, peers, 0.0, args.in_flight, relay=False)

    sim_before, sim_after = predicted(servers, True), predicted(final, True)
    bare_before, bare_after = predicted(servers, False), predicted(final, False)
    after_label = "+".join(str(list(final.values()).count(s)) for s in range(cfg.swarm.num_stages))
    rows = [
        ["2+2 (before rebalancing)", run["before_samples_per_s"], sim_before, bare_before],
        [f"{after_label} (rebalanced)", run["after_samples_per_s"], sim_after, bare_after],
    ]
    table = [
        [label, f"{m:.1f}", f"{p:.1f}", f"{100 * (m / p - 1):+.1f}%", f"{b:.1f}"] for label, m, p, b in rows
    ]
    headers = ["swarm", "measured samples/s", "simulator samples/s", "measured vs sim", "sim, no control"]
    print(format_table(headers, table))
    gain, sim_gain = run["after_samples_per_s"] / run["before_samples_per_s"], sim_after / sim_before
    moved = ", ".join(f"{name} {src} -> {dst}" for name, src, dst in run["move_list"])
    if run["undone_moves"]:
        moved += f" (decided, cut short by the end: {', '.join(run['undone_moves'])})"
    print(
        f"after / before: {gain:.2f} (simulator {sim_gain:.2f}, {100 * (gain / sim_gain - 1):+.1f}%; with "
        f"the links' whole payload {bare_after / bare_before:.2f}); moved: {moved}; balanced "
        f"{run['balanced_after_ready_s']:.0f} s after the servers were ready"
    )
    idle_kb = ", ".join(f"{name} {control[name] / 1e3:.1f}" for name in sorted(slow))
    print(
        f"CPU ms per sample, per step by stage {[(round(1e3 * a, 2), round(1e3 * b, 1)) for a, b in fits]}; "
        f"idle CPU baseline {mean_idle:.3f} CPU s/s per server; control plane on the slow links "
        f"(idle, kB/s with headers) {idle_kb}; windows: before "
        f"{run['before_window_s']:.0f} s, after {run['after_window_s']:.0f} s"
    )
    if args.summary_json:
        report = {
            "link": run,
            "sim_before": sim_before,
            "sim_after": sim_after,
            "sim_before_no_control": bare_before,
            "sim_after_no_control": bare_after,
            "fits": fits,
        }
        Path(args.summary_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--cpus-per-server", type=float, default=0.25)
    parser.add_argument(
        "--rebalance-period-s", type=float, default=10.0, help="the servers' period (default 10)"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="start the servers with no rebalancing flag, as the README does (the default period, 60 s): "
        "the imbalanced fleet must balance within three periods of the servers being ready, and the "
        "--stage auto fleet (balanced) must make no move; give --duration-s 300 or more",
    )
    parser.add_argument(
        "--auto-duration-s",
        type=float,
        metavar="S",
        help="the --stage auto run's training time (default: half of --duration-s)",
    )
    parser.add_argument(
        "--duration-s", type=float, default=150.0, help="the imbalanced run's training time (default 150)"
    )
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
        metavar="A,B",
        help="layers of stage 0 and stage 1 (the model gets A+B layers; default 1,7, and 2,2 with "
        "--fleet link)",
    )
    parser.add_argument(
        "--fleet",
        choices=("cpu", "link"),
        default="cpu",
        help="cpu (default): N+1 servers, stage 1 the bottleneck by its compute; link: on the WAN test "
        "bed (needs root), 2 servers on each stage, stage 1's behind --link-mbit-s each way and stage 0's "
        "unlimited, compute balanced (layers 2,2): stage 1 is the bottleneck by its links alone",
    )
    parser.add_argument(
        "--link-mbit-s",
        type=float,
        default=2.0,
        metavar="R",
        help="--fleet link: the stage-1 servers' rate limit each way (default 2)",
    )
    parser.add_argument(
        "--link-compression",
        default="none",
        help="--fleet link: the activations' codec (default none: fp32, so the activations, not the "
        "gradient exchange, fill the slow links)",
    )
    parser.add_argument(
        "--exchange-compression",
        default="8bit",
        choices=EXCHANGE_COMPRESSION_CHOICES,
        help="--fleet link: the codec of the gradient sums a stage's replicas exchange each step (default "
        "8bit, as a user behind a slow link would set: fp32 sums took ~2 s per step at 4 Mbit/s)",
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

    def on_sigterm(signum, frame):  # stop the swarms as on Ctrl-C (a kill left the servers running)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        CpuQuota("probe", 1.0).remove()
    except CpuQuotaError as exc:
        print(f"rebalance_live: {exc}", file=sys.stderr)
        return 2
    if args.fleet == "link":
        ok, why = netbed.available()
        if not ok:
            print(f"rebalance_live: --fleet link needs the WAN test bed: {why}", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            tmp = args.keep_logs
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rebalance-live-"))
        # stage 1 holds most layers (default 3 of tiny's 4): the heavier stage, made the bottleneck by
        # N+1 servers
        layers_text = args.layers_per_stage or ("2,2" if args.fleet == "link" else "1,7")
        layers = [int(x) for x in layers_text.split(",")]
        training = {"max_samples": 10**7}
        if args.global_batch_size:
            training["global_batch_size"] = args.global_batch_size
        swarm = {"layers_per_stage": layers}
        if args.fleet == "link":
            swarm["compression"] = args.link_compression
            swarm["exchange_compression"] = args.exchange_compression
        overrides = {"training": training, "model": {"num_layers": sum(layers)}, "swarm": swarm}
        config_path = write_run_toml(Path(tmp) / "run.toml", args.preset, overrides)
        cfg = load_run_config(config_path)
        if args.fleet == "link":
            return link_fleet(args, cfg, config_path, Path(tmp))
        print(
            f"imbalanced swarm ({args.stage0_servers}+1, {args.cpus_per_server} CPU per server, "
            f"rebalancing every {'60 (the default)' if args.plain else args.rebalance_period_s} s) ...",
            flush=True,
        )
        servers = {**{name: 0 for name in STAGE0_NAMES[: args.stage0_servers]}, "z": 1}
        imbalanced = run_imbalanced(args, config_path, Path(tmp) / "imbalanced", servers)
        print("--stage auto for every server from the start ...", flush=True)
        auto = run_auto(args, config_path, Path(tmp) / "auto")
    latency = imbalanced["hop_latency_s"]
    fits = fit_stage_costs(
        [(w["stage_of"], w["work_s_samples_steps"]) for run in (imbalanced, auto) for w in run["windows"]],
        cfg.swarm.num_stages,
    )
    idle_values = [*imbalanced["idle_cpu_per_s"].values(), *auto["idle_cpu_per_s"].values()]
    mean_idle = sum(idle_values) / len(idle_values)

    def predicted(counts: list[int]) -> float:
        seconds = stage_seconds(fits, counts, cfg.training.global_batch_size, args.cpus_per_server, mean_idle)
        return predict(cfg, seconds, counts, latency, args.in_flight)

    n = args.stage0_servers
    num_stages = cfg.swarm.num_stages
    after_counts = [imbalanced["stages_after"].count(stage) for stage in range(num_stages)]
    auto_counts = [auto["stages"].count(stage) for stage in range(num_stages)]
    sim_before, sim_after, sim_auto = (predicted(c) for c in ([n, 1], after_counts, auto_counts))
    rows = [
        [f"{n}+1 (before rebalancing)", imbalanced["before_samples_per_s"], sim_before],
        [f"{'+'.join(map(str, after_counts))} (rebalanced)", imbalanced["after_samples_per_s"], sim_after],
        [f"--stage auto {'+'.join(map(str, auto_counts))}", auto["samples_per_s"], sim_auto],
    ]
    if imbalanced["after_window_s"] < 10:
        print(
            f"the last move ended {imbalanced['after_window_s']:.0f} s before the run: rerun with a longer --duration-s"
        )
    table = [[label, f"{m:.1f}", f"{p:.1f}", f"{100 * (m / p - 1):+.1f}%"] for label, m, p in rows]
    print(format_table(["swarm", "measured samples/s", "simulator samples/s", "measured vs sim"], table))
    gain = imbalanced["after_samples_per_s"] / imbalanced["before_samples_per_s"]
    announce_s = cfg.swarm.announce_period_s
    bound_s = 2 * announce_s + imbalanced["longest_move_s"]
    print(
        f"after / before: {gain:.2f} (simulator {sim_after / sim_before:.2f}); rebalanced allocation "
        f"{'equals' if after_counts == auto_counts else 'differs from'} --stage auto's"
    )
    print(
        f"time to balance: {len(imbalanced['moves'])} move(s), decided within "
        f"{imbalanced['decision_spread_s']:.1f} s of each other (the first "
        f"{imbalanced['first_decision_after_traffic_s']:.0f} s after traffic began); all serving "
        f"{imbalanced['time_to_balance_s']:.1f} s after the first decision, vs two announce periods plus "
        f"the longest move (drain, restart, state download) {bound_s:.1f} s"
    )
    print(
        f"CPU ms per sample, per step by stage {[(round(1e3 * a, 2), round(1e3 * b, 1)) for a, b in fits]}, "
        f"per-call overhead "
        f"{1e3 * latency:.1f} ms; idle CPU baseline "
        f"{mean_idle:.3f} CPU s/s per "
        f"server; windows: before {imbalanced['before_window_s']:.0f} s, after {imbalanced['after_window_s']:.0f} s"
    )
    if args.plain:
        period_s = cfg.swarm.rebalance_period_s
        print(
            f"default period {period_s:.0f} s: balanced {imbalanced['balanced_after_ready_s']:.0f} s after the "
            f"servers were ready (three periods: {3 * period_s:.0f} s); the --stage auto fleet made "
            f"{len(auto['moves'])} move(s) in {auto['duration_s'] / 60:.1f} min of training"
        )
    if args.summary_json:
        report = {
            "imbalanced": imbalanced,
            "auto": auto,
            "sim_before": sim_before,
            "sim_after": sim_after,
            "sim_auto": sim_auto,
            "stage_cpu_s_per_sample_and_step": fits,
        }
        Path(args.summary_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("rebalance_live: interrupted; the swarms are stopped", file=sys.stderr)
        sys.exit(130)
