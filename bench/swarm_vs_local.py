"""Swarm vs. local training, side by side in one run: throughput, bytes on the wire, codec speed.

    python bench/swarm_vs_local.py [--preset small] [--duration-s 40] [--summary-json PATH]

- throughput_ratio: steady-state samples/s of a real swarm (DHT + one server per stage, 1 torch
  thread each, + a trainer, all separate processes on this machine) divided by local training's
  samples/s with as many torch threads as the swarm has servers (same total CPU threads) or with
  one thread, whichever is faster (on a loaded 2-core machine 2 torch threads can be slower);
- wire_bytes_ratio: bytes actually sent by every process (the trainer's requests; each server's
  requests and replies, over libp2p and over the direct data plane that hands activations and
  gradients from server to server; counted once, by their sender at its transport) divided by the
  bytes of the same messages with every float tensor in fp32;
- bytes per sample sent, per process: the trainer's by stage and message kind, each server's total
  (its metrics line, runtime/server/server_metrics.py);
- codec_gb_per_s: 8-bit encode+decode of fp32 input on one core.
The local baseline is measured before and after the swarm and averaged (the machine is shared).
The trainer's own CPU use (routing, relaying) is not given extra threads: it competes with the servers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from swarmtrain.config import get_preset, load_run_config
from swarmtrain.data import iterate_batches
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, write_run_toml
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.local import LocalTrainer
from swarmtrain.runtime.server.server_metrics import metrics_from_log

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec_throughput import codec_gb_per_s  # noqa: E402

SERVER_METRICS_WAIT_S = 2.5  # > the servers' --metrics-period-s of 1: a line after the last reply


def measure_local(preset: str, threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    cfg = get_preset(preset)
    trainer = LocalTrainer(cfg, progress=False)
    batches = iterate_batches(trainer.train_set, cfg.training.micro_batch_size, seed=0)
    trainer.step(batches)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(batches)
    return steps * cfg.training.global_batch_size / (time.perf_counter() - start)


def measure_swarm(preset: str, duration_s: float, in_flight: int, codec: str, workdir: Path) -> dict:
    config = write_run_toml(
        workdir / "run.toml", preset, {"swarm": {"announce_period_s": 1.0, "rebalance_period_s": 0.0}}
    )
    cfg = load_run_config(config)
    with LocalSwarm(workdir / "peers", config) as swarm:
        swarm.start_dht()
        names = [f"stage{s}" for s in range(cfg.swarm.num_stages)]
        for stage, name in enumerate(names):
            swarm.start_server(name, stage, "--threads", "1", "--metrics-period-s", "1")
        swarm.wait_ready(names, timeout_s=180)  # servers log their metrics every second (below)
        swarm.start_trainer(
            "trainer",
            "--duration-s",
            str(duration_s),
            "--in-flight",
            str(in_flight),
            "--compression",
            codec,
            "--log-period-s",
            "5",
        )
        code = swarm.wait_exit("trainer", duration_s + 180)
        if code != 0:
            raise RuntimeError(f"trainer failed ({code}):\n{swarm.processes['trainer'].log_text()[-3000:]}")
        summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
        done = [e for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"]
        time.sleep(SERVER_METRICS_WAIT_S)  # the servers' last replies counted in a metrics line
        servers = {name: metrics_from_log(swarm.processes[name].log_text())[-1] for name in names}
    warm = [e for e in done if e["t"] >= done[0]["t"] + min(10.0, duration_s / 4)]  # skip warm-up
    steady = sum(e["n"] for e in warm[1:]) / max(warm[-1]["t"] - warm[0]["t"], 1e-9) if len(warm) > 2 else 0.0
    return {
        "samples_per_s": steady,
        "samples": summary["samples"],
        "transport": summary["transport"],
        "servers_sent": {n: {"wire": m.bytes_out, "fp32": m.fp32_bytes_out} for n, m in servers.items()},
        "num_stages": cfg.swarm.num_stages,
    }


def sent_bytes(swarm: dict) -> tuple[int, int]:
    """(wire, fp32-equivalent) bytes sent by every process of the run: the trainer's requests and
    the servers' requests and replies (each message counted once, by its sender)."""
    wire = fp32 = 0
    for entries in swarm["transport"]["per_stage"].values():
        for key, value in entries.items():
            if key.endswith("_out_wire_bytes"):
                wire += value
            elif key.endswith("_out_fp32_bytes"):
                fp32 += value
    for server in swarm["servers_sent"].values():
        wire, fp32 = wire + server["wire"], fp32 + server["fp32"]
    return wire, fp32


