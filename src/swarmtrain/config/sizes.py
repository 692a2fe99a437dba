"""Size math on plain numbers: parameters, FLOPs and bytes that the planner and simulator reason with.

Both families of `ModelConfig.arch` are covered:

- `gpt`: fused QKV and output projection, 2-matrix GELU MLP, 2 LayerNorms, biases everywhere, learned
  position embeddings, an untied LM head;
- `llama`: q/o projections of d x (heads x head_dim), k/v projections of d x (kv_heads x head_dim)
  (grouped-query attention), a 3-matrix SwiGLU MLP, 2 RMSNorm weights, no biases, no position
  embedding, and no LM head parameters when the head is tied to the token embedding.

Shared layers (`shared_layer_repeats = k`): a stage holds `num_layers` unique layers and applies each k
times, so parameters, gradients and optimizer state count unique layers while FLOPs and the activations
saved for backward count applied layers. "Per layer" below always means per unique layer *held*, with
all of its k applications (`layer_forward_flops_per_token`), so callers multiply by a stage's unique
layer count as before; `layer_application_forward_flops_per_token` is one application.
"""

from __future__ import annotations

from swarmtrain.config.model import ModelConfig, StageSpec

FP32_BYTES = 4
FP16_BYTES = 2


def params_per_layer(cfg: ModelConfig) -> int:
    """Parameters of one (unique) block."""
    d, ff = cfg.d_model, cfg.d_ff
    if cfg.arch == "llama":
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        attention = d * q_width + 2 * d * kv_width + q_width * d
        return attention + 3 * d * ff + 2 * d
    # gpt: 2 LayerNorms, fused QKV + output projection, 2-layer MLP, all with biases
    norms = 2 * 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * ff + ff) + (ff * d + d)
    return norms + attention + mlp


def embedding_params(cfg: ModelConfig) -> int:
    """Held by the first stage: token embeddings (gpt: also learned position embeddings)."""
    if cfg.arch == "llama":
        return cfg.vocab_size * cfg.d_model
    return cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model


def head_params(cfg: ModelConfig) -> int:
    """Held by the last stage: the final norm and the LM head without bias (none when tied: the head then
    multiplies by the first stage's token embedding, which `embedding_params` counts)."""
    norm = cfg.d_model if cfg.arch == "llama" else 2 * cfg.d_model
    lm_head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    return norm + lm_head


def params_per_stage(cfg: ModelConfig, stage: StageSpec) -> int:
    total = stage.num_layers * params_per_layer(cfg)
    if stage.is_first:
        total += embedding_params(cfg)
    if stage.is_last:
        total += head_params(cfg)
    return total


def total_params(cfg: ModelConfig) -> int:
    """Unique parameters (shared layers counted once)."""
    return cfg.num_layers * params_per_layer(cfg) + embedding_params(cfg) + head_params(cfg)


def layer_application_forward_flops_per_token(cfg: ModelConfig) -> int:
    """Matmul FLOPs of one application of one block for one token: 2 per weight plus causal attention
    scores and mixing. Grouped-query attention shrinks the k/v projections, not the attention itself
    (every query head still scores all keys); SwiGLU has three d x d_ff matrices."""
    d, ff, t = cfg.d_model, cfg.d_ff, cfg.seq_len
    if cfg.arch == "llama":
        weights = 2 * (params_per_layer(cfg) - 2 * d)  # every parameter but the norms is a matmul weight
        attention_width = cfg.num_heads * cfg.head_dim
    else:
        weights = 2 * (4 * d * d + 2 * d * ff)
        attention_width = d
    # QK^T and AV each cost 2*t*width per token; causal masking does not reduce work in SDPA kernels.
    attention = 2 * 2 * t * attention_width
    return weights + attention


def layer_forward_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one unique block a stage holds: all its `shared_layer_repeats`
    applications."""
    return cfg.shared_layer_repeats * layer_application_forward_flops_per_token(cfg)


def head_forward_flops_per_token(cfg: ModelConfig) -> int:
    """The LM head's matmul (tied or not: the product is computed either way)."""
    return 2 * cfg.d_model * cfg.vocab_size


