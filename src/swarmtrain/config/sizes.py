"""Size math on plain numbers: parameters, FLOPs and bytes that the planner and simulator reason with."""

from __future__ import annotations

from swarmtrain.config.model import ModelConfig, StageSpec

FP32_BYTES = 4
FP16_BYTES = 2


def params_per_layer(cfg: ModelConfig) -> int:
    """One pre-norm block: 2 LayerNorms, fused QKV + output projection, 2-layer MLP, all with biases."""
    d, ff = cfg.d_model, cfg.d_ff
    norms = 2 * 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * ff + ff) + (ff * d + d)
    return norms + attention + mlp


def embedding_params(cfg: ModelConfig) -> int:
    """Token and learned position embeddings, held by the first stage."""
    return cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model


def head_params(cfg: ModelConfig) -> int:
    """Final LayerNorm and the untied LM head (no bias), held by the last stage."""
    return 2 * cfg.d_model + cfg.d_model * cfg.vocab_size


def params_per_stage(cfg: ModelConfig, stage: StageSpec) -> int:
    total = stage.num_layers * params_per_layer(cfg)
    if stage.is_first:
        total += embedding_params(cfg)
    if stage.is_last:
        total += head_params(cfg)
    return total


def total_params(cfg: ModelConfig) -> int:
    return cfg.num_layers * params_per_layer(cfg) + embedding_params(cfg) + head_params(cfg)


def layer_forward_flops_per_token(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one block for one token: 2 per weight plus causal attention scores and mixing."""
    d, ff, t = cfg.d_model, cfg.d_ff, cfg.seq_len
    weights = 2 * (4 * d * d + 2 * d * ff)
    # QK^T and AV each cost 2*t*d per token; causal masking does not reduce work in SDPA kernels.
    attention = 2 * 2 * t * d
    return weights + attention


def forward_flops_per_token(cfg: ModelConfig) -> int:
    return cfg.num_layers * layer_forward_flops_per_token(cfg) + 2 * cfg.d_model * cfg.vocab_size


def training_flops_per_token(cfg: ModelConfig) -> int:
    """Forward + backward is about 3x the forward."""
    return 3 * forward_flops_per_token(cfg)


def stage_training_flops_per_sample(cfg: ModelConfig, stage: StageSpec) -> int:
    flops = stage.num_layers * layer_forward_flops_per_token(cfg)
    if stage.is_last:
        flops += 2 * cfg.d_model * cfg.vocab_size
    return 3 * flops * cfg.seq_len


def activation_bytes_per_sample(cfg: ModelConfig, bytes_per_value: float = FP16_BYTES) -> float:
    """The hidden-state tensor crossing one stage boundary for one sample: seq_len x d_model values."""
    return cfg.seq_len * cfg.d_model * bytes_per_value


def saved_activation_bytes_per_sample(cfg: ModelConfig, stage: StageSpec) -> int:
    """fp32 tensors autograd keeps for one sample's backward through a stage: per block
    2*T*d*(34 + 5*heads*T/d) bytes (Korthikanti et al. 2022, fp16 figures doubled), plus the
    stage's input and, on the last stage, the logits and their softmax."""
    t, d = cfg.seq_len, cfg.d_model
    per_layer = 2 * t * d * 34 + 2 * 5 * cfg.num_heads * t * t
    total = stage.num_layers * per_layer + FP32_BYTES * t * d
    if stage.is_last:
        total += 2 * FP32_BYTES * t * cfg.vocab_size
    return total


def stage_gradient_bytes(cfg: ModelConfig, stage: StageSpec, bytes_per_value: float = FP32_BYTES) -> float:
    """Bytes of one stage's parameter gradients (what its replicas all-reduce each step)."""
    return params_per_stage(cfg, stage) * bytes_per_value


def stage_state_bytes(cfg: ModelConfig, stage: StageSpec) -> float:
    """Parameters plus Adam's two moments in fp32: what a peer downloads to join a stage."""
    return params_per_stage(cfg, stage) * FP32_BYTES * 3
