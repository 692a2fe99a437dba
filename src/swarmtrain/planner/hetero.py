"""Compute-aware planning: devices of different speed and memory, and uneven layers per stage.

The DT-FM cost counts communication only and assumes identical GPUs. Here a plan also chooses how many
layers L_k each stage gets. One iteration = each of the D_DP pipelines pushes a macro-batch of B samples,
split into M equal micro-batches, forward and backward, then every stage group all-reduces gradients.
For stage k (group G_k, in pipeline order):

    compute_k(L) = B * (L * F_layer + F_extra_k) / (u * min_{d in G_k} tflops_d * 1e12)
    comm_k       = edge(k-1, k) + edge(k, k+1)           (DT-FM edges; activations in, gradients back)
    t_k(L)       = compute_k(L) + comm_k                 (stage time per macro-batch)
    pipeline     = (sum_k t_k + (M - 1) * max_k t_k) / M (GPipe: fill and drain, then the slowest stage)
    dp_k(L)      = max_{i in G_k} sum_{j in G_k, j != i} 2 * (lat_ij + grad_Gbit_k(L) / (D_DP * bw_ij))
    iteration    = max_k dp_k(L_k) + pipeline
    memory_k(L)  = L * (16 B * P_layer + B * seq * d_model * 2 B) + 16 B * P_extra_k <= h * min memory_gb

F_layer is one layer's training FLOPs per sample (3x forward), F_extra_k the LM head on the last stage,
u the achieved fraction of peak TFLOPS (default 0.4), grad_Gbit_k(L) = 8 * 4 B * (L * P_layer +
P_extra_k) / 1e9 (fp32 gradients, embeddings on the first stage and the head on the last), 16 B per
parameter = fp32 weights, gradients and two Adam moments, stored activations = each layer's input for
every micro-batch (checkpointing at layer boundaries), h = 0.9 headroom. The slowest replica gates its
stage because every pipeline must finish before the all-reduce, so using the group minimum is an upper
bound (tight when the slowest devices share a pipeline). With M = 1 and no FLOPs the iteration equals
the DT-FM cost DP + 2 x PP.

Layers are chosen exactly (`allocate_layers`): for every pair of thresholds (tau on max t_k, delta on
max dp_k) each stage can take at most the layers that keep it under both and within memory; filling
those capacities in order of cheapest compute per layer minimizes sum t_k, so the best pair gives the
optimum (about a millisecond for 8 stages and 24 layers, so the search uses it on every candidate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from swarmtrain.config.errors import UserError
from swarmtrain.config.model import ModelConfig
from swarmtrain.config.sizes import (
    FP32_BYTES,
    activation_bytes_per_sample,
    embedding_params,
    head_params,
    layer_forward_flops_per_token,
    params_per_layer,
)
from swarmtrain.planner.cost import GBIT_PER_GB, CostModel, Group
from swarmtrain.planner.graph import shortest_open_path
from swarmtrain.planner.search import SearchConfig, SearchResult, search_placement

STATE_BYTES_PER_PARAM = 16  # fp32 weights + fp32 gradients + Adam m and v
DEFAULT_UTILIZATION = 0.4
DEFAULT_MICRO_BATCHES = 8
MEMORY_HEADROOM = 0.9
INFEASIBLE_S = 1e6  # iteration time reported for a placement whose stages cannot hold the model


@dataclass(frozen=True)
class ComputeProfile:
    """Per-layer and per-stage-extra work, gradient and memory of one model at one macro-batch size."""

    num_layers: int
    layer_flops_per_sample: float
    head_flops_per_sample: float
    layer_gradient_gb: float
    first_extra_gradient_gb: float
    last_extra_gradient_gb: float
    layer_memory_gb: float
    first_extra_memory_gb: float
    last_extra_memory_gb: float
    samples_per_macro_batch: int
    micro_batches: int = DEFAULT_MICRO_BATCHES
    utilization: float = DEFAULT_UTILIZATION


def compute_profile(
    model: ModelConfig,
    samples_per_macro_batch: int,
    micro_batches: int = DEFAULT_MICRO_BATCHES,
    utilization: float = DEFAULT_UTILIZATION,
) -> ComputeProfile:
    if not 0 < utilization <= 1:
        raise UserError(f"utilization must be in (0, 1], got {utilization}")
    if samples_per_macro_batch <= 0 or micro_batches <= 0:
        raise UserError("macro-batch samples and micro-batches must be positive")
    layer_params = params_per_layer(model)
    activations_gb = samples_per_macro_batch * activation_bytes_per_sample(model) / 1e9
    return ComputeProfile(
        num_layers=model.num_layers,
        layer_flops_per_sample=3.0 * layer_forward_flops_per_token(model) * model.seq_len,
        head_flops_per_sample=3.0 * 2 * model.d_model * model.vocab_size * model.seq_len,
        layer_gradient_gb=layer_params * FP32_BYTES / 1e9,
        first_extra_gradient_gb=embedding_params(model) * FP32_BYTES / 1e9,
        last_extra_gradient_gb=head_params(model) * FP32_BYTES / 1e9,
        layer_memory_gb=layer_params * STATE_BYTES_PER_PARAM / 1e9 + activations_gb,
        first_extra_memory_gb=embedding_params(model) * STATE_BYTES_PER_PARAM / 1e9,
        last_extra_memory_gb=head_params(model) * STATE_BYTES_PER_PARAM / 1e9,
        samples_per_macro_batch=samples_per_macro_batch,
        micro_batches=micro_batches,
        utilization=utilization,
    )


@dataclass(frozen=True)
class LayerPlan:
    """Layers per stage and the predicted iteration time of an ordered placement (inf: does not fit)."""

    layers_per_stage: list[int]
    iteration_s: float
    dp_cost_s: float
    pipeline_s: float
    stage_times_s: list[float]
    compute_s: list[float]
    fits: bool


@dataclass(frozen=True)
class _StageTables:
    """Per stage k and layer count L = 1..L_max: stage time, DP cost, memory fit; compute per layer."""

    time_s: np.ndarray  # (S, L_max)
    dp_s: np.ndarray  # (S, L_max)
    fits: np.ndarray  # (S, L_max) bool
    compute_s: np.ndarray  # (S, L_max)
    seconds_per_layer: np.ndarray  # (S,)


class ComputeModel:
    """Iteration time of placements on a fleet with compute, on top of a DT-FM `CostModel`."""

    def __init__(self, cost_model: CostModel, profile: ComputeProfile) -> None:
        scenario = cost_model.scenario
        if not scenario.has_compute:
            raise UserError(
                f"scenario {scenario.name!r} has no device tflops/memory_gb for compute-aware planning"
            )
        if profile.num_layers < scenario.num_stages:
            raise UserError(f"{profile.num_layers} layers cannot fill {scenario.num_stages} stages")
        self.cost_model = cost_model
        self.profile = profile
        self.flops_per_s: np.ndarray = np.asarray(scenario.tflops) * 1e12 * profile.utilization
        self.memory_gb: np.ndarray = np.asarray(scenario.memory_gb) * MEMORY_HEADROOM
        latency_s = scenario.latency_ms / 1000.0
        with np.errstate(divide="ignore"):
            gbit_factor = 2.0 * GBIT_PER_GB / (scenario.group_size * scenario.bandwidth_gbps)
        np.fill_diagonal(gbit_factor, 0.0)
        # dp link(i, j) = 2 * latency + gradient_GB * gbit_factor(i, j): per-member sums are linear in L.
        self._dp_latency_s = 2.0 * latency_s
        np.fill_diagonal(self._dp_latency_s, 0.0)
        self._dp_per_gb = gbit_factor

    def plan(self, groups: Sequence[Group]) -> tuple[list[Group], LayerPlan]:
        """Pipeline order (the DT-FM shortest path, either direction) and the best layers for it."""
        keyed = [tuple(sorted(g)) for g in groups]
        weights = self.cost_model.edge_matrix(keyed)
        _, order = shortest_open_path(weights)
        best: tuple[list[Group], LayerPlan] | None = None
        for direction in (order, order[::-1]):
            ordered = [keyed[i] for i in direction]
            edges = [float(weights[direction[k], direction[k + 1]]) for k in range(len(direction) - 1)]
            plan = allocate_layers(self._tables(ordered, edges), self.profile)
            if best is None or plan.iteration_s < best[1].iteration_s:
                best = (ordered, plan)
        assert best is not None
        return best

    def evaluate_layers(self, ordered: Sequence[Group], layers_per_stage: Sequence[int]) -> LayerPlan:
        """Iteration time of an ordered placement with given layers (e.g. the even split)."""
        weights = self.cost_model.edge_matrix(list(ordered))
        edges = [float(weights[k, k + 1]) for k in range(len(ordered) - 1)]
        tables = self._tables(list(ordered), edges)
        index = np.asarray(layers_per_stage) - 1
        if index.min() < 0 or index.max() >= tables.time_s.shape[1]:
            raise UserError(
                f"layers per stage {list(layers_per_stage)} must each be in 1..{tables.time_s.shape[1]}"
            )
        return _plan_from(tables, index, self.profile)

    def objective(self, groups: Sequence[Group]) -> tuple[float, float]:
        """(iteration time, DT-FM tie-break in the plan's pipeline order) for `search_placement`. The
        tie-break reuses the plan's path (`CostModel.score` would solve two more path problems, most of
        an evaluation's time at 16 stages)."""
        ordered, plan = self.plan(groups)
        return plan.iteration_s, self.cost_model.ordered_score(ordered)[1]

    def _tables(self, ordered: list[Group], edges: list[float]) -> _StageTables:
        p, stages = self.profile, len(ordered)
        max_layers = p.num_layers - (stages - 1)
        layers = np.arange(1, max_layers + 1, dtype=float)
        comm = np.zeros(stages)
        comm[:-1] += edges
        comm[1:] += edges
        extra_flops = np.zeros(stages)
        extra_flops[-1] = p.head_flops_per_sample
        extra_grad = np.zeros(stages)
        extra_grad[0] += p.first_extra_gradient_gb
        extra_grad[-1] += p.last_extra_gradient_gb
        extra_mem = np.zeros(stages)
        extra_mem[0] += p.first_extra_memory_gb
        extra_mem[-1] += p.last_extra_memory_gb
        speed = np.array([self.flops_per_s[list(g)].min() for g in ordered])
        memory = np.array([self.memory_gb[list(g)].min() for g in ordered])
        seconds_per_layer = p.samples_per_macro_batch * p.layer_flops_per_sample / speed
        compute = (
            seconds_per_layer[:, None] * layers[None, :]
            + (p.samples_per_macro_batch * extra_flops / speed)[:, None]
        )
        gradient_gb = layers[None, :] * p.layer_gradient_gb + extra_grad[:, None]
        dp = np.empty((stages, max_layers))
        for k, group in enumerate(ordered):
            idx = np.ix_(group, group)
            # Member i's DP time is sum_j 2 lat_ij + gradient_GB * sum_j factor_ij; the slowest member counts.
            dp[k] = (
                self._dp_latency_s[idx].sum(axis=1)[:, None]
                + np.outer(self._dp_per_gb[idx].sum(axis=1), gradient_gb[k])
            ).max(axis=0)
        fits = layers[None, :] * p.layer_memory_gb + extra_mem[:, None] <= memory[:, None]
        return _StageTables(compute + comm[:, None], dp, fits, compute, seconds_per_layer)


def _plan_from(tables: _StageTables, index: np.ndarray, profile: ComputeProfile) -> LayerPlan:
    rows = np.arange(len(index))
    times = tables.time_s[rows, index]
    dp = float(tables.dp_s[rows, index].max())
    m = profile.micro_batches
    pipeline = float((times.sum() + (m - 1) * times.max()) / m)
    fits = bool(tables.fits[rows, index].all())
    return LayerPlan(
        layers_per_stage=[int(i) + 1 for i in index],
        iteration_s=dp + pipeline if fits else INFEASIBLE_S,
        dp_cost_s=dp,
        pipeline_s=pipeline,
        stage_times_s=[float(t) for t in times],
        compute_s=[float(c) for c in tables.compute_s[rows, index]],
        fits=fits,
    )


def allocate_layers(tables: _StageTables, profile: ComputeProfile) -> LayerPlan:
    """The layers per stage minimizing the iteration time (exactly), see the module doc."""
    stages, max_layers = tables.time_s.shape
    total = profile.num_layers
    time_s = np.where(tables.fits, tables.time_s, np.inf)  # a layer count that does not fit is never chosen
    dp_s = np.where(tables.fits, tables.dp_s, np.inf)
    taus = np.unique(time_s[np.isfinite(time_s)])
    deltas = np.unique(dp_s[np.isfinite(dp_s)])
    if len(taus) == 0 or tables.fits.sum(axis=1).sum() < total or not tables.fits[:, 0].all():
        return _plan_from(tables, _even_index(stages, total), profile)  # cannot fit: reported infeasible
    # Stage capacities under each threshold: times and DP costs grow with L, so count the L that qualify.
    cap_tau = np.stack([np.searchsorted(time_s[k], taus, side="right") for k in range(stages)], axis=1)
    cap_delta = np.stack([np.searchsorted(dp_s[k], deltas, side="right") for k in range(stages)], axis=1)
    caps = np.minimum(cap_tau[:, None, :], cap_delta[None, :, :]).reshape(-1, stages)
    feasible = (caps.min(axis=1) >= 1) & (caps.sum(axis=1) >= total)
    caps = caps[feasible]
    # Fill capacities beyond one layer each, cheapest compute per layer first (minimizes sum of t_k).
    by_speed = np.argsort(tables.seconds_per_layer, kind="stable")
    extra_caps = caps[:, by_speed] - 1
    before = np.cumsum(extra_caps, axis=1) - extra_caps
    extra = np.clip((total - stages) - before, 0, extra_caps)
    layers = np.empty_like(extra)
    layers[:, by_speed] = extra + 1
    rows = np.arange(stages)[None, :]
    times = time_s[rows, layers - 1]
    m = profile.micro_batches
    score = dp_s[rows, layers - 1].max(axis=1) + (times.sum(axis=1) + (m - 1) * times.max(axis=1)) / m
    return _plan_from(tables, layers[int(np.argmin(score))] - 1, profile)


def _even_index(stages: int, total: int) -> np.ndarray:
    base, extra = divmod(total, stages)
    return np.array([base + (1 if k < extra else 0) for k in range(stages)]) - 1


def even_layers(num_layers: int, num_stages: int) -> list[int]:
    return [int(i) + 1 for i in _even_index(num_stages, num_layers)]


@dataclass(frozen=True)
class ComputeComparison:
    """The communication-only plan (DT-FM search) against the compute-aware one on the same fleet.

    `comm_only_even`: the DT-FM placement with layers split evenly, as a compute-blind planner would
    run it; `comm_only_balanced`: the same placement with layers chosen by `allocate_layers`;
    `joint`: placement searched for iteration time itself (never worse than `comm_only_balanced`,
    which it falls back to)."""

    comm_only_groups: list[Group]
    comm_only_even: LayerPlan
    comm_only_balanced_groups: list[Group]
    comm_only_balanced: LayerPlan
    joint_groups: list[Group]
    joint: LayerPlan
    comm_search: SearchResult
    joint_search: SearchResult


def compare_compute_plans(
    compute: ComputeModel, config: SearchConfig | None = None, seed: int = 0
) -> ComputeComparison:
    cost_model, num_layers = compute.cost_model, compute.profile.num_layers
    comm = search_placement(cost_model, config, seed)
    comm_order = [tuple(g) for g in cost_model.describe(comm.groups).groups]
    even = compute.evaluate_layers(comm_order, even_layers(num_layers, len(comm_order)))
    balanced_order, balanced = compute.plan(comm.groups)
    joint = search_placement(cost_model, config, seed, objective=compute.objective)
    joint_order, joint_plan = compute.plan(joint.groups)
    if balanced.iteration_s < joint_plan.iteration_s:
        joint_order, joint_plan = balanced_order, balanced
    return ComputeComparison(comm_order, even, balanced_order, balanced, joint_order, joint_plan, comm, joint)
