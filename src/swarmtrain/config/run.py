"""Training, data and swarm-wide settings, and the `RunConfig` that bundles them with the model."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig, StageSpec, partition_layers

# activation/gradient codecs of net/codec.py; below 8 bits: {4,3,2}bit, and after a rotation -rht
COMPRESSION_CHOICES = (
    "none",
    "float16",
    "8bit",
    *(f"{bits}bit{suffix}" for bits in (4, 3, 2) for suffix in ("", "-rht")),
)
LOWBIT_COMPRESSION = COMPRESSION_CHOICES[3:]  # below 8 bits: part of the run digest
# what a stage's gradient exchange can carry (runtime/server/sums_codec.py): lossless or to within a
# block's rounding; below 8 bits error feedback would carry most of a step's gradient to later steps
EXCHANGE_COMPRESSION_CHOICES = ("none", "float16", "8bit")
# what a DiLoCo all-reduce can carry (hivemind's codecs)
DILOCO_COMPRESSION_CHOICES = ("none", "float16", "8bit")


@dataclass(frozen=True)
class TrainingConfig:
    """Optimizer, schedule and batch sizes. Samples are sequences of `model.seq_len` tokens."""

    micro_batch_size: int = 8
    global_batch_size: int = 32  # samples per optimizer step, accumulated over micro-batches
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_samples: int = 256
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip_norm: float = 1.0
    max_samples: int = 8192
    eval_every_samples: int = 2048
    eval_samples: int = 256
    seed: int = 0
    # steps of parameter staleness a swarm micro-batch may see: 0 = synchronous steps (equal to local
    # training at equal samples); 1 = a step's forwards may run while the previous step is averaged
    # (SWARM's delayed update; +18.7% val loss on `tiny` in experiments/step_semantics.py)
    max_staleness: int = 0

    def __post_init__(self) -> None:
        positive = ("micro_batch_size", "global_batch_size", "learning_rate", "max_samples", "eval_samples")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"training.{name} must be positive, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"training.micro_batch_size ({self.micro_batch_size})"
            )
        if not 0 <= self.min_learning_rate <= self.learning_rate:
            raise ConfigError("training.min_learning_rate must be in [0, training.learning_rate]")
        for name in ("warmup_samples", "weight_decay", "grad_clip_norm", "eval_every_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"training.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_staleness not in (0, 1):
            raise ConfigError(f"training.max_staleness must be 0 or 1, got {self.max_staleness}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"training.{name} must be in [0, 1)")


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from. `stdlib` = this Python's standard library sources (always present)."""

    # "stdlib"; a file or folder of text; a directory of token shards written by `swarmtrain tokenize`
    # (recognised by its shards' header, read by memory map); or "hf:NAME[:CONFIG]"
    source: str = "stdlib"
    validation_fraction: float = 0.05
    max_corpus_bytes: int = 16_000_000  # text sources are read into memory up to this size
    # "" = bytes (token id = byte value); a tokenizer.json, a local Hugging Face model directory, or
    # "swarmtrain:NAME" for one shipped with the package (swarmtrain/data/tokenizers/NAME.json)
    tokenizer: str = ""
    text_field: str = "text"  # the text column of .jsonl / .parquet / Hugging Face dataset sources

    def __post_init__(self) -> None:
        if not 0 < self.validation_fraction < 0.5:
            raise ConfigError("data.validation_fraction must be in (0, 0.5)")
        if self.max_corpus_bytes <= 0:
            raise ConfigError("data.max_corpus_bytes must be positive")


