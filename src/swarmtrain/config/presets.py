"""Named presets as functions. Each returns a complete `RunConfig` a user can override from TOML."""

from __future__ import annotations

from collections.abc import Callable

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig
from swarmtrain.config.run import DataConfig, RunConfig, SwarmConfig, TrainingConfig

GPT2_VOCAB = 50257
LLAMA2_VOCAB = 32000  # Llama 2, TinyLlama, and most Llama-shaped models trained from scratch
LLAMA3_VOCAB = 128256
# the byte-level BPE tokenizer shipped in the package (trained on the default `stdlib` corpus), so
# `llama-tiny` runs with no preparation step, as `tiny` does
BUNDLED_TOKENIZER = "swarmtrain:llama-tiny"
BUNDLED_VOCAB = 2048


def tiny() -> RunConfig:
    """Byte-level, ~0.2M parameters: trains on one CPU core in seconds; the default for demos and tests."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=256, d_model=64, num_layers=4, num_heads=4, d_ff=256, seq_len=64),
        training=TrainingConfig(
            micro_batch_size=8,
            global_batch_size=32,
            learning_rate=3e-3,
            warmup_samples=256,
            max_samples=8192,
            eval_every_samples=2048,
            eval_samples=256,
        ),
        swarm=SwarmConfig(num_stages=2),
    )


def small() -> RunConfig:
    """Byte-level, ~3M parameters: minutes on CPU; one micro-batch fwd+bwd >= 100 ms on one core.

    Its global batch is 16 micro-batches, as in real runs (many micro-batches per step, so a
    pipeline of a few stages is full within a step); `tiny` keeps 4 to test the hard case of the
    whole global batch in flight."""
    return RunConfig(
        preset="small",
        model=ModelConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=4, d_ff=1024, seq_len=128),
        training=TrainingConfig(
            micro_batch_size=8,
            global_batch_size=128,
            learning_rate=1e-3,
            min_learning_rate=1e-4,
            warmup_samples=512,
            max_samples=32768,
            eval_every_samples=8192,
            eval_samples=256,
        ),
        swarm=SwarmConfig(num_stages=2),
    )


def gpt2_small() -> RunConfig:
    """GPT-2 small shape (124M with a GPT-2 vocabulary); byte-level data still works (ids < 256)."""
    return RunConfig(
        preset="gpt2-small",
        model=ModelConfig(
            vocab_size=GPT2_VOCAB, d_model=768, num_layers=12, num_heads=12, d_ff=3072, seq_len=1024
        ),
        training=TrainingConfig(
            micro_batch_size=4,
            global_batch_size=256,
            learning_rate=6e-4,
            min_learning_rate=6e-5,
            warmup_samples=2048,
            max_samples=1_000_000,
            eval_every_samples=65536,
        ),
        swarm=SwarmConfig(num_stages=4),
    )


def gpt3_xl() -> RunConfig:
    """GPT-3 XL (1.3B): the workload of the placement paper (24 layers, d=2048, 16 heads, seq 2048)."""
    return RunConfig(
        preset="gpt3-xl",
        model=ModelConfig(
            vocab_size=GPT2_VOCAB, d_model=2048, num_layers=24, num_heads=16, d_ff=8192, seq_len=2048
        ),
        training=TrainingConfig(
            micro_batch_size=1,
            global_batch_size=1024,
            learning_rate=2e-4,
            min_learning_rate=2e-5,
            warmup_samples=100_000,
            max_samples=10_000_000,
            eval_every_samples=100_000,
        ),
        swarm=SwarmConfig(num_stages=8),
    )


def _llama(**model) -> ModelConfig:
    return ModelConfig(arch="llama", norm_eps=1e-5, **model)


def _cpu_training() -> TrainingConfig:
    """`tiny`'s schedule: seconds on one CPU core."""
    return tiny().training


def llama_tiny() -> RunConfig:
    """Llama-shaped, ~0.45M parameters, BPE tokens from the bundled 2,048-token tokenizer: `tiny`'s
    size and schedule with grouped-query attention (4 query heads, 2 key/value heads)."""
    return RunConfig(
        preset="llama-tiny",
        model=_llama(
            vocab_size=BUNDLED_VOCAB,
            d_model=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            d_ff=176,
            seq_len=64,
        ),
        training=_cpu_training(),
        data=DataConfig(tokenizer=BUNDLED_TOKENIZER),
        swarm=SwarmConfig(num_stages=2),
    )


