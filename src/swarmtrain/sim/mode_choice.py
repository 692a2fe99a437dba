"""Which mode for this fleet: SWARM or asynchronous full replicas, and with which H?

`choose_mode` simulates SWARM (with rebalancing) and async full replicas averaging every H local steps
for each H of `h_values`, on the same fleet, model and churn, and recommends one, with plain-English
reasons computed from the fleet and the cost model (`sim.costs`): memory (does the whole model's
training state fit a peer's host memory? its GPU, or must it swap layers?), bandwidth (median link
against SWARM's activation bytes per sample and a replica's averaging bytes per round) and device speed.

The rule, in two steps:
- H: simulated samples/s count *hardware* throughput only. Averaging less often usually costs some
  per-sample efficiency (the replicas drift apart), which is not modelled, so the recommended H is the
  smallest whose throughput is within `h_tolerance` (10%) of the best replica throughput;
- mode: replicas at that H are recommended only if they beat SWARM by `replica_margin` (10%) or more:
  SWARM keeps one synchronous model (no statistical cost), so a near tie goes to SWARM.

Simulated durations: SWARM runs `sim_base_config.duration_s` (600 s by default; short and coarse, which
slightly underestimates SWARM, see `runner`). A replica round is H local steps plus one blocking
all-reduce; each replica candidate runs a whole number (>= `min_rounds`) of the median replica's rounds,
at least `duration_s`, so that a round cut off by the end of the run does not bias the comparison
between values of H (exact for identical peers).

`crossover_bandwidth` sweeps a fleet's bandwidth and returns where replicas and SWARM swap the lead
(log-interpolated, as experiments/crossover.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from statistics import fmean, median
from typing import Any

from swarmtrain.config import RunConfig, sizes
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import churn_schedule
from swarmtrain.sim.costs import StageCosts, compute_s_per_sample, full_model_s_per_sample
from swarmtrain.sim.entities import Fleet
from swarmtrain.sim.fleet import FleetError
from swarmtrain.sim.report import human_bytes
from swarmtrain.sim.runner import costs_for, run_simulation

DEFAULT_H_VALUES = (1, 2, 5, 10, 20, 50, 100)
DEFAULT_H_TOLERANCE = 0.10  # an H within 10% of the best replica throughput counts as good as the best
DEFAULT_REPLICA_MARGIN = 0.10  # replicas must beat SWARM by 10% to be recommended
DEFAULT_MIN_ROUNDS = 20  # averaging rounds simulated per replica candidate (median replica)
DEFAULT_BASE_CONFIG = SimConfig(mode="swarm", duration_s=600.0, event_budget=300_000, num_samples=30)
DEFAULT_BANDWIDTHS_MBIT_S = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)
SYNC_KINDS = ("activations", "gradients", "averaging")  # not: input tokens, state downloads after joins
SWARM, REPLICAS = "swarm", "async-replicas"


@dataclass(frozen=True)
class Candidate:
    """One simulated option. `sync_bytes_per_sample`: bytes the whole fleet sends per trained sample
    (SWARM: boundary activations and gradients plus each stage's gradient averaging; replicas: parameter
    averaging; not input tokens or state downloads after joins); None when nothing was trained."""

    mode: str
    h: int | None
    samples_per_s: float
    sync_bytes_per_sample: float | None
    simulated_s: float
    serving_peers: float
    samples_lost: float = 0.0  # trained, then lost with a failed peer's un-averaged work (churn)
    kept_samples_per_s: float = 0.0  # (samples - lost) / simulated_s: what the choice compares


@dataclass(frozen=True)
class FleetFacts:
    """What the reasons are computed from (bytes, bytes/s, seconds; medians over peers)."""

    num_peers: int
    num_stages: int
    replica_memory_bytes: float  # whole model training state + activations of one micro-batch
    largest_host_memory_bytes: float
    replica_capable_peers: int  # host memory holds the whole model (or measured whole-model times)
    replica_swapping_peers: int  # ... of which the GPU cannot hold it: layer swapping
    replica_swap_bound_peers: int  # ... of which PCIe streaming is slower than compute
    stage_memory_bytes: float  # the largest SWARM stage
    stage_gpu_peers: int  # peers whose GPU holds the largest stage
    stage_capable_peers: int  # peers that can serve at least one stage
    median_link_bytes_per_s: float  # a peer's own link: min(uplink, downlink)
    median_path_bytes_per_s: float  # per-flow path cap from a peer to the others (inf: none)
    median_tflops: float
    activation_bytes_per_sample: float  # one stage boundary, one direction, at the configured compression
    swarm_link_samples_per_s: float  # what the median own link carries at the busiest stage
    swarm_compute_samples_per_s: float  # what the median peer computes at a mean stage
    global_batch_size: int
    stage_averaging_bytes: float  # the largest stage's fp16 gradients: its all-reduce payload
    swarm_averaging_cap_samples_per_s: float  # fleet-wide: the median link just carries the averaging
    replica_compute_s_per_sample: float  # median replica, swapping included
    replica_flops_s_per_sample: float  # median replica, compute alone
    local_batch_samples: int
    averaging_bytes_per_round: float  # per replica and direction
    averaging_s_per_round: float  # at the median replica link


@dataclass(frozen=True)
class ModeChoice:
    recommended_mode: str  # "swarm" or "async-replicas"
    recommended_h: int | None  # None when SWARM is recommended
    candidates: tuple[Candidate, ...]  # SWARM first, then replicas by increasing H
    reasons: tuple[str, ...]
    facts: FleetFacts
    h_tolerance: float
    replica_margin: float

    @property
    def swarm(self) -> Candidate:
        return self.candidates[0]

    @property
    def replicas(self) -> dict[int, Candidate]:
        return {c.h: c for c in self.candidates if c.h is not None}

    def to_dict(self) -> dict:
        return {
            "recommended_mode": self.recommended_mode,
            "recommended_h": self.recommended_h,
            "candidates": [asdict(c) for c in self.candidates],
            "reasons": list(self.reasons),
            "facts": asdict(self.facts),
            "h_tolerance": self.h_tolerance,
            "replica_margin": self.replica_margin,
        }


# the rule -------------------------------------------------------------------------------------------
def smallest_good_h(throughputs: Mapping[int, float], h_tolerance: float = DEFAULT_H_TOLERANCE) -> int | None:
    """The smallest H whose samples/s is within `h_tolerance` of the best; None if none trains at all."""
    best = max(throughputs.values(), default=0.0)
    if best <= 0:
        return None
    return min(h for h, v in throughputs.items() if v >= (1 - h_tolerance) * best)


def recommend(
    swarm_samples_per_s: float,
    replica_samples_per_s: Mapping[int, float],
    h_tolerance: float = DEFAULT_H_TOLERANCE,
    replica_margin: float = DEFAULT_REPLICA_MARGIN,
) -> tuple[str, int | None]:
    """(mode, H): replicas at the smallest good H if they beat SWARM by `replica_margin`, else (SWARM, None)."""
    h = smallest_good_h(replica_samples_per_s, h_tolerance)
    if h is not None and replica_samples_per_s[h] >= (1 + replica_margin) * swarm_samples_per_s:
        return REPLICAS, h
    return SWARM, None


def _check_rule(h_values: Sequence[int], h_tolerance: float, replica_margin: float) -> tuple[int, ...]:
    values = tuple(sorted(set(h_values)))
    if not values or any(not isinstance(h, int) or h < 1 for h in values):
        raise ValueError(f"h_values must be positive integers, got {list(h_values)}")
    if not 0 <= h_tolerance < 1:
        raise ValueError(f"h_tolerance must be in [0, 1), got {h_tolerance}")
    if replica_margin < 0:
        raise ValueError(f"replica_margin must be >= 0, got {replica_margin}")
    return values


def _check_rounds(min_rounds: int) -> None:
    if min_rounds < 1:
        raise ValueError(f"min_rounds must be >= 1, got {min_rounds}")


# simulation ---------------------------------------------------------------------------------------
def _base(config: SimConfig | None) -> SimConfig:
    return config or DEFAULT_BASE_CONFIG


def _local_batch(config: SimConfig, costs: StageCosts) -> int:
    """Samples per local step of a replica: the config's, else what `runner.build` derives."""
    return config.local_batch_samples or max(costs.micro_batch_size, costs.global_batch_size // 16)


def _candidate(mode: str, h: int | None, result, duration_s: float) -> Candidate:
    s = result.summary
    sync = sum(s["bytes_by_kind"][k] for k in SYNC_KINDS)
    return Candidate(
        mode=mode,
        h=h,
        samples_per_s=float(s["samples_per_s"]),
        sync_bytes_per_sample=sync / s["samples"] if s["samples"] > 0 else None,
        simulated_s=duration_s,
        serving_peers=float(s["mean_serving_peers"]),
        samples_lost=float(s["samples_lost"]),
        kept_samples_per_s=max(0.0, s["samples"] - s["samples_lost"]) / duration_s,
    )


def _replica_cycle_s(
    fleet: Fleet, costs: StageCosts, local: int, h: int, bytes_per_param: float = sizes.FP16_BYTES
) -> float | None:
    """Median over replica-capable peers of one round: H local steps plus the blocking all-reduce."""
    step = [full_model_s_per_sample(p, costs) for p in fleet.peers]
    capable = [i for i, s in enumerate(step) if math.isfinite(s)]
    if not capable:
        return None
    n = len(capable)
    per_peer = 2 * costs.model_params * bytes_per_param * (n - 1) / n
    cycles = []
    for i in capable:
        p = fleet.peers[i]
        cycles.append(h * local * step[i] + per_peer / min(p.uplink_bytes_per_s, p.downlink_bytes_per_s))
    return median(cycles)


def simulate_swarm(
    fleet: Fleet,
    run_cfg: RunConfig,
    sim_base_config: SimConfig | None = None,
    global_batch_size: int | None = None,
    churn: str = "none",
) -> Candidate:
    config = replace(_base(sim_base_config), mode=SWARM)
    schedule = churn_schedule(churn, fleet, config.duration_s, config.seed)
    result = run_simulation(fleet, run_cfg, config, schedule, global_batch_size)
    return _candidate(SWARM, None, result, config.duration_s)


def simulate_replicas(
    fleet: Fleet,
    run_cfg: RunConfig,
    h: int,
    sim_base_config: SimConfig | None = None,
    global_batch_size: int | None = None,
    churn: str = "none",
    min_rounds: int = DEFAULT_MIN_ROUNDS,
) -> Candidate:
    """Async replicas averaging every `h` local steps, for a whole number of the median replica's rounds."""
    _check_rounds(min_rounds)
    base = _base(sim_base_config)
    costs = costs_for(run_cfg, global_batch_size)
    local = _local_batch(base, costs)
    cycle = _replica_cycle_s(fleet, costs, local, h, base.replica_averaging_bytes_per_param)
    if cycle is None:  # nobody can hold the whole model: nothing to simulate
        return Candidate(REPLICAS, h, 0.0, None, 0.0, 0.0, 0.0, 0.0)
    duration = max(min_rounds, math.ceil(base.duration_s / cycle)) * cycle if cycle > 0 else base.duration_s
    config = replace(
        base, mode=REPLICAS, duration_s=duration, average_every_steps=h, local_batch_samples=local
    )
    schedule = churn_schedule(churn, fleet, duration, config.seed)
    result = run_simulation(fleet, run_cfg, config, schedule, global_batch_size)
    return _candidate(REPLICAS, h, result, duration)


# facts and reasons -------------------------------------------------------------------------------
def fleet_facts(
    fleet: Fleet,
    run_cfg: RunConfig,
    sim_base_config: SimConfig | None = None,
    global_batch_size: int | None = None,
) -> FleetFacts:
    costs = costs_for(run_cfg, global_batch_size)
    peers = fleet.peers
    if not peers:
        raise FleetError("the fleet has no peers")
    need = float(sum(costs.train_memory_bytes))
    full = [full_model_s_per_sample(p, costs) for p in peers]
    capable = [i for i, s in enumerate(full) if math.isfinite(s)]
    flops_s = [costs.model_flops_per_sample / (p.tflops * 1e12) for p in peers]
    swapping = [i for i in capable if not peers[i].compute_s_per_sample and need > peers[i].memory_bytes]
    swap_bound = [i for i in swapping if full[i] > flops_s[i] * (1 + 1e-9)]
    stage_need = max(costs.train_memory_bytes)
    per_stage = [compute_s_per_sample(p, costs) for p in peers]
    stage_capable = [i for i, t in enumerate(per_stage) if any(math.isfinite(v) for v in t)]
    mean_stage_s = [fmean(v for v in per_stage[i] if math.isfinite(v)) for i in stage_capable]
    links = [min(p.uplink_bytes_per_s, p.downlink_bytes_per_s) for p in peers]
    paths = _median_path_caps(fleet)
    act = costs.activation_bytes_per_sample
    link_need = max(
        max(costs.up_bytes_per_sample(s), costs.down_bytes_per_sample(s)) for s in range(costs.num_stages)
    )
    n_rep = len(capable)
    avg_bytes = 2 * costs.model_params * sizes.FP16_BYTES * ((n_rep - 1) / n_rep if n_rep > 1 else 0.0)
    rep_links = [links[i] for i in capable]
    median_link = median(links)
    return FleetFacts(
        num_peers=len(peers),
        num_stages=costs.num_stages,
        replica_memory_bytes=need,
        largest_host_memory_bytes=max(p.host_memory_bytes for p in peers),
        replica_capable_peers=n_rep,
        replica_swapping_peers=len(swapping),
        replica_swap_bound_peers=len(swap_bound),
        stage_memory_bytes=float(stage_need),
        stage_gpu_peers=sum(1 for p in peers if stage_need <= p.memory_bytes),
        stage_capable_peers=len(stage_capable),
        median_link_bytes_per_s=median_link,
        median_path_bytes_per_s=median(paths[p.location] for p in peers),
        median_tflops=median(p.tflops for p in peers),
        activation_bytes_per_sample=act,
        swarm_link_samples_per_s=median_link / link_need,
        swarm_compute_samples_per_s=1 / median(mean_stage_s) if mean_stage_s else 0.0,
        global_batch_size=costs.global_batch_size,
        stage_averaging_bytes=max(costs.averaging_bytes),
        swarm_averaging_cap_samples_per_s=median_link
        * costs.global_batch_size
        / (2 * max(costs.averaging_bytes)),
        replica_compute_s_per_sample=median(full[i] for i in capable) if capable else math.inf,
        replica_flops_s_per_sample=median(flops_s[i] for i in capable) if capable else median(flops_s),
        local_batch_samples=_local_batch(_base(sim_base_config), costs),
        averaging_bytes_per_round=avg_bytes,
        averaging_s_per_round=avg_bytes / median(rep_links) if rep_links else math.inf,
    )


def _median_path_caps(fleet: Fleet) -> list[float]:
    """For each location: the median per-flow path cap from one of its peers to every other peer."""
    counts = [0] * len(fleet.locations.names)
    for p in fleet.peers:
        counts[p.location] += 1
    out = []
    for a, row in enumerate(fleet.locations.bandwidth_bytes_per_s):
        weights = [c - (b == a) for b, c in enumerate(counts)]
        pairs = sorted((cap, w) for cap, w in zip(row, weights, strict=True) if w > 0)
        total, acc, value = sum(w for _, w in pairs), 0, math.inf
        for cap, w in pairs:
            acc += w
            if 2 * acc >= total:
                value = cap
                break
        out.append(value)
    return out


def _mbit(bytes_per_s: float) -> str:
    mbit = bytes_per_s * 8 / 1e6
    return f"{mbit / 1000:.3g} Gb/s" if mbit >= 1000 else f"{mbit:.3g} Mb/s"


def _rate(v: float) -> str:
    return f"{v:,.0f} samples/s" if v >= 100 else f"{v:.3g} samples/s"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def fleet_reasons(f: FleetFacts) -> list[str]:
    """Memory, device speed and bandwidth, from the cost model alone (no simulation)."""
    reasons = [_memory_reason(f), _swapping_reason(f), _speed_reason(f), _swarm_link_reason(f)]
    reasons.append(
        f"averaging (SWARM): each stage all-reduces its fp16 gradients (up to "
        f"{human_bytes(f.stage_averaging_bytes)}, about twice that each way per peer) once per global batch "
        f"of {f.global_batch_size} samples, which alone caps SWARM at "
        f"{_rate(f.swarm_averaging_cap_samples_per_s)} at the median link, however many peers it has"
    )
    if f.replica_capable_peers > 1:
        reasons.append(_replica_link_reason(f))
    return [r for r in reasons if r]


def _memory_reason(f: FleetFacts) -> str:
    need = (
        f"memory: a full replica needs {human_bytes(f.replica_memory_bytes)} of training state (fp32 "
        f"parameters, gradients, Adam moments, activations); "
    )
    if f.replica_capable_peers == 0:
        return need + (
            f"no peer's host memory holds it (largest {human_bytes(f.largest_host_memory_bytes)}), so async "
            f"replicas are impossible; SWARM splits it into {f.num_stages} stages of at most "
            f"{human_bytes(f.stage_memory_bytes)}"
        )
    idle = f.num_peers - f.replica_capable_peers
    return need + (
        f"{f.replica_capable_peers} of {f.num_peers} peers hold it in host memory and can be replicas"
        + (f" ({idle} would idle)" if idle else "")
    )


def _swapping_reason(f: FleetFacts) -> str:
    """Whether replicas stream their layers from host memory ("": no replica-capable peer)."""
    if f.replica_swapping_peers:
        bound = (
            f"PCIe streaming is the bottleneck on {f.replica_swap_bound_peers} of them "
            f"({f.replica_compute_s_per_sample:.3g} s per sample instead of {f.replica_flops_s_per_sample:.3g} s "
            f"of compute on the median replica)"
            if f.replica_swap_bound_peers
            else "the streaming hides behind compute"
        )
        return (
            f"swapping: the whole model does not fit the GPU of {f.replica_swapping_peers} replica-capable "
            f"peers, so they stream fp16 weights from host memory for every micro-batch; {bound}; a SWARM "
            f"stage ({human_bytes(f.stage_memory_bytes)}) fits the GPU of {f.stage_gpu_peers} of {f.num_peers} peers"
        )
    if f.replica_capable_peers:
        return "swapping: every replica-capable peer holds the whole model on its GPU (no layer swapping)"
    return ""


def _speed_reason(f: FleetFacts) -> str:
    swarm = f"a SWARM peer computes {_rate(f.swarm_compute_samples_per_s)} at a mean stage"
    if not f.replica_capable_peers:
        return f"device speed: median {f.median_tflops:.3g} TFLOP/s sustained; {swarm}"
    step_s = f.local_batch_samples * f.replica_compute_s_per_sample
    return (
        f"device speed: median {f.median_tflops:.3g} TFLOP/s sustained; a replica computes one sample in "
        f"{f.replica_compute_s_per_sample:.3g} s, a local step of {f.local_batch_samples} samples in "
        f"{step_s:.3g} s; {swarm}"
    )


def _swarm_link_reason(f: FleetFacts) -> str:
    bound = "link-bound" if f.swarm_link_samples_per_s < f.swarm_compute_samples_per_s else "compute-bound"
    paths = (
        f" (paths between locations cap each transfer at a median {_mbit(f.median_path_bytes_per_s)}, "
        "which slows a hop but not a peer's total over parallel transfers)"
        if f.median_path_bytes_per_s < f.median_link_bytes_per_s
        else ""
    )
    return (
        f"bandwidth (SWARM): median peer link {_mbit(f.median_link_bytes_per_s)}{paths}; a stage boundary "
        f"carries {human_bytes(f.activation_bytes_per_sample)} per sample each way, so a middle-stage peer's "
        f"link carries at most {_rate(f.swarm_link_samples_per_s)} against {_rate(f.swarm_compute_samples_per_s)} "
        f"of compute: SWARM peers are {bound}"
    )


def _replica_link_reason(f: FleetFacts) -> str:
    step_s = f.local_batch_samples * f.replica_compute_s_per_sample
    share = {h: f.averaging_s_per_round / (h * step_s + f.averaging_s_per_round) for h in (1, 10, 100)}
    return (
        f"bandwidth (replicas): one averaging round moves {human_bytes(f.averaging_bytes_per_round)} each way "
        f"per replica (fp16 butterfly all-reduce), {f.averaging_s_per_round:.3g} s at the median replica "
        f"link vs {step_s:.3g} s per local step: averaging takes "
        + " / ".join(f"{100 * v:.2g}%" for v in share.values())
        + " of a replica's time at H = "
        + " / ".join(str(h) for h in share)
    )


def decision_reasons(
    swarm: Candidate,
    replicas: Mapping[int, Candidate],
    h: int | None,
    recommended: str,
    h_tolerance: float,
    replica_margin: float,
) -> list[str]:
    out = []
    if h is None:
        out.append("decision: no replica trains (0 samples/s at every H): SWARM")
        return out
    best_h = max(replicas, key=lambda k: (replicas[k].kept_samples_per_s, -k))
    best = replicas[best_h].kept_samples_per_s
    chosen = replicas[h].kept_samples_per_s
    out.append(
        f"H: samples/s count hardware throughput only; averaging less often usually costs per-sample "
        f"efficiency, which is not modelled, so H is the smallest within {_pct(h_tolerance)} of the best "
        f"replica throughput: H={h} ({_rate(chosen)}; best {_rate(best)} at H={best_h})"
    )
    swarm_rate = swarm.kept_samples_per_s
    if swarm_rate <= 0:
        versus = "SWARM trains nothing"
    elif chosen >= 2 * swarm_rate:
        versus = f"{chosen / swarm_rate:.3g}x SWARM"
    else:
        versus = f"{chosen / swarm_rate - 1:+.0%}"
    out.append(
        f"decision: replicas with H={h} give {_rate(chosen)} vs SWARM's {_rate(swarm_rate)} ({versus}); "
        f"replicas must beat SWARM by {_pct(replica_margin)} (SWARM keeps one synchronous model): "
        + ("async replicas" if recommended == REPLICAS else "SWARM")
    )
    if recommended == SWARM:
        better = [
            k
            for k in sorted(replicas)
            if replicas[k].kept_samples_per_s >= (1 + replica_margin) * swarm.kept_samples_per_s
        ]
        if better:
            k = better[0]
            out.append(
                f"note: replicas averaging only every {k} local steps would reach "
                f"{_rate(replicas[k].kept_samples_per_s)}; worth it only if averaging that rarely is known not to "
                f"hurt convergence"
            )
    return out


def choose_mode(
    fleet: Fleet,
    run_cfg: RunConfig,
    sim_base_config: SimConfig | None = None,
    h_values: Sequence[int] = DEFAULT_H_VALUES,
    global_batch_size: int | None = None,
    h_tolerance: float = DEFAULT_H_TOLERANCE,
    replica_margin: float = DEFAULT_REPLICA_MARGIN,
    churn: str = "none",
    min_rounds: int = DEFAULT_MIN_ROUNDS,
) -> ModeChoice:
    """Simulate SWARM and async replicas at each H of `h_values`; recommend one (see the module docstring).

    `sim_base_config` carries the seed, SWARM's simulated duration and knobs (event budget, in flight,
    trainers, variability) and the replicas' `local_batch_samples`; its mode and `average_every_steps`
    are ignored. `churn` names a churn model (`sim.churn.CHURN_MODELS`), drawn for each candidate's
    duration with the config's seed. Raises FleetError if neither mode can train on the fleet."""
    values = _check_rule(h_values, h_tolerance, replica_margin)
    base = _base(sim_base_config)
    facts = fleet_facts(fleet, run_cfg, base, global_batch_size)
    swarm = simulate_swarm(fleet, run_cfg, base, global_batch_size, churn)
    replicas = {
        h: simulate_replicas(fleet, run_cfg, h, base, global_batch_size, churn, min_rounds) for h in values
    }
    if swarm.kept_samples_per_s <= 0 and all(c.kept_samples_per_s <= 0 for c in replicas.values()):
        raise FleetError(
            f"neither SWARM nor async replicas train this model on the fleet: {facts.stage_capable_peers} of "
            f"{facts.num_peers} peers fit a stage of {human_bytes(facts.stage_memory_bytes)}, "
            f"{facts.replica_capable_peers} fit the whole model ({human_bytes(facts.replica_memory_bytes)})"
        )
    throughputs = {k: c.kept_samples_per_s for k, c in replicas.items()}
    churn_reasons = []
    if churn != "none":
        lost = ", ".join(
            f"{'SWARM' if c.h is None else f'H={c.h}'} {c.samples_lost / max(c.samples_per_s * c.simulated_s, 1):.1%}"
            for c in (swarm, *replicas.values())
        )
        churn_reasons.append(
            f"churn ({churn}): candidates are compared on samples/s kept, without the trained samples lost "
            f"with failed peers' un-averaged work ({lost}); a SWARM loss is one stage's gradient, counted "
            f"as a whole sample"
        )
    recommended, recommended_h = recommend(swarm.kept_samples_per_s, throughputs, h_tolerance, replica_margin)
    h = smallest_good_h(throughputs, h_tolerance)
    reasons = (
        fleet_reasons(facts)
        + churn_reasons
        + decision_reasons(swarm, replicas, h, recommended, h_tolerance, replica_margin)
    )
    return ModeChoice(
        recommended_mode=recommended,
        recommended_h=recommended_h,
        candidates=(swarm, *(replicas[k] for k in values)),
        reasons=tuple(reasons),
        facts=facts,
        h_tolerance=h_tolerance,
        replica_margin=replica_margin,
    )


# crossover ----------------------------------------------------------------------------------------
def log_crossovers(
    bandwidths: Sequence[float], swarm: Sequence[float], replicas: Sequence[float]
) -> tuple[tuple[float, str], ...]:
    """Bandwidths (log-interpolated between sweep points) where the leader changes, with who leads above."""
    points = []
    for i in range(1, len(bandwidths)):
        before, after = replicas[i - 1] - swarm[i - 1], replicas[i] - swarm[i]
        if (before > 0) != (after > 0):
            t = before / (before - after)
            lo, hi = math.log(bandwidths[i - 1]), math.log(bandwidths[i])
            points.append((math.exp(lo + t * (hi - lo)), REPLICAS if after > 0 else SWARM))
    return tuple(points)


@dataclass(frozen=True)
class BandwidthSweep:
    h: int
    bandwidths_mbit_s: tuple[float, ...]
    swarm: tuple[float, ...]  # samples/s at each bandwidth
    replicas: tuple[float, ...]

    def crossovers(self) -> tuple[tuple[float, str], ...]:
        return log_crossovers(self.bandwidths_mbit_s, self.swarm, self.replicas)


def bandwidth_sweep(
    fleet_at: Callable[[float], Fleet],
    run_cfg: RunConfig,
    h: int,
    bandwidths_mbit_s: Sequence[float] = DEFAULT_BANDWIDTHS_MBIT_S,
    sim_base_config: SimConfig | None = None,
    global_batch_size: int | None = None,
    min_rounds: int = DEFAULT_MIN_ROUNDS,
) -> BandwidthSweep:
    """SWARM and async replicas (every `h` local steps) on `fleet_at(mbit_s)` for each bandwidth."""
    values = tuple(float(b) for b in bandwidths_mbit_s)
    if len(values) < 2 or any(not b > 0 for b in values) or list(values) != sorted(set(values)):
        raise ValueError(f"bandwidths_mbit_s must be >= 2 increasing positive numbers, got {list(values)}")
    _check_rule([h], DEFAULT_H_TOLERANCE, DEFAULT_REPLICA_MARGIN)
    swarm, replicas = [], []
    for b in values:
        fleet = fleet_at(b)
        swarm.append(simulate_swarm(fleet, run_cfg, sim_base_config, global_batch_size).samples_per_s)
        replicas.append(
            simulate_replicas(
                fleet, run_cfg, h, sim_base_config, global_batch_size, min_rounds=min_rounds
            ).samples_per_s
        )
    return BandwidthSweep(h, values, tuple(swarm), tuple(replicas))


def crossover_bandwidth(*sweep_args: Any, **sweep_kwargs: Any) -> tuple[float, ...] | None:
    """The bandwidths (Mb/s, increasing) where async replicas (every `h` steps) and SWARM swap the lead on
    `fleet_at(mbit_s)`, log-interpolated between the swept points; None if neither leads differently
    anywhere in the range. Takes `bandwidth_sweep`'s arguments (one signature to keep in step);
    `bandwidth_sweep(...).crossovers()` also says who leads above each."""
    points = bandwidth_sweep(*sweep_args, **sweep_kwargs).crossovers()
    return tuple(b for b, _ in points) or None
