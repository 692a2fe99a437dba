"""Per-stage work and bytes from the model's size math, and what each peer can do with them.

Cost model (documented here once; the modes and the optimum use exactly these numbers):
- compute: seconds per sample at stage s = `stage_training_flops_per_sample / (tflops * 1e12)`
  (forward + backward; the forward is 1/3 of it), unless a measured value is given (calibration);
- memory: a stage fits a peer's accelerator if fp32 params, grads and two Adam moments (16 B/param)
  plus activations (34 * seq * d bytes per layer and sample, Korthikanti et al., times the micro-batch)
  fit; otherwise, if the same fits *host* memory, the stage runs with layer swapping: fp16 weights are
  streamed over PCIe once for the forward and once for the backward of every micro-batch, overlapped
  with compute, so a sample costs max(compute, swap / micro_batch_size); otherwise the peer cannot
  serve the stage (rate 0);
- traffic per sample at a stage: the downlink receives the forward input (token ids at stage 0) and,
  except at the last stage, the output gradient; the uplink sends the forward output and, except at
  stage 0, the input gradient. Boundary tensors are seq x d values at the configured compression. The
  labels (int16 like the ids, int32 above 32,767 tokens) ride every forward hop to the last stage, as
  the runtime's direct hand-offs carry them (net/hand_off.py);
- averaging: each time a stage has processed a global batch, its peers exchange gradients
  (`StageCosts.exchange_bytes`). `butterfly` (the default, SWARM's hivemind all-reduce): every peer of
  an n-peer stage sends and receives 2 (n - 1) / n x its fp16 gradients. `all-to-all` (what the live
  runtime does, runtime/server/stage_exchange.py): every peer sends its gradient sums, in the run's
  `swarm.exchange_compression`, to each of the n - 1 others and receives theirs. At pipeline throughput
  T a peer spends `exchange_bytes * T / global_batch` bytes/s per direction on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from swarmtrain.config import ModelConfig, StageSpec, sizes
from swarmtrain.config.model import token_id_bits
from swarmtrain.config.run import LOWBIT_COMPRESSION
from swarmtrain.planner.link_capacity import limited_rates, link_samples_per_s
from swarmtrain.sim.entities import PeerSpec

BYTES_PER_VALUE = {
    "none": 4.0,
    "float16": 2.0,
    "8bit": 1.0 + 4.0 / 256,  # one fp32 scale per 256
    # below 8 bits (net/codec.py): `bits` per value and one bf16 step per 64
    **{name: (8 * int(name[0]) + 2) / 64 for name in LOWBIT_COMPRESSION},
}
STAGE_EXCHANGES = ("butterfly", "all-to-all")
TRAIN_STATE_BYTES_PER_PARAM = 16  # fp32 params, grads, Adam m and v
ACTIVATION_BYTES_PER_TOKEN_PER_D = 34


@dataclass(frozen=True)
class StageCosts:
    """Model-derived numbers for each stage (index = stage) and for the whole model."""

    flops_per_sample: tuple[float, ...]
    params: tuple[int, ...]
    state_bytes: tuple[float, ...]  # what a peer downloads to join a stage
    train_memory_bytes: tuple[float, ...]  # what the stage needs resident to train without swapping
    averaging_bytes: tuple[float, ...]  # fp16 gradients: the all-reduce payload
    activation_bytes_per_sample: float
    token_bytes_per_sample: float
    micro_batch_size: int
    global_batch_size: int
    exchange: str = "butterfly"  # how a stage's peers exchange gradients: one of STAGE_EXCHANGES
    exchange_bytes_per_param: float = float(sizes.FP16_BYTES)

    def __post_init__(self) -> None:
        if self.exchange not in STAGE_EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(STAGE_EXCHANGES)}, got {self.exchange!r}")

    def exchange_bytes(self, stage: int, num_peers: int | None) -> float:
        """Bytes each peer of `stage` sends, and receives, in one step's gradient exchange among
        `num_peers` peers. None: a large stage (a butterfly's 2x the payload; all-to-all's least, one
        partner's sums, since its real cost grows without bound)."""
        payload = self.params[stage] * self.exchange_bytes_per_param
        if num_peers is None:
            return 2 * payload if self.exchange == "butterfly" else payload
        if num_peers < 2:
            return 0.0
        if self.exchange == "all-to-all":
            return payload * (num_peers - 1)
        return 2 * payload * (num_peers - 1) / num_peers

    @property
    def num_stages(self) -> int:
        return len(self.flops_per_sample)

    @property
    def label_bytes_per_sample(self) -> float:
        """The labels: one integer per position, as wide as the token ids."""
        return self.token_bytes_per_sample

    def down_bytes_per_sample(self, stage: int) -> float:
        first = self.token_bytes_per_sample if stage == 0 else self.activation_bytes_per_sample
        grad = self.activation_bytes_per_sample if stage < self.num_stages - 1 else 0.0
        return first + self.label_bytes_per_sample + grad

    def up_bytes_per_sample(self, stage: int) -> float:
        last = stage == self.num_stages - 1
        forward = 0.0 if last else self.activation_bytes_per_sample + self.label_bytes_per_sample
        return forward + (self.activation_bytes_per_sample if stage > 0 else 0.0)

    @functools.cached_property
    def bytes_per_sample_by_stage(self) -> tuple[np.ndarray, np.ndarray]:
        """(up, down) bytes per sample of every stage, as arrays (the optimum reads them thousands of
        times a run)."""
        stages = range(self.num_stages)
        return (
            np.array([self.up_bytes_per_sample(s) for s in stages]),
            np.array([self.down_bytes_per_sample(s) for s in stages]),
        )

    @property
    def model_params(self) -> int:
        return sum(self.params)

    @property
    def model_state_bytes(self) -> float:
        return sum(self.state_bytes)

    @property
    def model_flops_per_sample(self) -> float:
        return sum(self.flops_per_sample)


def stage_costs(
    model: ModelConfig,
    stages: list[StageSpec],
    compression: str,
    micro_batch_size: int,
    global_batch_size: int,
    exchange: str = "butterfly",
    exchange_compression: str = "none",
) -> StageCosts:
    """`exchange_compression` (the run's `swarm.exchange_compression`) sets the all-to-all exchange's
    bytes per parameter; a butterfly all-reduce moves fp16."""
    act_mem_per_layer = ACTIVATION_BYTES_PER_TOKEN_PER_D * model.seq_len * model.d_model * micro_batch_size
    params = tuple(sizes.params_per_stage(model, s) for s in stages)
    return StageCosts(
        flops_per_sample=tuple(float(sizes.stage_training_flops_per_sample(model, s)) for s in stages),
        params=params,
        state_bytes=tuple(float(sizes.stage_state_bytes(model, s)) for s in stages),
        train_memory_bytes=tuple(
            p * TRAIN_STATE_BYTES_PER_PARAM + act_mem_per_layer * s.num_layers
            for p, s in zip(params, stages, strict=True)
        ),
        averaging_bytes=tuple(float(p * sizes.FP16_BYTES) for p in params),
        activation_bytes_per_sample=sizes.activation_bytes_per_sample(model, BYTES_PER_VALUE[compression]),
        token_bytes_per_sample=model.seq_len * token_id_bits(model.vocab_size) / 8,  # packed (net/codec.py)
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        exchange=exchange,
        exchange_bytes_per_param=(
            BYTES_PER_VALUE[exchange_compression] if exchange == "all-to-all" else float(sizes.FP16_BYTES)
        ),
    )


def compute_s_per_sample(peer: PeerSpec, costs: StageCosts) -> tuple[float, ...]:
    """Forward+backward seconds per sample at each stage; inf where the peer cannot hold the stage."""
    out = []
    for s in range(costs.num_stages):
        if peer.stage is not None and s != peer.stage:
            out.append(float("inf"))
            continue
        measured = peer.compute_s_per_sample[s] if peer.compute_s_per_sample else None
        if measured is not None:
            out.append(float(measured))
            continue
        need = costs.train_memory_bytes[s]
        compute = costs.flops_per_sample[s] / (peer.tflops * 1e12)
        if need <= peer.memory_bytes:
            out.append(compute)
        elif need <= peer.host_memory_bytes and peer.memory_bytes > 0:
            swap = 2 * costs.params[s] * sizes.FP16_BYTES / peer.host_to_device_bytes_per_s
            out.append(max(compute, swap / costs.micro_batch_size))
        else:
            out.append(float("inf"))
    return tuple(out)


def full_model_s_per_sample(peer: PeerSpec, costs: StageCosts) -> float:
    """A whole-model replica with layer swapping (async-replicas mode); inf if the host cannot hold it."""
    need = sum(costs.train_memory_bytes)
    if peer.compute_s_per_sample and all(v is not None for v in peer.compute_s_per_sample):
        return float(sum(peer.compute_s_per_sample))
    compute = costs.model_flops_per_sample / (peer.tflops * 1e12)
    if need <= peer.memory_bytes:
        return compute
    if need > peer.host_memory_bytes or peer.memory_bytes <= 0:
        return float("inf")
    swap = 2 * costs.model_params * sizes.FP16_BYTES / peer.host_to_device_bytes_per_s
    return max(compute, swap / costs.micro_batch_size)


@dataclass(frozen=True)
class RateTable:
    """Vectorized per-peer numbers for the optimum: compute rate [peer, stage] and link bandwidths."""

    compute_rate: np.ndarray  # samples/s, 0 where infeasible
    uplink_bytes_per_s: np.ndarray
    downlink_bytes_per_s: np.ndarray

    def rates(
        self,
        costs: StageCosts,
        throughput_samples_per_s: float = 0.0,
        peers_per_stage: list[int] | None = None,
    ) -> np.ndarray:
        """Samples/s of each peer at each stage, capped by its links after averaging at throughput T.

        The exchange's bytes per peer follow `StageCosts.exchange_bytes`; without `peers_per_stage`
        every stage is taken as large."""
        steps_per_s = throughput_samples_per_s / costs.global_batch_size
        sizes_ = peers_per_stage if peers_per_stage is not None else [None] * costs.num_stages
        per_step = np.array([costs.exchange_bytes(s, n) for s, n in enumerate(sizes_)])
        avg = per_step * steps_per_s  # bytes/s per direction, per stage
        up_left = np.maximum(self.uplink_bytes_per_s[:, None] - avg[None, :], 0.0)
        down_left = np.maximum(self.downlink_bytes_per_s[:, None] - avg[None, :], 0.0)
        up_need, down_need = costs.bytes_per_sample_by_stage
        # the same decision a live server makes from its measurements (planner/link_capacity.py)
        up_cap = link_samples_per_s(up_left, up_need[None, :])
        down_cap = link_samples_per_s(down_left, down_need[None, :])
        return limited_rates(self.compute_rate, up_cap, down_cap)


def rate_table(peers: list[PeerSpec], compute_s: list[tuple[float, ...]]) -> RateTable:
    c = np.array(compute_s, dtype=float).reshape(len(peers), -1)
    with np.errstate(divide="ignore"):
        compute_rate = np.where(np.isfinite(c) & (c > 0), 1.0 / c, 0.0)
    return RateTable(
        compute_rate=compute_rate,
        uplink_bytes_per_s=np.array([p.uplink_bytes_per_s for p in peers], dtype=float),
        downlink_bytes_per_s=np.array([p.downlink_bytes_per_s for p in peers], dtype=float),
    )
