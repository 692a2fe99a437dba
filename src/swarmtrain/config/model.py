"""Model shape and how its layers are cut into pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarmtrain.config.errors import ConfigError

ARCH_CHOICES = ("gpt", "llama")
# model/boundary.py; "subspace": exact boundaries, the residual kept in a subspace (model/subspace.py)
BOUNDARY_CHOICES = ("none", "bottleneck", "maxout", "lowrank", "lowrank-embed", "subspace")
SUBSPACE = "subspace"
MAX_SUBSPACE_VOCAB = 2**24  # token ids travel beside a stage's coordinates as fp32 values (exact below it)
INT16_VOCAB = 32_767  # token ids and labels go as int16 up to this vocabulary, int32 above


def token_id_bytes(vocab_size: int) -> int:
    """Bytes per token id or label sent unpacked (an ignored label among them): int16 or int32."""
    return 2 if vocab_size <= INT16_VOCAB else 4


def token_id_bits(vocab_size: int) -> int:
    """Bits per token id or label on the wire, packed (net/protocol.py `encode_labels`): the fewest that
    hold vocab_size - 1 (11 for 2,048 tokens, 16 for GPT-2's 50,257, 17 for Llama 3's 128,256)."""
    return max(1, (vocab_size - 1).bit_length())


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm decoder of one of two families:

    - `gpt`: learned positions, LayerNorm, GELU MLP, fused QKV with biases, untied LM head;
    - `llama`: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention without biases, optional
      tied input/output embeddings; parameter names are Hugging Face's `LlamaForCausalLM` names.

    `shared_layer_repeats = k` applies each layer k times in a row (SWARM's and ALBERT's layer sharing):
    parameters and activations on the wire stay those of the unique layers, compute grows k-fold.
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int = 256
    seq_len: int = 64
    norm_eps: float = 1e-5
    init_std: float = 0.02
    pad_token_id: int = -100  # label value ignored by the loss
    arch: str = "gpt"
    num_kv_heads: int = 0  # llama: key/value heads of grouped-query attention; 0 = num_heads
    rope_theta: float = 10000.0  # llama: base of the rotary frequencies
    tie_embeddings: bool = False  # llama: the LM head reuses the token embedding matrix
    shared_layer_repeats: int = 1
    # compression-aware stage boundaries (model/boundary.py): layers that send `boundary_dim` values per
    # token from one stage to the next instead of d_model; "none" = plain hidden states; "subspace": every
    # write into the residual stream lives in a fixed boundary_dim-dimensional subspace, so a stage sends
    # its coordinates and the token ids and the next one rebuilds the hidden state exactly (model/subspace.py)
    boundary: str = "none"
    boundary_dim: int = 0
    # "subspace" only: a file of the fixed token table E0 (model/subspace.py; `swarmtrain boundary-table`
    # makes one from the training data); "" = E0 drawn from the seed. Its content is in the digest
    boundary_table: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("model.norm_eps and model.init_std must be positive")
        if self.arch not in ARCH_CHOICES:
            raise ConfigError(f"model.arch must be one of {', '.join(ARCH_CHOICES)}, got {self.arch!r}")
        if self.shared_layer_repeats < 1:
            raise ConfigError(f"model.shared_layer_repeats must be >= 1, got {self.shared_layer_repeats}")
        self._check_llama_fields()
        self._check_boundary()

    def _check_boundary(self) -> None:
        if self.boundary not in BOUNDARY_CHOICES:
            raise ConfigError(
                f"model.boundary must be one of {', '.join(BOUNDARY_CHOICES)}, got {self.boundary!r}"
            )
        if self.boundary == "none":
            if self.boundary_dim:
                raise ConfigError('model.boundary_dim needs model.boundary (e.g. "lowrank")')
        elif not 0 < self.boundary_dim < self.d_model:
            raise ConfigError(
                f"model.boundary_dim must be in 1..{self.d_model - 1} (below d_model), got {self.boundary_dim}"
            )
        if self.boundary == SUBSPACE and self.tie_embeddings:
            raise ConfigError(
                'model.boundary = "subspace" needs model.tie_embeddings = false (a tied model trains on one '
                "stage, where no boundary is crossed)"
            )
        if self.boundary_table and self.boundary != SUBSPACE:
            raise ConfigError(
                f'model.boundary_table needs model.boundary = "subspace" (it is the fixed token table of a '
                f"subspace run), got boundary {self.boundary!r}"
            )
        if self.boundary_table and not Path(self.boundary_table).is_file():
            raise ConfigError(f"model.boundary_table: no such file {self.boundary_table!r}")
        if self.boundary == SUBSPACE and self.vocab_size > MAX_SUBSPACE_VOCAB:
            raise ConfigError(
                f'model.boundary = "subspace" takes a vocabulary of at most {MAX_SUBSPACE_VOCAB:,} tokens '
                f"(their ids cross stages beside the coordinates as fp32), got {self.vocab_size:,}"
            )

    @property
    def wire_dim(self) -> int:
        """Values per token that cross a stage boundary."""
        return self.d_model if self.boundary == "none" else self.boundary_dim

    def _check_llama_fields(self) -> None:
        if self.arch != "llama":
            changed = [
                name
                for name in ("num_kv_heads", "tie_embeddings")
                if getattr(self, name) != getattr(ModelConfig, name)
            ]
            if changed:
                raise ConfigError(f'model.{changed[0]} needs model.arch = "llama"')
            return
        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"rotary positions need an even head size, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ConfigError("model.rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `num_kv_heads`, or one per query head when it is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def applied_layers(self) -> int:
        """Layers a token passes through: the unique layers times `shared_layer_repeats`."""
        return self.num_layers * self.shared_layer_repeats


@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `num_stages` holds global layers [layer_start, layer_end)."""

    index: int
    num_stages: int
    layer_start: int
    layer_end: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_stages:
            raise ConfigError(f"stage index {self.index} outside 0..{self.num_stages - 1}")
        if not 0 <= self.layer_start <= self.layer_end:
            raise ConfigError(f"bad layer range [{self.layer_start}, {self.layer_end})")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def partition_layers(
    num_layers: int, num_stages: int, layers_per_stage: tuple[int, ...] | list[int] | None = None
) -> list[StageSpec]:
    """Split layers into stages: evenly (earlier stages take the remainder) or by explicit counts."""
    if num_stages <= 0:
        raise ConfigError(f"num_stages must be positive, got {num_stages}")
    if layers_per_stage is None:
        if num_stages > num_layers:
            raise ConfigError(f"cannot cut {num_layers} layers into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ConfigError(f"layers_per_stage has {len(counts)} entries, expected {num_stages}")
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ConfigError(f"layers_per_stage {counts} must be non-negative and sum to {num_layers}")
    specs, start = [], 0
    for i, count in enumerate(counts):
        specs.append(StageSpec(i, num_stages, start, start + count))
        start += count
    return specs
