"""Experiment (b): SWARM vs fixed GPipe pipelines as latency grows.

Setup: GPT-3 XL (1.3B, 8 stages), a fleet of 64 peers in one region (16 V100-class and 48 T4-class,
1 Gb/s per direction each), the same one-way latency between any two machines, no churn, global batch
4096 samples. SWARM: stage swarms with per-trainer IWRR routing (stochastic wiring) and micro-batches
in flight sized for the round trip. GPipe: 8 fixed pipelines of 8 peers (fastest peers grouped
together, the heaviest stage on the fastest), M = 4S = 32 simulated micro-batches (of 3 samples) per
step and a flush, so the pipeline bubble and the latency of every hop are paid each step. 20 simulated
minutes per point.

    python experiments/swarm_vs_pipelines.py
"""

from __future__ import annotations

import _common as c

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.plotting import _pyplot
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

LATENCIES_MS = (0, 10, 25, 50, 100, 200, 300)
FLEET = {"v100": 16, "t4": 48}
BANDWIDTH_BYTES_PER_S = 1e9 / 8
GLOBAL_BATCH = 4096
DURATION_S = 1200.0


def simulate(mode: str, latency_ms: float) -> dict:
    fleet = c.device_fleet(FLEET, latency_ms / 1e3, BANDWIDTH_BYTES_PER_S)
    config = SimConfig(mode=mode, duration_s=DURATION_S, num_samples=40)
    return run_simulation(fleet, get_preset("gpt3-xl"), config, global_batch_size=GLOBAL_BATCH).summary


def main() -> None:
    rows = []
    for ms in LATENCIES_MS:
        swarm, gpipe = simulate("swarm", ms), simulate("gpipe", ms)
        rows.append({"latency_ms": ms, "swarm": swarm, "gpipe": gpipe})
    table = [
        [
            r["latency_ms"],
            r["swarm"]["optimal_samples_per_s"],
            r["swarm"]["samples_per_s"],
            r["gpipe"]["samples_per_s"],
            r["swarm"]["samples_per_s"] / r["gpipe"]["samples_per_s"],
            r["swarm"]["steady_fraction_of_optimal"],
            r["gpipe"]["steady_fraction_of_optimal"],
        ]
        for r in rows
    ]
    c.say(
        f"SWARM vs fixed pipelines, GPT-3 XL, {c.device_fleet(FLEET).description}, 1 Gb/s, batch {GLOBAL_BATCH}"
    )
    c.say(
        format_table(
            ["latency ms", "optimal/s", "swarm/s", "gpipe/s", "swarm/gpipe", "swarm frac", "gpipe frac"],
            table,
        )
    )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        LATENCIES_MS, [r["swarm"]["optimal_samples_per_s"] for r in rows], "k--", label="optimal (static)"
    )
    ax.plot(LATENCIES_MS, [r["swarm"]["samples_per_s"] for r in rows], "o-", label="SWARM")
    ax.plot(LATENCIES_MS, [r["gpipe"]["samples_per_s"] for r in rows], "s-", label="GPipe (fixed pipelines)")
    ax.set_xlabel("one-way latency between peers (ms)")
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_ylim(bottom=0)
    ax.set_title("GPT-3 XL on 64 heterogeneous peers at 1 Gb/s")
    ax.legend()
    c.save_outputs("swarm_vs_pipelines", fig, {"rows": rows})


if __name__ == "__main__":
    main()
