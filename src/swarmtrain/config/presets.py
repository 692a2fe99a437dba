"""Named presets as functions. Each returns a complete `RunConfig` a user can override from TOML."""

from __future__ import annotations

from collections.abc import Callable

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig
from swarmtrain.config.run import RunConfig, SwarmConfig, TrainingConfig

GPT2_VOCAB = 50257


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


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "small": small,
    "gpt2-small": gpt2_small,
    "gpt3-xl": gpt3_xl,
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> RunConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (choose from: {', '.join(PRESETS)})") from None
