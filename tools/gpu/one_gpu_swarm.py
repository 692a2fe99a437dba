"""The whole swarm on one device against one process on the same device (issue 53: a 4-stage swarm on one
GPU at >= 0.6 of `train-local`), as a user would run them, one after the other:

    python tools/gpu/one_gpu_swarm.py --preset gpt2-small --device cuda --dtype bf16 [--duration-s 40]
                                       [--local-samples 2048] [--in-flight N] [--workdir DIR]
                                       [--summary-json PATH]

- one process: `swarmtrain train-local --max-samples N`, its samples/s as it reports it;
- the swarm: `swarmtrain demo --replicas 1 --no-kill --no-reference --no-monitor` (a DHT, one server per
  stage, one trainer), its steady rate: samples between the demo's progress line at half the run and its
  last one that counted more samples, over the seconds between them (the first half holds the servers'
  warm-up, the lines after the last the final evaluation).

Each command gets a time limit; a command that fails or prints no rate is reported as such, not as zero.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

PROGRESS = re.compile(r"^\s*t=\s*(\d+)s\s+samples\s+(\d+)\s", re.MULTILINE)
STARTUP_ALLOWANCE_S = 120  # a demo's servers build their stages and load CUDA before its clock runs


def steady_rate(demo_log: str) -> float | None:
    """Samples per second between the progress line at half the demo's training and the line where its
    count last grew (the lines after it are the final evaluation: no samples)."""
    points = [(int(t), int(n)) for t, n in PROGRESS.findall(demo_log)]
    grew = [i for i in range(1, len(points)) if points[i][1] > points[i - 1][1]]
    if not grew:
        return None
    t_end, n_end = points[grew[-1]]
    t_mid, n_mid = next(p for p in points if p[0] >= t_end / 2)
    if t_end <= t_mid:
        return None
    return (n_end - n_mid) / (t_end - t_mid)


def run(command: list[str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Runs `command`, its output into `log`; (exit status, or None when it ran past `timeout_s`; output)."""
    print(f"  {' '.join(command[2:])} ...", flush=True)
    started_s = time.monotonic()
    with log.open("w") as out:
        try:
            status: int | None = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            status = None
    print(f"    exit {status} after {time.monotonic() - started_s:.0f}s", flush=True)
    return status, log.read_text(errors="replace")


def measure(args: argparse.Namespace) -> dict:
    args.workdir.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "swarmtrain.cli.main"]
    common = ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype]
    local_json = args.workdir / "train_local.json"
    status, _ = run(
        [
            *cli,
            "train-local",
            *common,
            "--max-samples",
            str(args.local_samples),
            "--summary-json",
            str(local_json),
        ],
        args.workdir / "train_local.log",
        args.local_timeout_s,
    )
    local = (
        json.loads(local_json.read_text()).get("samples_per_s")
        if status == 0 and local_json.exists()
        else None
    )
    demo = [*cli, "demo", *common, "--replicas", "1", "--no-kill", "--no-reference", "--no-monitor"]
    demo += ["--duration-s", str(args.duration_s), "--workdir", str(args.workdir / "demo")]
    demo += ["--in-flight", str(args.in_flight)] if args.in_flight else []
    status, log = run(demo, args.workdir / "demo.log", args.duration_s + STARTUP_ALLOWANCE_S)
    swarm = steady_rate(log) if status == 0 else None
    return {
        "preset": args.preset,
        "device": args.device,
        "dtype": args.dtype,
        "in_flight": args.in_flight or None,
        "local_samples_per_s": local,
        "swarm_samples_per_s": swarm,
        "swarm_over_local": swarm / local if swarm is not None and local else None,
    }


def describe(result: dict) -> str:
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return (
        f"swarm vs one process, {result['preset']} {result['dtype']} on {result['device']}: "
        f"train-local {num(result['local_samples_per_s'], '.1f')} samples/s, "
        f"demo (one server per stage, {result.get('in_flight') or 'default'} in flight) "
        f"{num(result['swarm_samples_per_s'], '.1f')} samples/s, "
        f"ratio {num(result['swarm_over_local'], '.2f')} (issue 53 asks >= 0.6)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--duration-s", type=int, default=40, help="the demo's training time (default 40)")
    parser.add_argument(
        "--local-samples", type=int, default=2048, help="train-local's samples (default 2048)"
    )
    parser.add_argument("--local-timeout-s", type=float, default=120.0)
    parser.add_argument("--in-flight", type=int, default=0, help="the demo's trainer's (default 0: its own)")
    parser.add_argument("--workdir", type=Path, default=Path("swarm-vs-local"))
    parser.add_argument("--summary-json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(result, indent=2) + "\n")
    print(describe(result), flush=True)
    return 0 if result["swarm_over_local"] is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
