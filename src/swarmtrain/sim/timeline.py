"""A simulator run as a timeline of swarm snapshots, for `swarmtrain monitor --replay`.

At each of the simulation's sample points (`SimConfig.num_samples` of them) a frame records every
stage's live peers (rate, queue, the stage's step, serving or still downloading its state), the
bottleneck, the trainers' samples/s and the lost and retried work so far, in the shape of the live
monitor's snapshot (`monitor.snapshot.monitor_snapshot`), `time` in simulated seconds. The monitor then
derives joins, leaves, moves and lost work between frames exactly as it does for a live swarm.

The simulator has no loss model: frames carry `loss: None`. Pipeline modes only (SWARM with and without
rebalancing, GPipe): asynchronous replicas have no stages to show.
"""

from __future__ import annotations

from swarmtrain.sim import runner
from swarmtrain.sim.metrics import SimResult
from swarmtrain.sim.swarm import SwarmSimulation

TIMELINE_FORMAT = "swarmtrain-timeline"
TIMELINE_VERSION = 1
TIMELINE_MODES = ("swarm", "swarm-no-rebalance", "gpipe")
SIM_TRAINER_ID = "sim"  # the simulated trainers are shown as one: the simulator counts their samples together


def timeline_document(frames: list[dict], mode: str, duration_s: float, description: str) -> dict:
    """The JSON document `swarmtrain monitor --replay` reads."""
    return {
        "format": TIMELINE_FORMAT,
        "version": TIMELINE_VERSION,
        "mode": mode,
        "duration_s": duration_s,
        "description": description,
        "frames": frames,
    }


def run_with_timeline(
    fleet, run, config, schedule=None, global_batch_size=None
) -> tuple[SimResult, list[dict]]:
    """`runner.run_simulation`, plus a frame at each sample point the metrics recorded (an observer of
    the run: the run itself is unchanged)."""
    if config.mode not in TIMELINE_MODES:
        raise ValueError(
            f"a timeline records the pipeline modes {', '.join(TIMELINE_MODES)}, not {config.mode}"
        )
    frames: list[dict] = []

    def record(sim, now_s: float) -> None:
        frames.append(frame(sim, now_s, sim.metrics.series["samples_per_s"][-1]))

    result = runner.run_simulation(fleet, run, config, schedule, global_batch_size, observer=record)
    return result, frames


def frame(sim, now_s: float, samples_per_s: float) -> dict:
    """One snapshot of a running pipeline simulation."""
    stages = [_stage(sim, s) for s in range(sim.num_stages)]
    metrics = sim.metrics
    counts = metrics.counts
    retries = counts["reroutes"] + counts["timeouts"]  # each sends a micro-batch to another peer
    return {
        "run_id": f"simulation ({sim.config.mode})",
        "digest": None,
        "stages": stages,
        "bottleneck": min(range(len(stages)), key=lambda i: stages[i]["throughput_samples_per_s"]),
        "trainers": [
            {
                "trainer_id": SIM_TRAINER_ID,
                "loss": None,
                "samples_per_s": float(samples_per_s),
                "samples": int(metrics.samples_completed),
                "completed": None,
                "failed": None,
                "retries": retries,
                "timeouts": counts["timeouts"],
            }
        ],
        "replicas": [],
        "servers": [],
        "moves": [],
        "rebalance": _rebalance(sim, samples_per_s),
        "work": {
            "microbatches_completed": None,
            "microbatches_failed": None,
            "retries": retries,
            "samples_lost": float(metrics.samples_lost),
            "state_downloads": counts["joins"] + counts["moves"],
            "duplicates": None,
        },
        "time": float(now_s),
        "source": "simulator",
    }


def _rebalance(sim, samples_per_s: float) -> dict:
    """The policy's settings and the plan it makes now, as `swarmtrain status` shows a live swarm's (the
    simulator plans on its peers' rates alone: they already take the step's exchange off the links)."""
    moving = isinstance(sim, SwarmSimulation) and sim.rebalance
    plan = sim.rebalance_plan() if moving else []
    return {
        "period_s": sim.config.rebalance_period_s if moving else 0.0,
        "margin": sim.config.rebalance_margin,
        "observed_samples_per_s": round(float(samples_per_s), 2),
        "plan": [
            {
                "peer_id": sim.peers[move.peer].spec.peer_id,
                "from": move.from_stage,
                "to": move.to_stage,
                "expected_samples_per_s": round(move.rate_samples_per_s, 2),
            }
            for move in plan
        ],
    }


def _stage(sim, index: int) -> dict:
    # a stage's step: the global batches it has processed (the simulator steps stages on sample counts)
    step = int(sim.steps.stage_samples[index] // sim.costs.global_batch_size)
    peers = []
    for peer in sim.peers:
        if peer.live and peer.stage == index:
            peers.append(
                {
                    "peer_id": peer.spec.peer_id,
                    "throughput_samples_per_s": float(peer.rates[index]),
                    "queue": len(peer.queue) + int(peer.busy),
                    "epoch": step,
                    "state": "online" if peer.serving else "joining",  # joining: downloading the state
                    "same_config": True,
                    "limit": "compute",
                    "addresses": [],
                }
            )
    serving = sum(p["throughput_samples_per_s"] for p in peers if p["state"] == "online")
    return {"index": index, "peers": peers, "throughput_samples_per_s": serving}