def bytes_table(swarm: dict, samples: int) -> list[tuple[str, float, float]]:
    """(label, wire, fp32) bytes per sample sent: the trainer's requests by stage and kind, then each
    server's total."""
    rows = []
    for stage, entries in sorted(swarm["transport"]["per_stage"].items()):
        for key in sorted(k for k in entries if k.endswith("_out_wire_bytes")):
            what = key[: -len("_wire_bytes")]
            fp32 = entries[what + "_fp32_bytes"]
            label = f"trainer to stage {stage}, {what.removesuffix('_out').replace('_', ' ')}"
            rows.append((label, entries[key] / samples, fp32 / samples))
    for name, sent in sorted(swarm["servers_sent"].items()):
        rows.append((f"server {name}, all it sent", sent["wire"] / samples, sent["fp32"] / samples))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--duration-s", type=float, default=40.0, help="swarm training time")
    parser.add_argument("--in-flight", type=int, default=6)
    parser.add_argument("--compression", default="8bit", choices=("none", "float16", "8bit"))
    parser.add_argument("--local-steps", type=int, default=4, help="optimizer steps per local measurement")
    parser.add_argument("--summary-json")
    args = parser.parse_args()

    codec_speed = codec_gb_per_s()
    threads = get_preset(args.preset).swarm.num_stages
    thread_options = sorted({1, threads})
    before = {t: measure_local(args.preset, t, args.local_steps) for t in thread_options}
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as tmp:
        swarm = measure_swarm(args.preset, args.duration_s, args.in_flight, args.compression, Path(tmp))
    after = {t: measure_local(args.preset, t, args.local_steps) for t in thread_options}
    local_by_threads = {t: (before[t] + after[t]) / 2 for t in thread_options}
    best_threads = max(local_by_threads, key=local_by_threads.get)
    local = local_by_threads[best_threads]
    samples = swarm["samples"]
    wire_bytes, fp32_bytes = sent_bytes(swarm)
    summary = {
        "throughput_ratio": swarm["samples_per_s"] / local,
        "wire_bytes_ratio": wire_bytes / fp32_bytes,
        "codec_gb_per_s": codec_speed,
        "swarm_samples_per_s": swarm["samples_per_s"],
        "local_samples_per_s": local,
        "local_samples_per_s_by_threads": {str(t): v for t, v in local_by_threads.items()},
        "local_samples_per_s_before_after": {str(t): [before[t], after[t]] for t in thread_options},
        "wire_bytes_per_sample": wire_bytes / samples,
        "fp32_bytes_per_sample": fp32_bytes / samples,
        "preset": args.preset,
        "compression": args.compression,
        "threads": threads,
    }
    print(f"preset {args.preset}, {swarm['num_stages']} stages, {args.compression}, {threads} threads total")
    print(f"{'':38s} {'value':>12s}")
    for t, value in local_by_threads.items():
        print(f"{'local samples/s (' + str(t) + ' thread' + ('s' if t > 1 else '') + ')':38s} {value:12.1f}")
    print(f"{'swarm samples/s (steady state)':38s} {swarm['samples_per_s']:12.1f}")
    print(f"{'throughput ratio (target >= 0.7)':38s} {summary['throughput_ratio']:12.3f}")
    print(f"{'wire bytes / fp32 bytes (target <= 0.3)':38s} {summary['wire_bytes_ratio']:12.3f}")
    print(f"{'codec GB/s (8-bit, 1 core)':38s} {codec_speed:12.2f}")
    print(f"\n{'bytes sent per sample':38s} {'wire':>12s} {'as fp32':>12s}")
    for label, wire, fp32 in bytes_table(swarm, samples):
        print(f"{label:38s} {wire:12.0f} {fp32:12.0f}")
    print(f"{'total':38s} {summary['wire_bytes_per_sample']:12.0f} {summary['fp32_bytes_per_sample']:12.0f}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