@dataclass(frozen=True)
class SwarmConfig:
    """Settings every peer of one run must agree on (part of the config digest) plus local knobs."""

    run_id: str = "swarmtrain"
    num_stages: int = 2
    layers_per_stage: tuple[int, ...] | None = None
    compression: str = "8bit"
    announce_period_s: float = 2.0
    request_timeout_s: float = 30.0
    averaging_timeout_s: float = 30.0  # a step's gradient exchange between a stage's replicas
    # the codec of that exchange (a local knob, not in the digest: every replica adds the same tensors
    # whatever each one sends; runtime/server/sums_codec.py)
    exchange_compression: str = "none"
    max_retries: int = 5
    # a stage's replicas step on their own gradients and average every `local_steps` steps (DiLoCo's
    # pseudo-gradients and outer step, [diloco]); 1: every step averages the gradient (the default)
    local_steps: int = 1
    # stage checkpoints (local knobs, not in the digest): where, how often, how many kept
    checkpoint_dir: str = ""  # empty: no checkpoints (the server's --checkpoint-dir overrides)
    checkpoint_every_steps: int = 50  # 0: not by steps
    checkpoint_every_s: float = 0.0  # 0: not by time
    checkpoint_keep: int = 3
    # adaptive rebalancing (local knobs): every period (jittered) a server reads the stages' loads and
    # moves to the bottleneck stage when the policy picks it; 0: off. On by default, at a period long
    # next to what one check needs (announced figures settle in 16 s, a move costs its server 5-20 s of
    # serving) and short next to a preemptible peer's life (docs/LOG.md, "on by default")
    rebalance_period_s: float = 60.0
    rebalance_margin: float = 0.1  # hysteresis of planner/rebalance.py

    def __post_init__(self) -> None:
        if self.rebalance_period_s < 0 or self.rebalance_margin < 0:
            raise ConfigError("swarm.rebalance_period_s and swarm.rebalance_margin must be >= 0")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_s < 0 or self.checkpoint_keep < 1:
            raise ConfigError(
                "swarm.checkpoint_every_steps and checkpoint_every_s must be >= 0, checkpoint_keep >= 1"
            )
        if self.num_stages <= 0:
            raise ConfigError(f"swarm.num_stages must be positive, got {self.num_stages}")
        if self.compression not in COMPRESSION_CHOICES:
            raise ConfigError(
                f"swarm.compression must be one of {', '.join(COMPRESSION_CHOICES)}, got {self.compression!r}"
            )
        if self.exchange_compression not in EXCHANGE_COMPRESSION_CHOICES:
            raise ConfigError(
                f"swarm.exchange_compression must be one of {', '.join(EXCHANGE_COMPRESSION_CHOICES)}, "
                f"got {self.exchange_compression!r}"
            )
        for name in ("announce_period_s", "request_timeout_s", "averaging_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"swarm.{name} must be positive")
        if self.max_retries < 0:
            raise ConfigError("swarm.max_retries must be >= 0")
        if self.local_steps < 1:
            raise ConfigError(f"swarm.local_steps must be >= 1, got {self.local_steps}")
        if not self.run_id.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"swarm.run_id must be letters, digits, '-' or '_', got {self.run_id!r}")


