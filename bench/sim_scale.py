"""How long the simulator takes at the scale it exists for: `swarmtrain simulate --num-peers N --model
gpt3-xl --mode swarm --churn preemptible --duration-s 3600`, in this process, one size after another.

    python bench/sim_scale.py [--sizes 1000,10000] [--duration-s 3600] [--seed 0] [--summary-json PATH]

Per size: wall seconds of the whole run (fleet, churn schedule, costs, the run), events processed,
samples/s of the simulated swarm and the fraction of the optimum it reached (what a change to the
simulator must leave equal for the same seed: compare two checkouts' `--summary-json`). Issue 41's
target: 10,000 peers x 1 simulated hour in 60 s or less on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import churn_schedule
from swarmtrain.sim.fleet import synthetic_fleet
from swarmtrain.sim.heap import keep_freed_memory
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

TARGET_10K_S = 60.0


def run_one(num_peers: int, duration_s: float, seed: int) -> dict:
    started_s = time.perf_counter()
    fleet = synthetic_fleet(num_peers, seed)
    schedule = churn_schedule("preemptible", fleet, duration_s, seed)
    config = SimConfig(mode="swarm", duration_s=duration_s, seed=seed)
    summary = run_simulation(fleet, get_preset("gpt3-xl"), config, schedule).summary
    return {"num_peers": num_peers, "wall_s": time.perf_counter() - started_s, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="peers per run, comma-separated")
    parser.add_argument("--duration-s", type=float, default=3600.0, help="simulated seconds (default 3600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary-json", metavar="PATH", help="every run's wall seconds and summary")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes integers separated by commas, got {args.sizes!r}")
    keep_freed_memory()  # as `swarmtrain simulate` does
    runs = []
    for num_peers in sizes:
        print(f"{num_peers} peers x {args.duration_s:.0f} simulated s ...", flush=True)
        runs.append(run_one(num_peers, args.duration_s, args.seed))
    rows = [
        [
            str(r["num_peers"]),
            f"{r['wall_s']:.1f}",
            str(r["summary"].get("events")),
            f"{r['summary'].get('samples_per_s', 0.0):.1f}",
            f"{r['summary'].get('steady_fraction_of_optimal', 0.0):.3f}",
        ]
        for r in runs
    ]
    print(format_table(["peers", "wall s", "events", "samples/s", "of optimal"], rows))
    for r in runs:
        if r["num_peers"] == 10_000 and args.duration_s == 3600.0:
            verdict = "meets" if r["wall_s"] <= TARGET_10K_S else "misses"
            print(f"10,000 peers x 1 h: {r['wall_s']:.1f} s, {verdict} the {TARGET_10K_S:.0f} s target")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(runs, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("sim_scale: interrupted", file=sys.stderr)
        sys.exit(130)
