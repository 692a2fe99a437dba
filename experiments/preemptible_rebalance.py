"""Experiment (c): a preemptible fleet with and without rebalancing, as a fraction of optimal throughput.

Fleet: 256 spot GPUs (10% A100, 30% V100, 60% T4 class) in the 8 cities of the `world-wide` scenario,
GPT-3 XL in 8 stages, global batch 8192, 3 simulated hours of the `preemptible` churn model (spot
instances live ~6 h; batch reclaims every ~20 min take 30-100% of one pool = one device type in one
city; replacements join 2 + ~8 min later). Two placements of the same machines:
- interleaved: peers start at the best static allocation (each stage has peers from every city);
- regional: the same allocation, but each stage's peers are in one city (what a latency-aware
  placement does so that a stage's all-reduce stays local), so a pool reclaim hits one stage.
`swarm` rebalances every 60 s (policy `planner.rebalance`, hysteresis 10%, a move costs the target
stage's state download); `swarm-no-rebalance` sends replacements back to their home stage.

    python experiments/preemptible_rebalance.py
"""

from __future__ import annotations

from dataclasses import replace

import _common as c

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import churn_schedule
from swarmtrain.sim.costs import compute_s_per_sample, rate_table
from swarmtrain.sim.entities import Fleet
from swarmtrain.sim.fleet import synthetic_fleet
from swarmtrain.sim.optimal import optimal_allocation
from swarmtrain.sim.plotting import _pyplot
from swarmtrain.sim.report import format_table, human_bytes
from swarmtrain.sim.runner import costs_for, run_simulation

MIX = {"a100": 0.10, "v100": 0.30, "t4": 0.60}
NUM_PEERS = 256
GLOBAL_BATCH = 8192
DURATION_S = 3 * 3600.0
MODES = ("swarm", "swarm-no-rebalance")


def regional(fleet: Fleet, run) -> Fleet:
    """Same machines; each stage of the best allocation lives in one city (city i = stage i)."""
    costs = costs_for(run, GLOBAL_BATCH)
    table = rate_table(list(fleet.peers), [compute_s_per_sample(p, costs) for p in fleet.peers])
    stage_of = optimal_allocation(table, costs).stage_of.tolist()
    peers = tuple(
        replace(p, location=s if s >= 0 else p.location, home_stage=s if s >= 0 else None)
        for p, s in zip(fleet.peers, stage_of, strict=True)
    )
    return Fleet(peers, fleet.locations, fleet.description + ", one stage per city")


def main() -> None:
    run = get_preset("gpt3-xl")
    base = synthetic_fleet(NUM_PEERS, seed=0, mix=MIX)
    fleets = {"interleaved": base, "regional": regional(base, run)}
    results, table = {}, []
    for placement, fleet in fleets.items():
        schedule = churn_schedule("preemptible", fleet, DURATION_S, seed=0)
        for mode in MODES:
            config = SimConfig(mode=mode, duration_s=DURATION_S, chunk_samples=32, num_samples=72)
            result = run_simulation(fleet, run, config, schedule, GLOBAL_BATCH)
            results[(placement, mode)] = result
            s = result.summary
            table.append(
                [
                    placement,
                    mode,
                    s["samples_per_s"],
                    s["optimal_samples_per_s"],
                    s["fraction_of_optimal"],
                    s["failures"],
                    s["joins"],
                    s["moves"],
                    human_bytes(s["bytes_by_kind"]["state"]),
                    int(s["samples_lost"]),
                ]
            )
    c.say(f"Preemptible fleet: {base.description}; GPT-3 XL, batch {GLOBAL_BATCH}, {DURATION_S / 3600:g} h")
    c.say(
        format_table(
            [
                "placement",
                "mode",
                "samples/s",
                "optimal/s",
                "fraction",
                "failures",
                "joins",
                "moves",
                "state moved",
                "lost",
            ],
            table,
        )
    )
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for (placement, mode), result in results.items():
        series = result.series
        frac = [
            a / o if o else 0.0
            for a, o in zip(series["samples_per_s"], series["optimal_samples_per_s"], strict=True)
        ]
        style = "-" if mode == "swarm" else "--"
        ax.plot([t / 3600 for t in series["time_s"]], frac, style, lw=1.3, label=f"{placement}, {mode}")
    ax.set_ylabel("fraction of optimal throughput")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Spot fleet under batch reclaims: with and without rebalancing")
    for placement in fleets:
        series = results[(placement, "swarm")].series
        ax2.plot(
            [t / 3600 for t in series["time_s"]],
            series["live_peers"],
            lw=1.2,
            label=f"live peers ({placement})",
        )
    ax2.set_ylabel("live peers")
    ax2.set_xlabel("simulated time (h)")
    ax2.legend(fontsize=8)
    c.save_outputs("preemptible_rebalance", fig, {f"{p}/{m}": r.summary for (p, m), r in results.items()})


if __name__ == "__main__":
    main()