@dataclass(frozen=True)
class DilocoConfig:
    """Asynchronous full replicas (`swarmtrain replica`, DiLoCo): each replica takes `inner_steps` local
    AdamW steps on its shard, then the replicas average their pseudo-gradients and take one outer
    Nesterov step. Replica K of N takes `training.global_batch_size / N` samples per inner step, and
    inner step s uses the learning rate of global step s, so N replicas follow the same schedule as
    one process."""

    inner_steps: int = 20  # H: local steps between outer steps
    # measured on `tiny` (experiments/diloco_outer.py, docs/LOG.md): with ~13 outer steps DiLoCo's
    # published 0.7 / 0.9 (tuned for thousands of rounds) ends 18% above local training, 0.9 / 0.1 2%
    outer_learning_rate: float = 0.9
    outer_momentum: float = 0.1
    compression: str = "8bit"  # pseudo-gradients on the wire: none | float16 | 8bit (blockwise absmax)
    # how long a replica at a round's end waits for the live replicas it sees in the DHT to arrive
    matchmaking_time_s: float = 30.0
    averaging_timeout_s: float = 60.0  # the all-reduce itself

    def __post_init__(self) -> None:
        if self.inner_steps <= 0:
            raise ConfigError(f"diloco.inner_steps must be positive, got {self.inner_steps}")
        if self.outer_learning_rate <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError("diloco.outer_learning_rate must be > 0 and diloco.outer_momentum in [0, 1)")
        if self.compression not in DILOCO_COMPRESSION_CHOICES:
            raise ConfigError(
                f"diloco.compression must be one of {', '.join(DILOCO_COMPRESSION_CHOICES)}, "
                f"got {self.compression!r}"
            )
        for name in ("matchmaking_time_s", "averaging_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"diloco.{name} must be positive")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; built from a preset plus TOML overrides."""

    preset: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)

    def __post_init__(self) -> None:
        self.stages()  # validates that the layer cut is possible

    def require_swarm_model(self) -> None:
        """Refuse a model the swarm cannot train correctly: tied embeddings need the embedding and the
        LM head on one stage, since combining their gradients across stages every step is not built."""
        if self.model.tie_embeddings and self.swarm.num_stages > 1:
            raise ConfigError(
                f"model.tie_embeddings = true needs the token embedding and the LM head on one stage, but "
                f"swarm.num_stages = {self.swarm.num_stages}: set tie_embeddings = false for a swarm run "
                f"(train-local and replica runs, which hold the whole model, can keep it)"
            )

    def boundary_cuts(self) -> tuple[int, ...]:
        """Where a whole model of this run holds its boundary layers (`[model] boundary`): the first
        global layer of every stage but the first; () without boundary layers."""
        if self.model.boundary == "none":
            return ()
        return tuple(spec.layer_start for spec in self.stages()[1:])

    def stages(self) -> list[StageSpec]:
        return partition_layers(self.model.num_layers, self.swarm.num_stages, self.swarm.layers_per_stage)

    def replace(self, **sections) -> RunConfig:
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Stable hash of what peers must agree on: model shape, stage cut, optimizer, schedule and batch.

        `training.seed` is in it because replicas of a stage initialize their weights from it, and
        `training.max_samples` because it sets the cosine decay horizon of the learning rate: peers
        that differ in either would average diverging weights or step with different rates.
        The evaluation cadence and size are left out (they do not change training). So is the codec
        down to 8 bits (every message names its own, and they train alike); a codec below 8 bits is in
        it, since what a stage receives then differs enough to change the run's result.
        """
        text = json.dumps(self._digest_payload(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def settings_summary(self) -> dict[str, str]:
        """What `digest` is made of, flat ({"model.d_model": "64", ...}, each value compact JSON, a long
        one shortened to a prefix and a hash of the rest), plus `swarm.compression` even where the digest
        leaves it out. Announced beside the digest (net/dht_records.py), so that a peer whose digest
        differs can say which settings do (`differing_settings`), not only that something does."""
        flat = {
            f"{section}.{name}": _short_json(value)
            for section, values in self._digest_payload().items()
            for name, value in values.items()
        }
        flat["swarm.compression"] = _short_json(self.swarm.compression)
        return flat

    def _digest_payload(self) -> dict[str, dict]:
        training = dataclasses.asdict(self.training)
        for local_only in ("eval_every_samples", "eval_samples"):
            training.pop(local_only)
        swarm: dict[str, object] = {
            "run_id": self.swarm.run_id,
            "stages": [(s.layer_start, s.layer_end) for s in self.stages()],
        }
        if self.swarm.local_steps != 1:
            swarm["local_steps"] = self.swarm.local_steps
        if self.swarm.compression in LOWBIT_COMPRESSION:
            swarm["compression"] = self.swarm.compression
        payload = {"model": _model_settings(self.model), "training": training, "swarm": swarm}
        diloco = _outer_step_settings(self.diloco)
        if diloco != _outer_step_settings(DilocoConfig()) or self.swarm.local_steps != 1:
            # only runs that change the outer step get a new digest (older digests stay valid)
            payload["diloco"] = diloco
        return payload


_SHORT_JSON_CHARS = 64  # a summary's value is at most this long (a stage cut of many stages is not)


def _short_json(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) <= _SHORT_JSON_CHARS:
        return text
    return f"{text[:40]}...#{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def differing_settings(ours: dict[str, str], theirs: dict[str, str]) -> list[tuple[str, str, str]]:
    """(setting, our value, their value) of the settings two `settings_summary` dicts disagree on, in
    which their digests differ; a value missing from one is "default" (a setting the digest takes only
    when it is not). The codec counts only where one side is below 8 bits, as in the digest."""
    out = []
    for name in sorted(set(ours) | set(theirs)):
        mine, other = ours.get(name, "default"), theirs.get(name, "default")
        if mine == other:
            continue
        if name == "swarm.compression" and not {mine, other} & {json.dumps(c) for c in LOWBIT_COMPRESSION}:
            continue  # 8 bits or more: every message names its own codec, and they train alike
        out.append((name, mine, other))
    return out


def _model_settings(model: ModelConfig) -> dict:
    """The model's fields, less the ones added with the llama family while they hold their defaults, so
    the digest of a GPT run stays what it was."""
    settings = dataclasses.asdict(model)
    for name in (
        "arch",
        "num_kv_heads",
        "rope_theta",
        "tie_embeddings",
        "shared_layer_repeats",
        "boundary",
        "boundary_dim",
        "boundary_table",
    ):
        if settings[name] == getattr(ModelConfig, name):
            settings.pop(name)
    if model.boundary_table:  # what the peers must agree on is the table, not where each keeps it
        settings["boundary_table"] = file_sha256(model.boundary_table)[:16]
    return settings


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str) -> str:
    """The file's SHA-256 (hex), read once per version of the file (path, size, modification time)."""
    try:
        stat = os.stat(path)
        return _sha256_of(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


def _outer_step_settings(diloco: DilocoConfig) -> dict:
    """What replicas must agree on; the codec and the waits are each peer's own."""
    return {
        k: v
        for k, v in dataclasses.asdict(diloco).items()
        if k in ("inner_steps", "outer_learning_rate", "outer_momentum")
    }