def swarm_shared() -> RunConfig:
    """The shape of SWARM's published model at CPU width: a few unique layers, each applied 16 times
    (ALBERT-style sharing), one unique layer per stage. The paper gives two totals, 1.01B shared
    parameters and ~13B before sharing; 4 unique d=4096 layers (~201M each) applied 16 times plus a
    50k x 4096 embedding give both, which is the shape kept here (d=128, 4 stages)."""
    return RunConfig(
        preset="swarm-shared",
        model=_llama(
            vocab_size=BUNDLED_VOCAB,
            d_model=128,
            num_layers=4,
            num_heads=4,
            d_ff=512,
            seq_len=64,
            shared_layer_repeats=16,
        ),
        training=TrainingConfig(
            micro_batch_size=8,
            global_batch_size=64,
            learning_rate=1e-3,
            min_learning_rate=1e-4,
            warmup_samples=512,
            max_samples=32768,
            eval_every_samples=8192,
            eval_samples=256,
        ),
        data=DataConfig(tokenizer=BUNDLED_TOKENIZER),
        swarm=SwarmConfig(num_stages=4),
    )


def _large_training(micro: int, global_batch: int, lr: float, warmup: int, total: int) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=micro,
        global_batch_size=global_batch,
        learning_rate=lr,
        min_learning_rate=lr / 10,
        warmup_samples=warmup,
        max_samples=total,
        eval_every_samples=65536,
    )


def llama_125m() -> RunConfig:
    """A 124M Llama (GPT-2 small's budget): 12 layers, d=768, 12 heads over 4 key/value heads."""
    return RunConfig(
        preset="llama-125m",
        model=_llama(
            vocab_size=LLAMA2_VOCAB,
            d_model=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            d_ff=2048,
            seq_len=1024,
        ),
        training=_large_training(4, 256, 6e-4, 2048, 1_000_000),
        swarm=SwarmConfig(num_stages=4),
    )


def llama_1b() -> RunConfig:
    """TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads over 4 key/value heads, untied head."""
    return RunConfig(
        preset="llama-1b",
        model=_llama(
            vocab_size=LLAMA2_VOCAB,
            d_model=2048,
            num_layers=22,
            num_heads=32,
            num_kv_heads=4,
            d_ff=5632,
            seq_len=2048,
        ),
        training=_large_training(1, 1024, 4e-4, 100_000, 10_000_000),
        swarm=SwarmConfig(num_stages=8),
    )


def llama_8b() -> RunConfig:
    """Llama 3 8B's shape: 32 layers, d=4096, 32 heads over 8 key/value heads, a 128k vocabulary,
    rope_theta 500,000; trained here at 2,048 tokens per sample."""
    return RunConfig(
        preset="llama-8b",
        model=ModelConfig(
            arch="llama",
            vocab_size=LLAMA3_VOCAB,
            d_model=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            d_ff=14336,
            seq_len=2048,
            norm_eps=1e-5,
            rope_theta=500000.0,
        ),
        training=_large_training(1, 1024, 3e-4, 100_000, 10_000_000),
        swarm=SwarmConfig(num_stages=16),
    )


def llama_13b() -> RunConfig:
    """Llama 2 13B's shape: 40 layers, d=5120, 40 heads (no grouping), the placement and simulator
    scenarios' largest workload."""
    return RunConfig(
        preset="llama-13b",
        model=_llama(
            vocab_size=LLAMA2_VOCAB, d_model=5120, num_layers=40, num_heads=40, d_ff=13824, seq_len=4096
        ),
        training=_large_training(1, 1024, 3e-4, 100_000, 10_000_000),
        swarm=SwarmConfig(num_stages=20),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "small": small,
    "gpt2-small": gpt2_small,
    "gpt3-xl": gpt3_xl,
    "llama-tiny": llama_tiny,
    "swarm-shared": swarm_shared,
    "llama-125m": llama_125m,
    "llama-1b": llama_1b,
    "llama-8b": llama_8b,
    "llama-13b": llama_13b,
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> RunConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})") from None
