"""Hugging Face `config.json` <-> `ModelConfig`: which fields of a `LlamaForCausalLM` (or GPT-2) model
directory become the run's model shape, and the `config.json` an exported model carries.

Plain dicts, no `transformers`: servers derive their model config from a directory without importing it.
Both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the 5 layout (`rope_parameters`) are read.
Unsupported variants are refused, never silently approximated; the one approximation accepted is GPT-2's
tanh GELU (`gelu_new`), which our GPT computes exactly (at most 5e-4 apart per activation): the weights
loader says so when it loads such a model (`gpt2_activation_note`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarmtrain.config.errors import ConfigError
from swarmtrain.config.model import ModelConfig

LLAMA_ACTIVATION = "silu"
GPT2_EXACT_ACTIVATION = "gelu"  # erf GELU: what model/gpt.py computes
GPT2_TANH_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # GPT-2's own: the tanh approximation


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
    from `base`. Unsupported variants are refused, never silently approximated; so is a `base` with
    boundary layers or subspace boundaries, which a plain checkpoint's weights do not fill."""
    if base.boundary != "none":
        raise ConfigError(
            f"{source}: --init-from-hf starts from a plain model, but the run sets model.boundary = "
            f"{base.boundary!r}, whose weights no Hugging Face checkpoint holds: drop the boundary or the "
            "--init-from-hf"
        )
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


def _rope(raw: dict[str, Any]) -> tuple[float, bool]:
    """(rope_theta, whether the rotary positions are scaled), from either transformers layout: 5.x writes
    `rope_parameters = {"rope_type", "rope_theta", ...}`, 4.x `rope_theta` and `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaled = params.get("rope_type", "default") != "default"
    else:
        theta, scaled = raw.get("rope_theta", 10000.0), False
    return float(theta), scaled or bool(raw.get("rope_scaling"))


def _llama(raw: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    act = raw.get("hidden_act", LLAMA_ACTIVATION)
    rope_theta, rope_scaled = _rope(raw)
    unsupported = {
        "hidden_act": act != LLAMA_ACTIVATION,
        "rope_scaling": rope_scaled,
        "attention_bias": bool(raw.get("attention_bias")),
        "mlp_bias": bool(raw.get("mlp_bias")),
    }
    d_model, heads = int(_field(raw, "hidden_size", source)), int(_field(raw, "num_attention_heads", source))
    if raw.get("head_dim") not in (None, d_model // heads):
        unsupported["head_dim"] = True
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        values = [raw.get(b, raw.get("rope_parameters")) for b in bad]
        raise ConfigError(f"{source}: unsupported Llama setting(s) {bad} (values {values})")
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
        rope_theta=rope_theta,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=float(raw.get("initializer_range", base.init_std)),
        pad_token_id=base.pad_token_id,
    )


def _gpt2(raw: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    """GPT-2 in our GPT layout. Its LM head is tied to `wte`; ours is a separate matrix, initialised from
    `wte` by the loader and trained apart from it from then on."""
    act = raw.get("activation_function", "gelu_new")
    unsupported = {
        "activation_function": act not in (GPT2_EXACT_ACTIVATION, *GPT2_TANH_ACTIVATIONS),
        "scale_attn_weights": not raw.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": bool(raw.get("scale_attn_by_inverse_layer_idx")),
        "add_cross_attention": bool(raw.get("add_cross_attention")),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ConfigError(
            f"{source}: unsupported GPT-2 setting(s) {bad} (values {[raw.get(b) for b in bad]})"
        )
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


def gpt2_activation_note(raw: dict[str, Any]) -> str | None:
    """What a GPT-2 config's activation becomes here, when that is an approximation (None: exact)."""
    act = raw.get("activation_function", "gelu_new")
    if raw.get("model_type") != "gpt2" or act not in GPT2_TANH_ACTIVATIONS:
        return None
    return (
        f"GPT-2's activation {act!r} (tanh GELU) is computed as exact GELU here: activations differ by at "
        f"most 5e-4, so logits differ slightly from the original model's until training adapts"
    )


def hf_config_from_model(cfg: ModelConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`config.json` for an exported model: `LlamaForCausalLM` for the llama family, `GPT2LMHeadModel`
    (exact GELU, untied head) for the GPT family. Shared layers are unrolled (`num_layers x repeats`
    layers), which is the same function (each layer applied k times in a row)."""
    out = _llama_config(cfg) if cfg.arch == "llama" else _gpt2_config(cfg)
    # no special token ids unless a tokenizer names them (`extra`): transformers' class defaults (GPT-2's
    # 50256, Llama's 1 and 2) mean nothing for our vocabularies
    out.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    out.update(extra or {})
    return out


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
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
        # both layouts, so transformers 4 (rope_theta) and 5 (rope_parameters) read the same base
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": LLAMA_ACTIVATION,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }


def _gpt2_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.applied_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": GPT2_EXACT_ACTIVATION,
        "tie_word_embeddings": False,  # our GPT's head is its own matrix
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }
