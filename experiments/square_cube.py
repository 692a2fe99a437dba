"""Experiment (a): the square-cube law. GPU utilization vs hidden size at 500 Mb/s, 0 and 100 ms latency.

Setup (SWARM paper, section 3.1 style): a pipeline of 4 stages, one transformer layer per stage
(d_ff = 4d, sequence 2048, 8-bit activations), one T4-class peer (25 TFLOP/s sustained, 16 GB: the d=12288 layer streams from host memory) per stage,
every link 500 Mb/s per direction and the given one-way latency between any two machines; one trainer
keeps 8 micro-batches of 1 sample in flight. Utilization = busy compute time / wall time of the
stage peers, averaged over stages, second half of a 10-minute simulated run.

    python experiments/square_cube.py
"""

from __future__ import annotations

import _common as c

from swarmtrain.config import sizes
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.plotting import _pyplot
from swarmtrain.sim.report import format_table, human_bytes
from swarmtrain.sim.runner import costs_for, run_simulation

HIDDEN_SIZES = (768, 1024, 2048, 4096, 8192, 12288)  # BERT-base ... GPT-3
LATENCIES_MS = (0, 100)
BANDWIDTH_BYTES_PER_S = 500e6 / 8
NUM_STAGES = 4
IN_FLIGHT = 8
DURATION_S = 600.0


def utilization(d_model: int, latency_ms: float) -> float:
    run = c.run_config(c.layer_model(d_model, NUM_STAGES, seq_len=2048), NUM_STAGES)
    fleet = c.device_fleet({"t4": NUM_STAGES}, latency_ms / 1e3, BANDWIDTH_BYTES_PER_S)
    config = SimConfig(
        duration_s=DURATION_S, chunk_samples=1, in_flight=IN_FLIGHT, num_trainers=1, num_samples=20
    )
    result = run_simulation(fleet, run, config)
    utils = result.series["utilization"][len(result.series["utilization"]) // 2 :]
    return sum(sum(u) / len(u) for u in utils) / len(utils)


def main() -> None:
    rows, table = [], []
    for d in HIDDEN_SIZES:
        model = c.layer_model(d, NUM_STAGES, seq_len=2048)
        costs = costs_for(c.run_config(model, NUM_STAGES))
        util = {ms: utilization(d, ms) for ms in LATENCIES_MS}
        flops = sizes.stage_training_flops_per_sample(model, c.run_config(model, NUM_STAGES).stages()[1])
        rows.append(
            {
                "d_model": d,
                "utilization": util,
                "flops_per_sample": flops,
                "activation_bytes": costs.activation_bytes_per_sample,
            }
        )
        table.append(
            [
                d,
                f"{sizes.params_per_layer(model) / 1e6:.1f}M",
                f"{flops / 1e12:.2f}",
                human_bytes(costs.activation_bytes_per_sample),
                *(f"{100 * util[ms]:.1f}%" for ms in LATENCIES_MS),
            ]
        )
    c.say("Square-cube law: 4-stage pipeline, 1 layer per stage, T4-class peers, 500 Mb/s, 8-bit activations")
    c.say(
        format_table(
            [
                "d_model",
                "params/layer",
                "TFLOP/sample/stage",
                "activation/sample",
                *(f"util @{ms} ms" for ms in LATENCIES_MS),
            ],
            table,
        )
    )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for ms in LATENCIES_MS:
        ax.plot(HIDDEN_SIZES, [100 * r["utilization"][ms] for r in rows], "o-", label=f"{ms} ms latency")
    ax.set_xscale("log", base=2)
    ax.set_xticks(HIDDEN_SIZES, [str(d) for d in HIDDEN_SIZES])
    ax.set_xlabel("hidden size d_model (one layer per stage, seq 2048)")
    ax.set_ylabel("GPU utilization (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Square-cube law at 500 Mb/s: utilization grows with model size")
    ax.legend()
    c.save_outputs("square_cube", fig, {"rows": rows})


if __name__ == "__main__":
    main()