def stage_training_flops_per_sample(cfg: ModelConfig, stage: StageSpec) -> int:
    flops = stage.num_layers * layer_forward_flops_per_token(cfg)
    if stage.is_last:
        flops += head_forward_flops_per_token(cfg)
    return 3 * flops * cfg.seq_len


def activation_bytes_per_sample(cfg: ModelConfig, bytes_per_value: float = FP16_BYTES) -> float:
    """The hidden-state tensor crossing one stage boundary for one sample: seq_len x d_model values
    (boundary_dim with boundary layers)."""
    return cfg.seq_len * cfg.wire_dim * bytes_per_value


def llama_saved_bytes_per_layer_application(cfg: ModelConfig, bytes_per_value: int = FP32_BYTES) -> int:
    """Bytes autograd keeps for one sample through one application of one llama block (model/llama.py),
    with T = seq_len, d = d_model, F = d_ff, H = heads and b = `bytes_per_value` of the compute dtype:

    - each RMSNorm: its input in fp32 (the input itself in fp32, else the `x.float()` copy; 4Td), the
      fp32 rsqrt per token (4T) and the normalized values multiplied by the weight (bTd);
    - the norms' outputs, read by q/k/v and by gate/up (bTd each; one tensor per norm);
    - attention: rotated q, k and v *repeated to all H heads* (grouped-query k/v are expanded before
      SDPA, so GQA does not shrink them: 3bTd), SDPA's output (bTd; o_proj reads the same storage) and
      its logsumexp (4HT). Assumption: SDPA runs a flash or memory-efficient kernel (CPU flash, CUDA
      flash/mem-efficient), which keeps output + logsumexp and recomputes the scores; the math fallback
      would also keep H x T^2 probabilities;
    - SwiGLU: gate's output (silu's input), silu's output, up's output and their product (4bTF).

    Total: Td(8 + 8b) + 4bTF + 8T + 4HT. The residual adds keep nothing; the rotary cos/sin tables are
    shared by every layer and not counted. Checked against `saved_tensors_hooks` in
    tests/unit/test_memory_table.py (within ~3% on CPU, fp32 and bf16).
    """
    t, d, b = cfg.seq_len, cfg.d_model, bytes_per_value
    norms = 2 * (FP32_BYTES * t * d + FP32_BYTES * t + b * t * d)
    norm_outputs = 2 * b * t * d
    attention = 4 * b * t * d + FP32_BYTES * cfg.num_heads * t
    mlp = 4 * b * t * cfg.d_ff
    return norms + norm_outputs + attention + mlp


def saved_activation_bytes_per_sample(
    cfg: ModelConfig, stage: StageSpec, bytes_per_value: int = FP32_BYTES
) -> int:
    """Tensors autograd keeps for one sample's backward through a stage, activations in a compute dtype of
    `bytes_per_value` bytes (default fp32), times `shared_layer_repeats` for shared layers.

    gpt: per block (b/2)*T*d*(34 + 5*heads*T/d) bytes (Korthikanti et al. 2022, given for 2-byte values),
    llama: `llama_saved_bytes_per_layer_application`. Both plus the stage's input and, on the last stage,
    the final norm (llama) and 2 fp32 T x vocab tensors: the loss casts logits to fp32 and keeps their
    log-softmax, and at the peak the logits (forward) or the log-softmax's gradient (backward) exist
    next to it."""
    t, d, b = cfg.seq_len, cfg.d_model, bytes_per_value
    if cfg.arch == "llama":
        per_layer = llama_saved_bytes_per_layer_application(cfg, b)
    else:
        per_layer = (34 * t * d + 5 * cfg.num_heads * t * t) * b // 2
    total = stage.num_layers * cfg.shared_layer_repeats * per_layer + b * t * d
    if stage.is_last:
        if cfg.arch == "llama":
            total += FP32_BYTES * (t * d + t) + 2 * b * t * d  # final RMSNorm: fp32 input, normed, output
        total += 2 * FP32_BYTES * t * cfg.vocab_size
    return total


def stage_state_bytes(cfg: ModelConfig, stage: StageSpec) -> float:
    """Parameters plus Adam's two moments in fp32: what a peer downloads to join a stage."""
    return params_per_stage(cfg, stage) * FP32_BYTES * 3
