"""Calibration: does the simulator predict the real local swarm demo's throughput?

Runs the demo configuration (`swarmtrain demo`: preset tiny, 2 stages, 2 replicas of stage 0, one
trainer that relays every call, `--hand-off relay`; no kill) for each number of micro-batches in
flight, measures, and asks the simulator to predict the same run from measured inputs only:
- per-peer compute seconds per sample: each server's compute-thread busy time over the samples it
  forwarded (its `busy_s` / `samples_forward` metrics, after warm-up), fed through the calibration
  hook (`compute_s_per_sample` of the fleet's peers);
- per-hop latency: the trainer's mean round trip per call minus the server's reported time (queue +
  compute) for that call: serialization, p2pd relaying and the trainer's own work, which the
  simulator can only see as link latency. Each of the 2S-1 calls of a micro-batch (forward 0, fused
  forward+backward 1, backward 0) is one simulated transfer, so this is the simulated latency.
The measured throughput is the trainer's steady state (completed samples after warm-up over time).

    python experiments/calibrate_demo.py [--duration-s 30] [--in-flight 1 2 4 8]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import _common as c

from swarmtrain.config import load_run_config
from swarmtrain.runtime.harness.demo import DemoOptions, run_demo
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

WARMUP_S = 8.0
LOOPBACK_BYTES_PER_S = 10e9 / 8  # loopback is not the limit here; transfers cost their latency
SIM_DURATION_S = 300.0
TARGET_ERROR = 0.15


def steady_samples_per_s(ledger: Path) -> float:
    done = [e for e in read_ledger(ledger) if e["e"] == "done"]
    warm = [e for e in done if e["t"] >= done[0]["t"] + WARMUP_S]
    if len(warm) < 3:
        raise RuntimeError(f"too few micro-batches after warm-up in {ledger}")
    return sum(e["n"] for e in warm[1:]) / (warm[-1]["t"] - warm[0]["t"])


def compute_s_per_sample(server_log: Path) -> float:
    """Busy seconds per forwarded sample between the first metrics line with traffic and the last."""
    metrics = metrics_from_log(server_log.read_text())
    points = [(m.samples_forward, m.busy_s) for m in metrics if m.samples_forward > 0]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        raise RuntimeError(f"not enough metrics lines in {server_log}")
    (s0, b0), (s1, b1) = points[0], points[-1]
    return (b1 - b0) / (s1 - s0)


def _per_call_mean(rpc: dict, value) -> float:
    """Mean of `value(timings of one kind of call)` over all calls."""
    calls = sum(v["calls"] for v in rpc.values())
    return sum(v["calls"] * value(v) for v in rpc.values()) / calls


def hop_latency_s(rpc: dict) -> float:
    """Mean over all calls of (round trip - server time)."""
    return _per_call_mean(rpc, lambda v: v["mean_overhead_s"])


def pooled_cv(rpc: dict, name: str) -> float:
    """Coefficient of variation of `name` within each kind of call (their means differ), pooled."""
    return _per_call_mean(rpc, lambda v: v[f"std_{name}"] / v[f"mean_{name}"])


def measure(in_flight: int, duration_s: float, root: Path) -> dict:
    workdir = root / f"in_flight_{in_flight}"
    # throughput only: the one-process loss reference would add a training run per setting
    # every call relayed by the trainer: its per-call round trips are the simulator's 2S-1 transfers
    options = DemoOptions(
        duration_s=duration_s,
        kill=False,
        in_flight=in_flight,
        workdir=str(workdir),
        reference=False,
        hand_off="relay",
    )
    summary = run_demo(options, out=io.StringIO())
    if not summary["microbatches_completed"] or summary["microbatches_failed"]:
        raise RuntimeError(f"demo run with {in_flight} in flight failed: {summary}")
    peers = workdir / "peers"
    trainer = json.loads((peers / "trainer.summary.json").read_text())
    servers = {log.stem: compute_s_per_sample(log) for log in sorted(peers.glob("stage*.log"))}
    return {
        "in_flight": in_flight,
        "measured_samples_per_s": steady_samples_per_s(peers / "trainer.ledger.jsonl"),
        "compute_s_per_sample": servers,
        "hop_latency_s": hop_latency_s(trainer["rpc"]),
        "compute_cv": pooled_cv(trainer["rpc"], "compute_s"),
        "latency_cv": pooled_cv(trainer["rpc"], "overhead_s"),
        "rpc": trainer["rpc"],
        "run_toml": str(workdir / "run.toml"),
    }


def demo_fleet(compute: dict[str, float], num_stages: int, latency_s: float) -> Fleet:
    """One pinned peer per server process (names `stage{S}-r{i}`), measured compute at its stage."""
    peers = []
    for name, seconds in compute.items():
        stage = int(name.split("-")[0].removeprefix("stage"))
        times = tuple(seconds if s == stage else None for s in range(num_stages))
        spec = PeerSpec.from_device(name, DEVICE_TYPES["cpu"], 0)
        spec = PeerSpec(
            **{
                **spec.__dict__,
                "uplink_bytes_per_s": LOOPBACK_BYTES_PER_S,
                "downlink_bytes_per_s": LOOPBACK_BYTES_PER_S,
                "compute_s_per_sample": times,
                "stage": stage,
                "home_stage": stage,
            }
        )
        peers.append(spec)
    return Fleet(tuple(peers), single_location(latency_s=latency_s), "local demo (measured)")


def predict(run: dict, variability: bool = True) -> float:
    cfg = load_run_config(run["run_toml"])
    fleet = demo_fleet(run["compute_s_per_sample"], cfg.swarm.num_stages, run["hop_latency_s"])
    config = SimConfig(
        mode="swarm-no-rebalance",
        duration_s=SIM_DURATION_S,
        chunk_samples=cfg.training.micro_batch_size,
        in_flight=run["in_flight"],
        num_trainers=1,
        compute_cv=run["compute_cv"] if variability else 0.0,
        latency_cv=run["latency_cv"] if variability else 0.0,
    )
    return run_simulation(fleet, cfg, config).summary["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=30.0, help="training time per run")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--workdir", metavar="DIR", help="keep the runs' logs and ledgers here")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="swarmtrain-calibrate-") as tmp:
        root = args.workdir or tmp
        for k in args.in_flight:
            c.say(f"demo run with {k} micro-batch(es) in flight ({args.duration_s:.0f} s)...")
            run = measure(k, args.duration_s, Path(root))
            run["predicted_samples_per_s"] = predict(run)
            run["predicted_deterministic_samples_per_s"] = predict(run, variability=False)
            run["error"] = run["predicted_samples_per_s"] / run["measured_samples_per_s"] - 1
            runs.append(run)
    names = list(runs[0]["compute_s_per_sample"])
    header = ["in flight", *(f"{n} ms/sample" for n in names), "hop ms", "compute cv", "hop cv"]
    header += ["measured/s", "sim/s", "error", "sim w/o jitter/s"]
    rows = [
        [
            r["in_flight"],
            *(1e3 * v for v in r["compute_s_per_sample"].values()),
            1e3 * r["hop_latency_s"],
            r["compute_cv"],
            r["latency_cv"],
            r["measured_samples_per_s"],
            r["predicted_samples_per_s"],
            f"{100 * r['error']:+.1f}%",
            r["predicted_deterministic_samples_per_s"],
        ]
        for r in runs
    ]
    c.say(format_table(header, rows))
    worst = max(abs(r["error"]) for r in runs)
    c.say(f"worst error {100 * worst:.1f}% (target {100 * TARGET_ERROR:.0f}%)")
    for r in runs:
        r.pop("run_toml")
    c.save_json("calibrate_demo", {"runs": runs, "worst_abs_error": worst, "target": TARGET_ERROR})


if __name__ == "__main__":
    main()
