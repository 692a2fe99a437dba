"""The llama family against its oracle, `transformers.LlamaForCausalLM` with the same weights: logits and
parameter gradients of the composed stages within 1e-4 (fp32), grouped-query attention on, tied and
untied; and the stage cut, shared layers and the swarm's refusal of tied embeddings across stages."""

import dataclasses

import pytest
import torch

from swarmtrain.config import ConfigError, ModelConfig, get_preset
from swarmtrain.config.hf_config import hf_config_from_model
from swarmtrain.model import build_model, build_stages

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _cfg(**changes) -> ModelConfig:
    base = dict(
        arch="llama",
        vocab_size=97,
        d_model=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        d_ff=48,
        seq_len=16,
        norm_eps=1e-6,
        rope_theta=500.0,
    )
    return ModelConfig(**{**base, **changes})


def _oracle(cfg: ModelConfig, seed: int):
    """A randomly initialised Hugging Face model, and its weights as a state dict."""
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**hf_config_from_model(cfg))
    model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # HF's default init zeroes nothing interesting; randomize norms too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model, model.state_dict()


def _run_stages(stages, tokens, labels):
    """Stage after stage with a leaf at every boundary, then backward in reverse, as the swarm does."""
    boundaries, x = [], tokens
    for stage in stages[:-1]:
        out = stage(x)
        boundaries.append((x, out))
        x = out.detach().requires_grad_(True)
    logits = stages[-1](x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grad = x.grad
    for stage_input, stage_output in reversed(boundaries):
        stage_output.backward(grad)
        grad = stage_input.grad if stage_input.is_floating_point() else None
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        grads.update({n: p.grad for n, p in stage.named_parameters()})
    return logits.detach(), grads


def _load(stage, state):
    own = stage.state_dict()
    stage.load_state_dict({k: state[k] for k in own})


@pytest.mark.parametrize(
    "tied,num_stages,cut",
    [(False, 1, None), (False, 2, None), (False, 3, [0, 2, 1]), (True, 1, None)],
)
def test_stages_match_transformers_logits_and_gradients(tied, num_stages, cut):
    cfg = _cfg(tie_embeddings=tied)
    oracle, state = _oracle(cfg, seed=1)
    stages = build_stages(cfg, num_stages, cut, seed=5)
    for stage in stages:
        _load(stage, state)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen)

    ref_logits = oracle(input_ids=tokens).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in oracle.named_parameters()}

    logits, grads = _run_stages(stages, tokens, labels)
    assert (logits - ref_logits.detach()).abs().max() <= TOL
    # every parameter of ours is one of the oracle's, under the same name (tied: no lm_head of our own)
    assert set(grads) <= set(ref_grads)
    assert ("lm_head.weight" in grads) != tied
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max() <= TOL, name


def test_stage_state_dicts_partition_the_checkpoint():
    cfg = _cfg()
    whole = set(build_model(cfg).state_dict())
    parts = [set(s.state_dict()) for s in build_stages(cfg, 3)]
    assert set().union(*parts) == whole and sum(map(len, parts)) == len(whole)
    assert "model.embed_tokens.weight" in parts[0] and "lm_head.weight" in parts[2]
    assert "model.layers.2.mlp.down_proj.weight" in parts[2]


def test_shared_layers_equal_the_unrolled_model():
    """k repeats of each layer = a plain model of k x layers whose layers repeat in a row, whatever the cut."""
    shared = _cfg(num_layers=2, shared_layer_repeats=3)
    unrolled = _cfg(num_layers=6)
    model = build_model(shared, seed=2)
    plain = build_model(unrolled, seed=2)
    state = model.state_dict()
    plain.load_state_dict({k: state[_shared_name(k, 3)] for k in plain.state_dict()})
    tokens = torch.randint(0, shared.vocab_size, (2, shared.seq_len))
    ref = plain(tokens)
    assert torch.allclose(model(tokens), ref, atol=1e-5)
    stages = build_stages(shared, 2, seed=2)
    hidden = stages[0](tokens)
    assert torch.allclose(stages[1](hidden), ref, atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in plain.parameters())


def _shared_name(name: str, repeats: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        parts[2] = str(int(parts[2]) // repeats)
    return ".".join(parts)


def test_gpt_family_is_unchanged_by_the_refactor():
    """A GPT run's digest and its model's first loss are what they were before the llama family."""
    cfg = get_preset("tiny")
    assert cfg.digest() == "f3e3933bf617e86c"  # read on main before the llama family
    model = build_model(cfg.model, seed=0)
    tokens = torch.arange(2 * cfg.model.seq_len).reshape(2, -1) % 256
    assert model(tokens, tokens).item() == pytest.approx(5.548972129821777, abs=1e-6)


def test_tied_embeddings_across_stages_are_refused_with_a_reason():
    cfg = get_preset("tiny")
    tied = cfg.replace(model=_cfg(tie_embeddings=True, vocab_size=256))
    with pytest.raises(ConfigError, match="tie_embeddings"):
        tied.require_swarm_model()
    tied.replace(swarm=dataclasses.replace(tied.swarm, num_stages=1)).require_swarm_model()


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_kv_heads=3), "multiple of model.num_kv_heads"),
        (dict(arch="mamba"), "model.arch"),
        (dict(shared_layer_repeats=0), "shared_layer_repeats"),
        (dict(arch="gpt", tie_embeddings=True), "needs model.arch"),
    ],
)
def test_bad_llama_settings_are_named(changes, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**changes)
