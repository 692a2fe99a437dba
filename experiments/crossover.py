"""Experiment (d): the crossover bandwidth below which asynchronous full replicas beat SWARM.

Model GPT-3 XL (1.3B; 8 stages for SWARM, global batch 4096). Fleet: 128 T4-class peers (25 TFLOP/s
sustained, 16 GB GPU, 64 GB host) 20 ms apart, every access link and path at the swept bandwidth.
Async replicas: each peer trains the whole model, streaming layers from host memory (the 21 GB of
training state do not fit the GPU; PCIe streaming hides behind compute), local steps of 16 samples,
parameters averaged (fp16 butterfly all-reduce, blocking) every H local steps. H = 2 synchronizes as
often as SWARM steps (128 replicas x 2 x 16 = 4096 samples between averaging rounds); H = 20 ten times
less often. Samples/s counts hardware throughput only: the statistical cost of averaging rarely is not
modelled. No churn; SWARM 30 simulated minutes per point, replicas 6 hours (rounds are long).

    python experiments/crossover.py
"""

from __future__ import annotations

import math

import _common as c

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.plotting import _pyplot
from swarmtrain.sim.report import format_table
from swarmtrain.sim.runner import run_simulation

BANDWIDTHS_MBIT_S = (10, 25, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
H_VALUES = (2, 20)
NUM_PEERS = 128
LOCAL_BATCH = 16
GLOBAL_BATCH = 4096
DURATION_S = {"swarm": 1800.0, "async-replicas": 6 * 3600.0}


def throughput(mode: str, mbit_s: float, every: int = 1) -> float:
    fleet = c.device_fleet({"t4": NUM_PEERS}, 0.020, mbit_s * 1e6 / 8)
    config = SimConfig(
        mode=mode,
        duration_s=DURATION_S[mode],
        num_samples=30,
        average_every_steps=every,
        local_batch_samples=LOCAL_BATCH,
    )
    return run_simulation(fleet, get_preset("gpt3-xl"), config, global_batch_size=GLOBAL_BATCH).summary[
        "samples_per_s"
    ]


def crossovers(bandwidths, swarm, replicas) -> list[tuple[float, str]]:
    """Bandwidths (log-interpolated) where the leader changes, with who leads above each."""
    points = []
    for i in range(1, len(bandwidths)):
        before, after = replicas[i - 1] - swarm[i - 1], replicas[i] - swarm[i]
        if (before > 0) != (after > 0):
            t = before / (before - after)
            log_b = math.log(bandwidths[i - 1]) + t * (math.log(bandwidths[i]) - math.log(bandwidths[i - 1]))
            points.append((math.exp(log_b), "async replicas" if after > 0 else "swarm"))
    return points


def main() -> None:
    swarm = [throughput("swarm", b) for b in BANDWIDTHS_MBIT_S]
    replicas = {h: [throughput("async-replicas", b, h) for b in BANDWIDTHS_MBIT_S] for h in H_VALUES}
    table = [[b, swarm[i], *(replicas[h][i] for h in H_VALUES)] for i, b in enumerate(BANDWIDTHS_MBIT_S)]
    c.say(
        f"SWARM vs async full replicas: GPT-3 XL, {NUM_PEERS} x T4, 20 ms, batch {GLOBAL_BATCH}, local steps of {LOCAL_BATCH}"
    )
    c.say(format_table(["Mb/s", "swarm/s", *(f"async H={h}/s" for h in H_VALUES)], table))
    points = {}
    for h in H_VALUES:
        points[h] = crossovers(BANDWIDTHS_MBIT_S, swarm, replicas[h])
        where = (
            "; ".join(f"{b:.0f} Mb/s ({who} leads above)" for b, who in points[h])
            or "none in the swept range"
        )
        c.say(f"crossovers, async H={h} vs SWARM: {where}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(BANDWIDTHS_MBIT_S, swarm, "o-", label="SWARM (8 stages)")
    for h in H_VALUES:
        ax.plot(BANDWIDTHS_MBIT_S, replicas[h], "s--", label=f"async replicas, average every {h} steps")
        for b, _ in points[h]:
            ax.axvline(b, color="gray", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth per direction (Mb/s)")
    ax.set_ylabel("samples/s (hardware throughput)")
    ax.set_title("Where full replicas with swapping beat SWARM")
    ax.legend(fontsize=8)
    c.save_outputs(
        "crossover",
        fig,
        {
            "bandwidth_mbit_s": BANDWIDTHS_MBIT_S,
            "swarm": swarm,
            "replicas": {str(h): v for h, v in replicas.items()},
            "crossovers_mbit_s": {str(h): p for h, p in points.items()},
        },
    )


if __name__ == "__main__":
    main()
