"""Asynchronous full replicas (DiLoCo) vs a SWARM of the same processes over rate-limited links, and the
bandwidth below which replicas win: measured, and predicted by the simulator from this run's own figures.

    python bench/replicas_vs_swarm.py [--preset tiny] [--bandwidths 4,8,16,32,inf] [--samples 2048]
                                      [--peers 2] [--inner-steps 20,5] [--quick]
                                      [--summary-json PATH] [--keep-logs DIR]
    python bench/replicas_vs_swarm.py --analyze PATH      # the prediction and table again, from a summary

At each link bandwidth of the sweep (Mbit/s, the same up and down for every peer; `inf`: no limit), these
configurations run one after the other on this machine, each from scratch:
- swarm: a DHT, `swarmtrain server --stage N` (PEERS / num_stages per stage, 1 thread each) and one
  `swarmtrain trainer --in-flight K --compression 8bit`;
- rep H=h, for each h of --inner-steps: a DHT and PEERS x `swarmtrain replica --shard k/PEERS --threads 1`
  (DiLoCo: h local steps of global_batch / PEERS samples between rounds, 8-bit pseudo-gradients). The first
  h is the config's default (diloco.inner_steps); the second, smaller, is there because it has a crossover
  (see below).
Every process (the DHT and the trainer included) runs in its own network namespace of a WAN test bed
(`runtime/harness/netbed.py`: a bridge, a veth pair per peer, `tc tbf` on both directions; no added latency) when
this machine can build one (root, iproute2); otherwise everything runs on loopback, the output says so,
and only the unlimited point is measured (no measured crossover then; the prediction still is).

All train the same run (training.max_samples = SAMPLES in the run TOML: same learning-rate schedule) to
SAMPLES in total. Measured per run:
- samples/s: samples trained / training wall time (the trainer's loop; replicas: all replicas' samples
  over the slowest replica's loop; start-up excluded);
- val@S: validation loss after SAMPLES samples (the trainer's through the swarm; replica 0's, equal to
  the others' after the last round), on the preset's eval_samples;
- val@T: validation loss at equal wall time, between swarm and the first H: T = the faster one's training
  time at this bandwidth; the faster one's val@S, and for the slower one a second run stopped after T
  seconds (`--duration-s T`; skipped with --no-equal-time);
- bytes/smp: bytes every peer's interface sent (namespace counters from before start-up to the end of
  training, so DHT, RPCs, all-reduce and TCP/IP headers; each byte counted once, at its sender; SWARM's
  final evaluation through the swarm excluded) / samples. On loopback there are no per-peer interfaces:
  the applications' own counts are shown instead (marked ~).

Crossover: where replicas' samples/s overtakes SWARM's as bandwidth drops, log-interpolated between sweep
points (sim.mode_choice.log_crossovers). The prediction: the simulator on fleets built from this run's
measurements at the fastest links (unlimited when swept), as experiments/calibrate_demo.py does: SWARM
peers pinned to their stage with the servers' measured compute seconds per sample (busy time / samples
forwarded), one trainer, K in flight, the trainer's measured per-call overhead as latency; replicas with the
measured seconds per sample of the slowest replica at that H (which folds in the fixed cost of a round:
matchmaking, the all-reduce's round trips) and this run's H, local batch and averaging codec; links at each
bandwidth. `sim/s` models the runtime's data path (SimConfig.relay_via_trainer, trainer_link_bytes_per_s,
max_staleness, replica_averaging_bytes_per_param): the trainer relays every boundary tensor over its own
limited link, steps are synchronous (a stage's forwards of step s wait until it applied step s - 1), and a
round waits for the all-reduce of the 8-bit codec's payload. `sim0/s` is the simulator's default model
(peers send boundary tensors to each other, the trainer's link is unlimited, delayed updates, fp16
averaging), shown to say how much that difference matters.

What a replica's interface sends per round (printed with the simulator's inputs: the slope between the
two H, so start-up cancels out) is about twice the codec's payload on `tiny`, but a round costs only the
payload's time: the rest overlaps the next local steps (measured: 2026-11-22 in docs/LOG.md).

A run that fails is reported with its log tail and the sweep goes on (exit status 1). Ctrl-C stops the
current run, removes the test bed, prints what was measured and writes --summary-json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from swarmtrain.config import RunConfig, get_preset, load_run_config
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, SwarmStartError, write_run_toml
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.replica.replica_metrics import replica_metrics_from_log
from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.runtime.trainer.trainer_metrics import trainer_metrics_from_log

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BANDWIDTHS = "4,8,16,32,inf"
QUICK_BANDWIDTHS = "4,inf"
DEFAULT_SAMPLES = 2048
QUICK_SAMPLES = 1024
CROSSOVER_H = 5  # averages often enough that a round's fixed cost makes SWARM faster on fast links
INF = math.inf
SIM_DURATION_S = 300.0
SIM_GRID_MBIT_S = (0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
CROSSOVER_TOLERANCE = 0.25  # the issue's bound on |predicted / measured - 1|
PROGRESS_EVERY_S = 20.0
POLL_S = 0.5


@dataclass(frozen=True)
class Setup:
    preset: str
    samples: int
    peers: int  # replicas, and servers of the SWARM in all (peers / num_stages per stage)
    in_flight: int
    codec: str
    eval_samples: int
    trainer_limited: bool
    testbed: bool  # rate-limited namespaces; False: loopback
    timeout_s: float


@dataclass(frozen=True)
class Config:
    mode: str  # swarm | replicas
    h: int | None = None  # replicas: local steps between rounds

    @property
    def key(self) -> str:
        return "swarm" if self.mode == "swarm" else f"rep H={self.h}"


class RunFailed(RuntimeError):
    pass


# arguments ----------------------------------------------------------------------------------------
def parse_bandwidths(text: str) -> list[float]:
    """Comma-separated Mbit/s; `inf` (or `unlimited`) for no limit. Returned increasing, inf last."""
    values = []
    for item in (part.strip().lower() for part in text.split(",")):
        if not item:
            continue
        if item in ("inf", "unlimited", "none"):
            values.append(INF)
            continue
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad bandwidth {item!r}: Mbit/s or `inf`") from None
        if not value >= 0.01:
            raise argparse.ArgumentTypeError(f"bandwidth {item!r} below the test bed's 0.01 Mbit/s")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("no bandwidths given")
    return sorted(set(values))


def parse_h_values(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --inner-steps {text!r}: integers, comma-separated") from None
    if not values or any(h < 1 for h in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"bad --inner-steps {text!r}: distinct positive integers")
    return values


def fmt_bw(mbit_s: float) -> str:
    return "inf" if math.isinf(mbit_s) else format(mbit_s, "g")


# peers and counters ------------------------------------------------------------------------------
def peer_names(mode: str, setup: Setup, num_stages: int) -> list[tuple[str, int | None]]:
    """(name, stage) of every process of a configuration, the DHT first; stage None: not a server."""
    if mode == "replicas":
        return [("dht", None), *((f"replica{k}", None) for k in range(setup.peers))]
    per_stage = setup.peers // num_stages
    servers = [
        (f"s{stage}" if per_stage == 1 else f"s{stage}{chr(ord('a') + r)}", stage)
        for stage in range(num_stages)
        for r in range(per_stage)
    ]
    return [("dht", None), *servers, ("trainer", None)]


def namespace_bytes(bed, i: int) -> tuple[int, int]:
    """(sent, received) bytes of every interface but loopback inside peer i's namespace."""
    text = subprocess.run(
        ["ip", "netns", "exec", bed.namespace(i), "cat", "/proc/net/dev"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    sent = received = 0
    for line in text.splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == "lo" or not counters.strip():
            continue
        fields = counters.split()
        received += int(fields[0])
        sent += int(fields[8])
    return sent, received


def cpu_busy_s() -> float:
    """CPU seconds this machine has spent busy, all cores (/proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the peers, and what they reaped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def trained_samples(ledger: Path) -> int:
    """Samples of the micro-batches the trainer completed so far (its ledger's `done` lines)."""
    return sum(int(e.get("n", 0)) for e in read_ledger(ledger) if e.get("e") == "done")


# one run ------------------------------------------------------------------------------------------
def latest_progress(mode: str, swarm: LocalSwarm, workers: list[str]) -> str:
    log_text = swarm.processes[workers[0]].log_text()
    if mode == "replicas":  # one replica's metrics: the run's samples and this replica's rate
        replica = replica_metrics_from_log(log_text)
        if not replica:
            return "(no progress line yet)"
        r = replica[-1]
        return f"~{r.samples} samples, loss {r.loss:.3f}, {r.samples_per_s:.1f} samples/s per replica"
    trainer = trainer_metrics_from_log(log_text)
    if not trainer:
        return "(no progress line yet)"
    t = trainer[-1]
    return f"{t.samples} samples, loss {t.loss:.3f}, {t.samples_per_s:.1f} samples/s"


def wait_workers(mode: str, swarm: LocalSwarm, workers: list[str], timeout_s: float, on_poll=None) -> None:
    """Until every worker exited 0 (RunFailed otherwise); `on_poll()` runs every POLL_S seconds."""
    start = time.monotonic()
    next_print = start + PROGRESS_EVERY_S
    while True:
        codes = {name: swarm.processes[name].proc.poll() for name in workers}
        failed = {name: code for name, code in codes.items() if code not in (None, 0)}
        if failed:
            name = next(iter(failed))
            raise RunFailed(f"{name} exited with {failed[name]}:\n{swarm.processes[name].log_text()[-3000:]}")
        if all(code == 0 for code in codes.values()):
            return
        now = time.monotonic()
        if now - start > timeout_s:
            name = next(n for n, c in codes.items() if c is None)
            raise RunFailed(
                f"{name} still running after {timeout_s:.0f}s:\n{swarm.processes[name].log_text()[-3000:]}"
            )
        if now >= next_print:
            next_print += PROGRESS_EVERY_S
            print(f"      {now - start:5.0f}s  {latest_progress(mode, swarm, workers)}", flush=True)
        if on_poll is not None:
            on_poll()
        time.sleep(POLL_S)


def stage_compute_s_per_sample(log_text: str, samples: int) -> float | None:
    """A server's busy seconds per sample forwarded (forward + backward), from its metrics lines: from
    the first with traffic to the last before the final evaluation's forwards (samples <= the run's)."""
    points = [(m.samples_forward, m.busy_s) for m in metrics_from_log(log_text) if m.samples_forward > 0]
    points = [p for p in points if p[0] <= samples] or points
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    (s0, b0), (s1, b1) = points[0], points[-1]
    return (b1 - b0) / (s1 - s0)


def _per_call_mean(rpc: dict, value) -> float | None:
    calls = sum(v.get("calls", 0) for v in rpc.values())
    if not calls:
        return None
    try:
        return sum(v["calls"] * value(v) for v in rpc.values() if v.get("calls")) / calls
    except (KeyError, ZeroDivisionError, TypeError):
        return None


def _start(config: Config, setup: Setup, swarm: LocalSwarm, names, stop_at: list[str]) -> list[str]:
    """Start a configuration's processes (the DHT first); returns the workers to wait for."""
    swarm.start_dht()
    if config.mode == "swarm":
        servers = [(n, s) for n, s in names if s is not None]
        for name, stage in servers:
            swarm.start_server(name, stage, "--threads", "1", "--metrics-period-s", "1")
        swarm.wait_ready([n for n, _ in servers], timeout_s=180)
        swarm.start_trainer(
            "trainer",
            *stop_at,
            "--eval-samples",
            str(setup.eval_samples),
            "--in-flight",
            str(setup.in_flight),
            "--compression",
            setup.codec,
            "--log-period-s",
            "2",
        )
        return ["trainer"]
    workers = [name for name, _ in names[1:]]
    for k, name in enumerate(workers):
        swarm.start_replica(
            name,
            f"{k}/{setup.peers}",
            *stop_at,
            "--threads",
            "1",
            "--eval-samples",
            str(setup.eval_samples),
            "--log-period-s",
            "2",
        )
    return workers


def run_one(
    config: Config,
    mbit_s: float,
    setup: Setup,
    cfg: RunConfig,
    config_path: Path,
    workdir: Path,
    duration_s: float | None = None,
) -> dict:
    names = peer_names(config.mode, setup, cfg.swarm.num_stages)
    index = {name: i for i, (name, _) in enumerate(names)}
    rate = None if math.isinf(mbit_s) else mbit_s
    stop_at = ["--max-samples", str(setup.samples)]
    if duration_s is not None:
        stop_at += ["--duration-s", f"{duration_s:.2f}"]
    began, busy, ours = time.monotonic(), cpu_busy_s(), own_cpu_s()
    result = _run_one(config, names, index, rate, stop_at, setup, config_path, workdir)
    result.update(config=config.key, mbit_s=mbit_s, duration_s=duration_s)
    # CPU that other processes used meanwhile (another user's tests, say), in cores; approximate: a
    # peer's p2pd that its peer does not reap counts as other
    wall = time.monotonic() - began
    result["other_cpu_cores"] = max(0.0, (cpu_busy_s() - busy) - (own_cpu_s() - ours)) / wall
    return result


def _run_one(
    config: Config, names, index, rate, stop_at, setup: Setup, config_path: Path, workdir: Path
) -> dict:
    with ExitStack() as stack:
        bed = None
        if setup.testbed:
            rates = [rate] * len(names)
            if config.mode == "swarm" and not setup.trainer_limited:
                rates[index["trainer"]] = None
            bed = stack.enter_context(netbed.WanTestbed(len(names), up_mbit_s=rates, down_mbit_s=rates))
        # entered after the test bed, so every process is stopped before the test bed is removed
        swarm = stack.enter_context(
            LocalSwarm(workdir, config_path, netbed=bed, netbed_peers=index if bed else None)
        )

        def counters() -> list[int]:
            return [namespace_bytes(bed, i)[0] for i in range(len(names))] if bed else []

        before = counters()
        try:
            workers = _start(config, setup, swarm, names, stop_at)
        except SwarmStartError as exc:
            raise RunFailed(f"start-up failed: {exc}") from None
        # SWARM evaluates through the swarm after training: keep the counters of the first poll that saw
        # the final number of trained samples (at most POLL_S late), not those after the evaluation
        snapshots: list[tuple[int, list[int]]] = []

        def poll() -> None:
            if bed is not None and config.mode == "swarm":
                snapshots.append((trained_samples(swarm.ledger_path("trainer")), counters()))

        wait_workers(config.mode, swarm, workers, setup.timeout_s, poll)
        after = counters()
        if snapshots and config.mode == "swarm":
            final = trained_samples(swarm.ledger_path("trainer"))
            at_end = [c for n, c in snapshots if n >= final]
            after = at_end[0] if at_end else after
        result: dict = {}
        if config.mode == "swarm":
            result.update(_swarm_result(swarm, names))
        else:
            result.update(_replica_result(swarm, workers))
        samples = result["samples"]
        if bed:
            sent = {name: after[i] - before[i] for i, (name, _) in enumerate(names)}
            result.update(bytes_sent=sum(sent.values()), bytes_sent_by_peer=sent, bytes_measured=True)
        else:
            result.update(bytes_sent=result["app_bytes"], bytes_measured=False)
        result["bytes_per_sample"] = (
            result["bytes_sent"] / samples if samples and result["bytes_sent"] else None
        )
    return result


def _swarm_result(swarm: LocalSwarm, names) -> dict:
    summary = json.loads(swarm.summary_path("trainer").read_text())
    samples = summary["samples"]
    rate = summary.get("samples_per_s") or 0.0
    rpc = summary.get("rpc") or {}
    return {
        "samples": samples,
        "wall_s": samples / rate if rate else None,
        "samples_per_s": rate,
        "val_loss": summary.get("val_loss"),
        "retries": summary.get("retries"),
        "timeouts": summary.get("timeouts"),
        "microbatches_failed": summary.get("microbatches_failed"),
        "app_bytes": (summary.get("transport") or {}).get("wire_bytes"),
        "stage_compute_s_per_sample": {
            name: stage_compute_s_per_sample(swarm.processes[name].log_text(), samples)
            for name, stage in names
            if stage is not None
        },
        "server_stage": {name: stage for name, stage in names if stage is not None},
        "hop_latency_s": _per_call_mean(rpc, lambda v: v["mean_overhead_s"]),
        "compute_cv": _per_call_mean(rpc, lambda v: v["std_compute_s"] / v["mean_compute_s"]),
        "latency_cv": _per_call_mean(rpc, lambda v: v["std_overhead_s"] / v["mean_overhead_s"]),
    }


def _replica_result(swarm: LocalSwarm, workers: list[str]) -> dict:
    summaries = [json.loads(swarm.summary_path(name).read_text()) for name in workers]
    samples = sum(s["samples"] for s in summaries)
    wall = max(s["wall_s"] for s in summaries)
    return {
        "samples": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall if wall else 0.0,
        "val_loss": summaries[0].get("val_loss"),
        "val_losses": [s.get("val_loss") for s in summaries],
        "replica_s_per_sample": [s["wall_s"] / s["samples"] for s in summaries if s["samples"]],
        "rounds": {
            key: [s[key] for s in summaries]
            for key in ("outer_steps", "rounds_averaged", "rounds_alone", "rounds_resynced")
        },
        "app_bytes": sum(
            s["sync_bytes_sent"] + s["repair_bytes_received"] + s["state_bytes_received"] for s in summaries
        ),
        "joined_from": [s.get("joined_from") for s in summaries],
    }


OTHER_CPU_LIMIT = 0.5  # cores used by other processes during a run beyond which it is run again
QUIET_WAIT_S = 30.0


def suspect(run: dict) -> str | None:
    """Why a run does not measure what it should, if it does not: another load on this machine, or a
    replica that started late (it trains alone, then downloads the state: a start-up race)."""
    if (run.get("other_cpu_cores") or 0.0) > OTHER_CPU_LIMIT:
        return f"other processes used {run['other_cpu_cores']:.2f} CPU cores meanwhile"
    rounds = run.get("rounds")
    if rounds and (
        any(rounds["rounds_alone"]) or any(rounds["rounds_resynced"]) or "peers" in run.get("joined_from", [])
    ):
        return f"replicas did not average every round together ({rounds}, joined {run['joined_from']})"
    return None


def wait_quiet(max_s: float = QUIET_WAIT_S) -> float:
    """Before a run: wait (at most `max_s`) until the rest of this machine uses < OTHER_CPU_LIMIT cores."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        busy = cpu_busy_s()
        time.sleep(1.0)
        if cpu_busy_s() - busy < OTHER_CPU_LIMIT:
            break
    return time.monotonic() - start


def measure(config: Config, mbit_s: float, setup: Setup, cfg, path: Path, workdir, retry: bool) -> dict:
    """A run, after waiting for a quiet machine; run again once if it is suspect (the cleaner one is
    kept, the other goes under `discarded`)."""
    waited = wait_quiet()
    run = run_one(config, mbit_s, setup, cfg, path, workdir(f"{fmt_bw(mbit_s)}-{config.key}"))
    run["waited_for_quiet_s"] = waited
    why = suspect(run)
    if why and retry:
        print(f"      again: {why}", flush=True)
        waited = wait_quiet()
        again = run_one(config, mbit_s, setup, cfg, path, workdir(f"{fmt_bw(mbit_s)}-{config.key}-again"))
        again["waited_for_quiet_s"] = waited
        keep, other = (again, run) if not suspect(again) else (run, again)
        keep["discarded"] = {k: v for k, v in other.items() if k != "discarded"}
        keep["discarded"]["why"] = suspect(other)
        run = keep
    return run


# the simulator's prediction -----------------------------------------------------------------------
def sim_inputs(swarm: dict, replicas: dict[int, dict], cfg: RunConfig, peers: int) -> dict:
    """Per-peer compute and latency from the runs at the fastest links, for the simulator."""
    per_stage: list[list[float]] = [[] for _ in range(cfg.swarm.num_stages)]
    for name, seconds in swarm["stage_compute_s_per_sample"].items():
        if seconds is not None:
            per_stage[swarm["server_stage"][name]].append(seconds)
    if any(not v for v in per_stage):
        raise ValueError("a stage server logged too few metrics lines to measure its compute")
    return {
        "measured_at_mbit_s": swarm["mbit_s"],
        "stage_compute_s_per_sample": [sum(v) / len(v) for v in per_stage],
        # what a replica's interface sent per round (the all-reduce, matchmaking); None on loopback
        "replica_bytes_per_round": _bytes_per_round(replicas),
        "replica_payload_bytes": _payload_values(cfg, peers) * _codec_bytes(cfg.diloco.compression),
        # rounds make every replica wait for the slowest: its pace is every replica's
        "replica_s_per_sample": {str(h): max(r["replica_s_per_sample"]) for h, r in replicas.items()},
        "hop_latency_s": swarm["hop_latency_s"] or 0.0,
        "compute_cv": swarm["compute_cv"] or 0.0,
        "latency_cv": swarm["latency_cv"] or 0.0,
    }


def _payload_values(cfg: RunConfig, peers: int) -> float:
    """Values a replica sends in a round's butterfly all-reduce: (n-1)/n of the model out to reduce, as
    much of the mean back."""
    from swarmtrain.sim.runner import costs_for

    return 2 * costs_for(cfg).model_params * (peers - 1) / peers


def _codec_bytes(compression: str) -> float:
    from swarmtrain.sim.costs import BYTES_PER_VALUE

    return BYTES_PER_VALUE[compression]


def _bytes_per_round(replicas: dict[int, dict]) -> dict[str, float | None]:
    """Bytes a replica's interface sent per round, for each H: with two or more H measured, the slope
    between them (what one more round costs: start-up and the DHT's periodic records cancel out), else
    its bytes over its rounds."""
    points = {}
    for h, run in replicas.items():
        by_peer = run.get("bytes_sent_by_peer")
        if run.get("bytes_measured") and by_peer:
            sent = [v for name, v in by_peer.items() if name.startswith("replica")]
            points[h] = (max(run["rounds"]["outer_steps"]), sum(sent) / len(sent))
    if len(points) >= 2:
        (r0, b0), (r1, b1) = min(points.values()), max(points.values())
        if r1 > r0 and b1 > b0:
            slope = (b1 - b0) / (r1 - r0)
            return {str(h): slope for h in replicas}
    return {str(h): points[h][1] / max(1, points[h][0]) if h in points else None for h in replicas}


def _link(mbit_s: float) -> float:
    return INF if math.isinf(mbit_s) else mbit_s * 1e6 / 8


def _peer(name: str, compute: tuple[float | None, ...], mbit_s: float, stage: int | None):
    from swarmtrain.sim.entities import DEVICE_TYPES, PeerSpec

    spec = PeerSpec.from_device(name, DEVICE_TYPES["cpu"], 0)
    return replace(
        spec,
        uplink_bytes_per_s=_link(mbit_s),
        downlink_bytes_per_s=_link(mbit_s),
        compute_s_per_sample=compute,
        stage=stage,
        home_stage=stage,
    )


def predict_swarm(cfg: RunConfig, setup: Setup, inputs: dict, mbit_s: float, runtime_path: bool) -> float:
    """Simulated SWARM samples/s at `mbit_s`. `runtime_path`: as the runtime does it, the trainer relays
    boundary tensors over its own link, limited like the peers' (unless --trainer-link unlimited), and
    steps are synchronous (training.max_staleness)."""
    from swarmtrain.sim.base import SimConfig
    from swarmtrain.sim.entities import Fleet, single_location
    from swarmtrain.sim.runner import run_simulation

    stages = cfg.swarm.num_stages
    compute = inputs["stage_compute_s_per_sample"]
    peers = tuple(
        _peer(
            f"s{stage}-{r}",
            tuple(compute[stage] if s == stage else None for s in range(stages)),
            mbit_s,
            stage,
        )
        for stage in range(stages)
        for r in range(setup.peers // stages)
    )
    # the measured overhead is per call (2S - 1 per micro-batch); relayed, a micro-batch makes
    # 2 (2S - 1) - 1 transfers, so each transfer gets its share of the same total
    calls = 2 * stages - 1
    latency = inputs["hop_latency_s"] * (calls / (2 * calls - 1) if runtime_path else 1.0)
    extra = {}
    if runtime_path:
        trainer_link = _link(mbit_s) if setup.trainer_limited else INF
        extra = {
            "relay_via_trainer": True,
            "trainer_link_bytes_per_s": trainer_link,
            "max_staleness": cfg.training.max_staleness,
        }
    config = SimConfig(
        mode="swarm-no-rebalance",
        duration_s=SIM_DURATION_S,
        chunk_samples=cfg.training.micro_batch_size,
        in_flight=setup.in_flight,
        num_trainers=1,
        compute_cv=min(inputs["compute_cv"], 5.0),
        latency_cv=min(inputs["latency_cv"], 5.0),
        num_samples=30,
        **extra,
    )
    fleet = Fleet(peers, single_location(latency_s=latency), "swarm (measured)")
    return run_simulation(fleet, cfg, config).summary["samples_per_s"]


def predict_replicas(
    cfg: RunConfig, setup: Setup, inputs: dict, h: int, mbit_s: float, runtime_path: bool
) -> float:
    """Simulated samples/s of PEERS replicas averaging every `h` local steps at `mbit_s`."""
    from swarmtrain.sim.base import SimConfig
    from swarmtrain.sim.entities import Fleet, single_location
    from swarmtrain.sim.mode_choice import simulate_replicas

    stages = cfg.swarm.num_stages
    seconds = inputs["replica_s_per_sample"][str(h)]
    peers = tuple(
        _peer(f"r{k}", tuple(seconds / stages for _ in range(stages)), mbit_s, None)
        for k in range(setup.peers)
    )
    extra = {}
    if runtime_path:  # what a round waits for: the all-reduce's payload in the codec
        extra = {"replica_averaging_bytes_per_param": _codec_bytes(cfg.diloco.compression)}
    config = SimConfig(
        mode="async-replicas",
        duration_s=SIM_DURATION_S,
        local_batch_samples=cfg.training.global_batch_size // setup.peers,
        num_samples=30,
        **extra,
    )
    fleet = Fleet(peers, single_location(), "replicas (measured)")
    return simulate_replicas(fleet, cfg, h, config).samples_per_s


# crossovers ----------------------------------------------------------------------------------------
def crossover(bandwidths: list[float], swarm: list[float | None], replicas: list[float | None]) -> dict:
    """Where replicas overtake SWARM as bandwidth drops: the highest such point, log-interpolated."""
    from swarmtrain.sim.mode_choice import SWARM, log_crossovers

    pairs = [
        (b, s, r)
        for b, s, r in zip(bandwidths, swarm, replicas, strict=True)
        if s is not None and r is not None
    ]
    finite = [p for p in pairs if math.isfinite(p[0])]
    out: dict = {"mbit_s": None, "all": [], "note": None}
    if len(finite) >= 2:
        points = log_crossovers([p[0] for p in finite], [p[1] for p in finite], [p[2] for p in finite])
        out["all"] = [{"mbit_s": b, "leads_above": who} for b, who in points]
        overtakes = [b for b, who in points if who == SWARM]
        if overtakes:
            out["mbit_s"] = max(overtakes)
    unlimited = [p for p in pairs if math.isinf(p[0])]
    if out["mbit_s"] is None and finite and unlimited:
        last, top = finite[-1], unlimited[0]
        if last[2] > last[1] and top[2] <= top[1]:
            out["note"] = f"above {fmt_bw(last[0])} Mbit/s (replicas lead there, SWARM on unlimited links)"
    if out["mbit_s"] is None and out["note"] is None and pairs:
        leaders = {"replicas" if r > s else "SWARM" for _, s, r in pairs}
        out["note"] = (
            f"none: {leaders.pop()} leads at every bandwidth"
            if len(leaders) == 1
            else "none where replicas overtake SWARM as bandwidth drops"
        )
    return out


def describe_crossover(c: dict) -> str:
    return f"{c['mbit_s']:.3g} Mbit/s" if c["mbit_s"] is not None else (c["note"] or "n/a")


def analyze(report: dict, cfg: RunConfig, setup: Setup) -> None:
    """The simulator's prediction and both crossovers, into `report`."""
    keys = report["configs"]
    swarm_key, rep_keys = keys[0], keys[1:]
    hs = {key: int(key.split("=")[1]) for key in rep_keys}
    points = report["points"]
    ok = [p for p in points if all(p.get(k) and not p[k].get("error") for k in keys)]
    report.pop("sim_error", None)
    if ok:
        ref = ok[-1]  # the fastest links measured
        try:
            inputs = sim_inputs(ref[swarm_key], {hs[k]: ref[k] for k in rep_keys}, cfg, setup.peers)
        except (ValueError, KeyError, TypeError) as exc:
            inputs = None
            report["sim_error"] = f"no simulator prediction: {type(exc).__name__}: {exc}"
        if inputs is not None:
            report["sim_inputs"] = inputs
            grid = sorted({*SIM_GRID_MBIT_S, *(p["mbit_s"] for p in points)})
            sims: dict[str, dict[str, list[float]]] = {"sim": {}, "sim0": {}}
            for name, runtime_path in (("sim", True), ("sim0", False)):
                sims[name][swarm_key] = [predict_swarm(cfg, setup, inputs, b, runtime_path) for b in grid]
                for key in rep_keys:
                    sims[name][key] = [
                        predict_replicas(cfg, setup, inputs, hs[key], b, runtime_path) for b in grid
                    ]
            report["sim_grid"] = {"mbit_s": grid, **sims}
            for p in points:
                i = grid.index(p["mbit_s"])
                p["sim"] = {k: v[i] for k, v in sims["sim"].items()}
                p["sim0"] = {k: v[i] for k, v in sims["sim0"].items()}
            for key in rep_keys:
                report.setdefault("crossovers", {}).setdefault(key, {})
                for name in sims:
                    report["crossovers"][key][name] = crossover(grid, sims[name][swarm_key], sims[name][key])
    for key in rep_keys:
        measured = crossover(
            [p["mbit_s"] for p in points],
            [(p.get(swarm_key) or {}).get("samples_per_s") for p in points],
            [(p.get(key) or {}).get("samples_per_s") for p in points],
        )
        entry = report.setdefault("crossovers", {}).setdefault(key, {})
        entry["measured"] = measured if report["rate_limited"] else None
        sim = entry.get("sim")
        if entry["measured"] and measured["mbit_s"] and sim and sim["mbit_s"]:
            entry["ratio"] = sim["mbit_s"] / measured["mbit_s"]
            entry["within_tolerance"] = abs(entry["ratio"] - 1) <= CROSSOVER_TOLERANCE


# reporting ------------------------------------------------------------------------------------------
def machine_info() -> dict:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "load_average_at_start": os.getloadavg(),
    }


def _f(value, spec: str, width: int = 0) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def _rounds(run: dict) -> str:
    """Replicas: rounds every replica averaged with the others / rounds; `!` when not all were."""
    rounds = run.get("rounds")
    if not rounds:
        return "-"
    together, total = min(rounds["rounds_averaged"]), max(rounds["outer_steps"])
    return f"{together}/{total}" + (
        "!" if suspect({"rounds": rounds, "joined_from": run.get("joined_from", [])}) else ""
    )


def print_report(report: dict) -> None:
    print(f"links: {report['links']}")
    header = (
        f"{'Mbit/s':>6s} {'config':>9s} {'samples/s':>9s} {'wall s':>6s} {'val@S':>7s} {'val@T':>7s} "
        f"{'T s':>4s} {'bytes/smp':>9s} {'MB sent':>7s} {'sim/s':>7s} {'sim0/s':>7s} {'other':>5s} {'rounds':>6s}"
    )
    print(header)
    print("-" * len(header))
    for point in report["points"]:
        for key in report["configs"]:
            r = point.get(key)
            if r is None:
                continue
            prefix = f"{fmt_bw(point['mbit_s']):>6s} {key:>9s}"
            if r.get("error"):
                print(f"{prefix} FAILED: {r['error'].splitlines()[0][:70]}")
                continue
            at_t = point.get("val_at_T") or {}
            bps, sent = r.get("bytes_per_sample"), r.get("bytes_sent")
            mark = "" if r.get("bytes_measured") else "~"
            print(
                f"{prefix} {_f(r.get('samples_per_s'), '.1f', 9)} {_f(r.get('wall_s'), '.0f', 6)} "
                f"{_f(r.get('val_loss'), '.4f', 7)} {_f(at_t.get(key), '.4f', 7)} "
                f"{_f(point.get('equal_time_s') if key in at_t else None, '.0f', 4)} "
                f"{(mark + format(bps, ',.0f')) if bps else '-':>9s} {_f(sent / 1e6 if sent else None, '.2f', 7)} "
                f"{_f((point.get('sim') or {}).get(key), '.1f', 7)} {_f((point.get('sim0') or {}).get(key), '.1f', 7)} "
                f"{_f(r.get('other_cpu_cores'), '.2f', 5)} {_rounds(r):>6s}"
            )
    print(
        "val@S: after all samples; val@T: at equal wall time T (swarm vs the first H); bytes/smp: all "
        "interfaces' sent bytes / samples (~: the applications' own count, loopback); sim/s: the simulator on "
        "this run's measured compute with the runtime's data path; sim0/s: its default model; other: CPU "
        "cores that other processes of this machine used during the run (approximate); rounds: rounds all "
        "replicas averaged together / rounds (!: some replica trained a round alone, resynced or joined late)"
    )
    if report.get("sim_error"):
        print(report["sim_error"])
    if "sim_inputs" in report:
        i = report["sim_inputs"]
        reps = ", ".join(f"H={h} {1e3 * v:.2f}" for h, v in i["replica_s_per_sample"].items())
        sent = ", ".join(
            f"H={h} {v / 1e6:.2f} MB" for h, v in i["replica_bytes_per_round"].items() if v is not None
        )
        print(
            f"simulator inputs (measured at {fmt_bw(i['measured_at_mbit_s'])} Mbit/s): stage compute "
            + " / ".join(f"{1e3 * v:.2f}" for v in i["stage_compute_s_per_sample"])
            + f" ms/sample; slowest replica {reps} ms/sample; per-call overhead {1e3 * i['hop_latency_s']:.1f} ms; "
            f"cv compute {i['compute_cv']:.2f}, latency {i['latency_cv']:.2f}"
            + (
                f"; a replica sent per round {sent} (the all-reduce's payload in the codec, which the simulator "
                f"counts: {i['replica_payload_bytes'] / 1e6:.2f} MB)"
                if sent
                else ""
            )
        )
    for key, c in (report.get("crossovers") or {}).items():
        measured = describe_crossover(c["measured"]) if c.get("measured") else "n/a (loopback)"
        line = f"crossover swarm vs {key}: measured {measured}"
        if c.get("sim"):
            line += (
                f"; predicted {describe_crossover(c['sim'])} (default model: {describe_crossover(c['sim0'])})"
            )
        if "ratio" in c:
            verdict = "within" if c["within_tolerance"] else "OUTSIDE"
            line += f"; predicted / measured {c['ratio']:.2f}: {verdict} {CROSSOVER_TOLERANCE:.0%}"
        print(line)


def _setup_from(report: dict) -> Setup:
    return Setup(**report["setup"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", help="tiny or small (default tiny)")
    parser.add_argument(
        "--bandwidths",
        type=parse_bandwidths,
        help=f"Mbit/s per peer and direction, comma-separated, `inf`: no limit (default {DEFAULT_BANDWIDTHS}; "
        f"--quick {QUICK_BANDWIDTHS})",
    )
    parser.add_argument(
        "--samples",
        type=int,
        help=f"samples per run, in total (default {DEFAULT_SAMPLES}; --quick {QUICK_SAMPLES})",
    )
    parser.add_argument(
        "--peers",
        type=int,
        default=2,
        help="replicas, and SWARM servers in all (PEERS / stages per stage); 2-4",
    )
    parser.add_argument(
        "--inner-steps",
        type=parse_h_values,
        help=f"H values of the replica configurations (default: diloco.inner_steps,{CROSSOVER_H})",
    )
    parser.add_argument("--in-flight", type=int, default=4, help="SWARM micro-batches in flight (default 4)")
    parser.add_argument(
        "--trainer-link",
        choices=("limited", "unlimited"),
        default="limited",
        help="the SWARM trainer's link: at the swept bandwidth like every peer's (default), or unlimited",
    )
    parser.add_argument("--no-equal-time", action="store_true", help="skip the equal-wall-time second runs")
    parser.add_argument(
        "--no-retry",
        action="store_true",
        help=f"do not run a suspect run again (other processes used > {OTHER_CPU_LIMIT} cores meanwhile, or "
        "a replica started late and trained alone)",
    )
    parser.add_argument("--loopback", action="store_true", help="no WAN test bed, even as root")
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: {QUICK_BANDWIDTHS} Mbit/s, {QUICK_SAMPLES} samples"
    )
    parser.add_argument("--run-timeout-s", type=float, default=600.0, help="give up on a run after this long")
    parser.add_argument("--summary-json", metavar="PATH", help="every run, the simulator's inputs and output")
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="keep each run's logs, summaries and run TOMLs in DIR"
    )
    parser.add_argument(
        "--analyze",
        metavar="PATH",
        help="no runs: the prediction and the table again from a --summary-json file",
    )
    args = parser.parse_args()

    if args.analyze:
        report = json.loads(Path(args.analyze).read_text())
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_run_config(write_toml_text(Path(tmp) / "run.toml", report["run_toml"]))
        analyze(report, cfg, _setup_from(report))
        print_report(report)
        return 0

    base = get_preset(args.preset)
    stages = base.swarm.num_stages
    g = base.training.global_batch_size
    samples = args.samples or (QUICK_SAMPLES if args.quick else DEFAULT_SAMPLES)
    if samples < g or samples % g:
        parser.error(f"--samples must be a positive multiple of the global batch ({g} on {args.preset})")
    if not 2 <= args.peers <= 4 or args.peers % stages or g % args.peers:
        parser.error(
            f"--peers must be 2..4, a multiple of the {stages} stages, and divide the global batch {g}"
        )
    h_values = args.inner_steps or [base.diloco.inner_steps, CROSSOVER_H]
    bandwidths = args.bandwidths or parse_bandwidths(QUICK_BANDWIDTHS if args.quick else DEFAULT_BANDWIDTHS)
    ok, why = netbed.available()
    testbed = ok and not args.loopback
    if not testbed:
        why = why or "--loopback"
        bandwidths = [INF]
    setup = Setup(
        preset=args.preset,
        samples=samples,
        peers=args.peers,
        in_flight=args.in_flight,
        codec="8bit",
        eval_samples=base.training.eval_samples,
        trainer_limited=args.trainer_link == "limited",
        testbed=testbed,
        timeout_s=args.run_timeout_s,
    )
    configs = [Config("swarm"), *(Config("replicas", h) for h in h_values)]

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    keep = Path(args.keep_logs) if args.keep_logs else None
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="replicas-vs-swarm-")
    root = keep or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    toml_paths: dict[str, Path] = {}
    for config in configs:
        overrides: dict[str, dict] = {
            "training": {"max_samples": samples},
            # rebalancing off: the fleets compared stay as started
            "swarm": {"announce_period_s": 1.0, "compression": setup.codec, "rebalance_period_s": 0.0},
        }
        if config.h is not None:
            overrides["diloco"] = {"inner_steps": config.h}
        name = "run.toml" if config.h is None else f"run-h{config.h}.toml"
        toml_paths[config.key] = write_run_toml(root / name, args.preset, overrides)
    cfg = load_run_config(toml_paths["swarm"])
    links = (
        "rate-limited: every process in its own network namespace of the WAN test bed, tc tbf up and down "
        "at the swept bandwidth, no added latency"
        + ("" if setup.trainer_limited else " (the SWARM trainer's link unlimited)")
        if testbed
        else f"LOOPBACK (no WAN test bed: {why}): only unlimited links measured, so no measured crossover"
    )
    report: dict = {
        "preset": args.preset,
        "samples": samples,
        "setup": setup.__dict__,
        "configs": [c.key for c in configs],
        "local_batch": g // args.peers,
        "diloco_compression": cfg.diloco.compression,
        "links": links,
        "rate_limited": testbed,
        "bandwidths_mbit_s": bandwidths,
        "run_toml": toml_paths["swarm"].read_text(),
        "machine": machine_info(),
        "points": [],
    }

    def save() -> None:
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(report, indent=2, default=str) + "\n")

    def workdir(name: str) -> Path:
        path = root / name
        if keep and path.exists():
            shutil.rmtree(path)
        return path

    print(
        f"preset {args.preset}, {samples} samples per run: SWARM {stages} stages x {args.peers // stages} "
        f"server(s) + trainer ({args.in_flight} in flight, {setup.codec}) vs {args.peers} replicas at H = "
        f"{', '.join(map(str, h_values))} (local steps of {g // args.peers} samples, {cfg.diloco.compression} "
        "pseudo-gradients); 1 torch thread per peer",
        flush=True,
    )
    print(f"links: {links}", flush=True)
    interrupted = False
    start_all = time.monotonic()
    try:
        for n, mbit_s in enumerate(bandwidths):
            point: dict = {"mbit_s": mbit_s}
            report["points"].append(point)
            for config in configs:
                print(f"[{n + 1}/{len(bandwidths)}] {fmt_bw(mbit_s)} Mbit/s, {config.key} ...", flush=True)
                began = time.monotonic()
                path = toml_paths[config.key]
                try:
                    r = measure(config, mbit_s, setup, cfg, path, workdir, not args.no_retry)
                    point[config.key] = r
                    print(
                        f"      done in {time.monotonic() - began:.0f}s: {r['samples_per_s']:.1f} samples/s, "
                        f"val {_f(r['val_loss'], '.4f')}, {_f(r['bytes_per_sample'], ',.0f')} bytes/sample",
                        flush=True,
                    )
                except RunFailed as exc:
                    point[config.key] = {"error": str(exc)}
                    print(f"      FAILED after {time.monotonic() - began:.0f}s: {exc}", flush=True)
                save()
            equal_time(point, configs[:2], setup, cfg, toml_paths, workdir, args.no_equal_time)
            save()
    except KeyboardInterrupt:
        interrupted = report["interrupted"] = True
        print("\ninterrupted: processes stopped, test bed removed", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["wall_s"] = time.monotonic() - start_all
    analyze(report, cfg, setup)
    save()
    print()
    print_report(report)
    if interrupted:
        return 130
    failed = any((p.get(k) or {}).get("error") for p in report["points"] for k in report["configs"])
    return 1 if failed else 0


def equal_time(point: dict, pair: list[Config], setup, cfg, toml_paths, workdir, skip: bool) -> None:
    """val@T: the slower of `pair` again, stopped after the faster one's training time."""
    runs = {c.key: point.get(c.key) or {} for c in pair}
    if any(r.get("error") or not r.get("wall_s") for r in runs.values()):
        return
    fast = min(runs, key=lambda k: runs[k]["wall_s"])
    slow = next(c for c in pair if c.key != fast)
    point["equal_time_s"] = runs[fast]["wall_s"]
    point["val_at_T"] = {fast: runs[fast]["val_loss"]}
    if skip:
        return
    t = point["equal_time_s"]
    print(f"      equal wall time: {slow.key} for {t:.0f}s ({fast}'s training time) ...", flush=True)
    wait_quiet()
    try:
        r = run_one(
            slow,
            point["mbit_s"],
            setup,
            cfg,
            toml_paths[slow.key],
            workdir(f"{fmt_bw(point['mbit_s'])}-{slow.key}-T"),
            duration_s=t,
        )
    except RunFailed as exc:
        point["equal_time_run"] = {"error": str(exc)}
        print(f"      FAILED: {exc}", flush=True)
        return
    point["val_at_T"][slow.key] = r["val_loss"]
    point["equal_time_run"] = r
    print(f"      {slow.key} after {r['samples']} samples: val {_f(r['val_loss'], '.4f')}", flush=True)


def write_toml_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


if __name__ == "__main__":
    sys.exit(main())
