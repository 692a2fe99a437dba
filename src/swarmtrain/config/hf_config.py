"""Hugging Face `config.json` <-> `ModelConfig`: which fields of a `LlamaForCausalLM` (or GPT-2) model
directory become the run's model shape, and the `config.json` an exported model carries.

Plain dicts, no `transformers`: servers derive their model config from a directory without importing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig

LLAMA_ACTIVATION = "silu"


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a local Hugging Face model directory."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def model_config_from_hf(raw: dict[str, Any], base: ModelConfig, source: str = "config.json") -> ModelConfig:
    """The model shape a Hugging Face config describes; fields it does not carry (init_std, pad id) come
    from `base`. Unsupported variants are refused, never silently approximated."""
    kind = raw.get("model_type")
    if kind == "llama":
        return _llama(raw, base, source)
    if kind == "gpt2":
        return _gpt2(raw, base, source)
    raise ConfigError(f"{source}: model_type {kind!r} is not supported (llama and gpt2 are)")


def _field(raw: dict[str, Any], name: str, source: str) -> Any:
    if name not in raw:
        raise ConfigError(f"{source}: missing field {name!r}")
    return raw[name]


def _llama(raw: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    act = raw.get("hidden_act", LLAMA_ACTIVATION)
    unsupported = {
        "hidden_act": act != LLAMA_ACTIVATION,
        "rope_scaling": bool(raw.get("rope_scaling")),
        "attention_bias": bool(raw.get("attention_bias")),
        "mlp_bias": bool(raw.get("mlp_bias")),
    }
    d_model, heads = int(_field(raw, "hidden_size", source)), int(_field(raw, "num_attention_heads", source))
    if raw.get("head_dim") not in (None, d_model // heads):
        unsupported["head_dim"] = True
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(f"{source}: unsupported Llama setting(s) {bad} (values {[raw[b] for b in bad]})")
    return ModelConfig(
        arch="llama",
        vocab_size=int(_field(raw, "vocab_size", source)),
        d_model=d_model,
        num_layers=int(_field(raw, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        d_ff=int(_field(raw, "intermediate_size", source)),
        seq_len=min(int(_field(raw, "max_position_embeddings", source)), base.seq_len),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=float(raw.get("initializer_range", base.init_std)),
        pad_token_id=base.pad_token_id,
    )


def _gpt2(raw: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    d_model = int(_field(raw, "n_embd", source))
    return ModelConfig(
        arch="gpt",
        vocab_size=int(_field(raw, "vocab_size", source)),
        d_model=d_model,
        num_layers=int(_field(raw, "n_layer", source)),
        num_heads=int(_field(raw, "n_head", source)),
        d_ff=int(raw.get("n_inner") or 4 * d_model),
        seq_len=min(int(_field(raw, "n_positions", source)), base.seq_len),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        init_std=float(raw.get("initializer_range", base.init_std)),
        pad_token_id=base.pad_token_id,
    )


def hf_config_from_model(cfg: ModelConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`config.json` for an exported model. Shared layers are unrolled (`num_layers x repeats` layers),
    which is the same function (each layer applied k times in a row)."""
    if cfg.arch != "llama":
        raise ConfigError("Hugging Face export is built for model.arch = \"llama\"")
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.applied_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": LLAMA_ACTIVATION,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }
    out.update(extra or {})
    return out
