"""Size math of both architectures against the real modules, the per-stage memory table, the fewest
stages per GPU size, and `swarmtrain plan --sizes`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from swarmtrain.cli.main import main
from swarmtrain.config import ModelConfig, UserError, get_preset, partition_layers, sizes
from swarmtrain.model import build_stage, build_stages
from swarmtrain.model.llama import LlamaDecoderLayer
from swarmtrain.planner.memory import (
    PRECISIONS,
    fewest_even_stages,
    largest_even_stage_bytes,
    memory_table,
    usable_bytes,
)

pytestmark = pytest.mark.unit

SMALL_GQA = ModelConfig(
    arch="llama", vocab_size=300, d_model=96, num_layers=5, num_heads=6, num_kv_heads=2, d_ff=200, seq_len=40
)


def _real_params(cfg: ModelConfig, num_stages: int, counts: list[int] | None) -> list[int]:
    return [sum(p.numel() for p in s.parameters()) for s in build_stages(cfg, num_stages, counts, seed=0)]


@pytest.mark.parametrize(
    "cfg, num_stages, counts",
    [
        (get_preset("tiny").model, 2, None),
        (get_preset("tiny").model, 3, [1, 2, 1]),
        (get_preset("llama-tiny").model, 2, None),
        (get_preset("llama-tiny").model, 3, [2, 2, 0]),
        (get_preset("swarm-shared").model, 4, None),
        (get_preset("swarm-shared").model, 1, None),
        (SMALL_GQA, 3, [2, 1, 2]),  # untied, grouped-query attention
        (SMALL_GQA, 1, None),
        (replace(SMALL_GQA, tie_embeddings=True), 1, None),  # tied: one stage, no lm_head
        (replace(SMALL_GQA, num_kv_heads=0), 2, None),  # one k/v head per query head
    ],
)
def test_params_per_stage_equal_the_built_stages(cfg, num_stages, counts):
    stages = partition_layers(cfg.num_layers, num_stages, counts)
    predicted = [sizes.params_per_stage(cfg, s) for s in stages]
    assert predicted == _real_params(cfg, num_stages, counts)
    table = memory_table(cfg, stages, 1, PRECISIONS["fp32"])
    assert [m.params for m in table] == predicted
    assert sum(predicted) == sizes.total_params(cfg)


def test_tied_head_has_no_parameters_and_one_stage_only():
    tied = replace(SMALL_GQA, tie_embeddings=True)
    assert sizes.total_params(SMALL_GQA) - sizes.total_params(tied) == 300 * 96
    with pytest.raises(UserError, match="tied embeddings need the whole model in one stage"):
        memory_table(tied, partition_layers(5, 2), 1, PRECISIONS["bf16"])
    fit = fewest_even_stages(tied, 0.001, 1, PRECISIONS["bf16"])
    assert fit.num_stages is None and fit.largest_stage_bytes > usable_bytes(0.001)


def test_preset_totals():
    totals = {name: sizes.total_params(get_preset(name).model) for name in
              ("llama-125m", "llama-1b", "llama-8b", "llama-13b")}  # fmt: skip
    assert totals["llama-125m"] == pytest.approx(124e6, rel=0.01)
    assert totals["llama-1b"] == 1_100_048_384  # TinyLlama-1.1B
    assert totals["llama-8b"] == 8_030_261_248  # Llama 3 8B
    assert totals["llama-13b"] == 13_015_864_320  # Llama 2 13B


@pytest.mark.parametrize("name", ["llama-tiny", "swarm-shared"])
def test_llama_layer_flops_equal_counted_matmuls(name):
    cfg = get_preset(name).model
    layer = LlamaDecoderLayer(cfg)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(torch.randn(1, cfg.seq_len, cfg.d_model))
    assert counter.get_total_flops() == sizes.layer_application_forward_flops_per_token(cfg) * cfg.seq_len


def test_shared_layers_scale_flops_and_activations_not_parameters():
    shared = get_preset("swarm-shared").model
    k = shared.shared_layer_repeats
    plain = replace(shared, shared_layer_repeats=1)
    assert k == 16
    stage = partition_layers(shared.num_layers, 4)[1]
    assert sizes.params_per_stage(shared, stage) == sizes.params_per_stage(plain, stage)
    assert sizes.layer_forward_flops_per_token(shared) == k * sizes.layer_forward_flops_per_token(plain)
    assert sizes.stage_training_flops_per_sample(shared, stage) == k * sizes.stage_training_flops_per_sample(
        plain, stage
    )
    one = sizes.llama_saved_bytes_per_layer_application(shared)
    assert (
        sizes.saved_activation_bytes_per_sample(shared, stage)
        - sizes.saved_activation_bytes_per_sample(plain, stage)
        == (k - 1) * one
    )
    # GPT-shaped numbers are the same function of a config as before (k = 1)
    gpt = get_preset("gpt3-xl").model
    first = partition_layers(24, 8)[0]
    assert (
        sizes.saved_activation_bytes_per_sample(gpt, first)
        == 3 * (2 * 2048 * 2048 * 34 + 2 * 5 * 16 * 2048 * 2048) + 4 * 2048 * 2048
    )


def _measure_saved_bytes(module: torch.nn.Module, inputs: torch.Tensor) -> int:
    """Bytes of distinct storages autograd saves for backward (parameters excluded), then backward once."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(inputs)
    out.float().sum().backward()
    return sum(saved.values())


MEASURED_CFG = ModelConfig(
    arch="llama", vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=352, seq_len=96
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_llama_saved_activation_formula_matches_autograd(dtype, kv_heads):
    cfg = replace(MEASURED_CFG, num_kv_heads=kv_heads)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg).to(dtype)
    x = torch.randn(1, cfg.seq_len, cfg.d_model, dtype=dtype, requires_grad=True)
    measured = _measure_saved_bytes(layer, x)
    predicted = sizes.llama_saved_bytes_per_layer_application(cfg, torch.finfo(dtype).bits // 8)
    print(f"\none llama layer, {dtype}, kv_heads {kv_heads}: measured {measured} B, predicted {predicted} B "
          f"({predicted / measured - 1:+.1%})")  # fmt: skip
    assert predicted == pytest.approx(measured, rel=0.25)


def test_saved_activations_of_a_shared_middle_stage_match_autograd():
    cfg = replace(MEASURED_CFG, shared_layer_repeats=2)
    spec = partition_layers(cfg.num_layers, 3)[1]
    stage = build_stage(cfg, spec, seed=0)
    hidden = torch.randn(1, cfg.seq_len, cfg.d_model, requires_grad=True)
    measured = _measure_saved_bytes(stage, hidden)
    predicted = sizes.saved_activation_bytes_per_sample(cfg, spec)
    print(f"\nmiddle stage, 1 layer x 2 applications, fp32: measured {measured} B, predicted {predicted} B "
          f"({predicted / measured - 1:+.1%})")  # fmt: skip
    assert predicted == pytest.approx(measured, rel=0.25)


def test_memory_table_columns():
    cfg = get_preset("llama-1b").model
    stages = partition_layers(cfg.num_layers, 4)
    for precision in PRECISIONS.values():
        for m, stage in zip(memory_table(cfg, stages, 2, precision), stages, strict=True):
            assert m.weight_bytes + m.gradient_bytes + m.optimizer_bytes == 16 * m.params
            assert m.activation_bytes == 2 * sizes.saved_activation_bytes_per_sample(
                cfg, stage, precision.compute_bytes
            )
            assert m.total_bytes == 16 * m.params + m.activation_bytes
    bf16, fp32 = (memory_table(cfg, stages, 1, PRECISIONS[p])[1] for p in ("bf16", "fp32"))
    assert bf16.optimizer_bytes == 12 * bf16.params and fp32.optimizer_bytes == 8 * fp32.params
    assert bf16.activation_bytes < fp32.activation_bytes


@pytest.mark.parametrize("name", ["llama-1b", "llama-8b", "llama-13b", "gpt3-xl"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fewest_stages_monotone_in_gpu_size_and_consistent(name, dtype):
    cfg, precision = get_preset(name).model, PRECISIONS[dtype]
    answers = []
    for gpu_gb in (8, 12, 16, 24, 40, 48, 80):
        fit = fewest_even_stages(cfg, gpu_gb, 1, precision)
        limit = usable_bytes(gpu_gb)
        if fit.num_stages is None:
            assert largest_even_stage_bytes(cfg, cfg.num_layers, 1, precision) > limit
            answers.append(math.inf)
            continue
        n = fit.num_stages
        totals = [m.total_bytes for m in memory_table(cfg, partition_layers(cfg.num_layers, n), 1, precision)]
        assert max(totals) == fit.largest_stage_bytes <= limit
        if n > 1:
            assert largest_even_stage_bytes(cfg, n - 1, 1, precision) > limit
        answers.append(n)
    assert answers == sorted(answers, reverse=True)
    # more stages never make the largest stage larger
    largest = [largest_even_stage_bytes(cfg, n, 1, precision) for n in range(1, cfg.num_layers + 1)]
    assert largest == sorted(largest, reverse=True)


def test_cli_prints_the_table_for_llama_8b(capsys):
    assert main(["plan", "--sizes", "--model", "llama-8b", "--micro-batch", "1", "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "llama-8b: llama, 8.03B parameters" in text
    assert "16 B per parameter" in text
    rows = re.findall(r"^ +(\d+) +(\d+)-(\d+) ", text, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == list(range(16))  # the preset's 16 stages, 2 layers each
    assert all(int(b) - int(a) == 1 for _, a, b in rows)
    assert "16 GB GPU" in text and "24 GB GPU" in text

    assert main(["plan", "--sizes", "--preset", "llama-8b", "--layers-per-stage", "3," * 10 + "2",
                 "--dtype", "fp32", "--gpu-gb", "16,80", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    cfg = get_preset("llama-8b").model
    stages = partition_layers(32, 11, [3] * 10 + [2])
    expected = memory_table(cfg, stages, 1, PRECISIONS["fp32"])
    assert [s["total_bytes"] for s in out["stages"]] == [m.total_bytes for m in expected]
    assert out["total_params"] == sizes.total_params(cfg) == sum(s["params"] for s in out["stages"])
    assert [f["gpu_gb"] for f in out["fits"]] == [16, 80]
    largest = max(m.total_bytes for m in expected)  # fp32: 3 layers + embedding, ~21 GB
    assert (
        [f["this_cut_fits"] for f in out["fits"]]
        == [largest <= usable_bytes(g) for g in (16, 80)]
        == [
            False,
            True,
        ]
    )
    assert out["fits"][1]["num_stages"] == fewest_even_stages(cfg, 80, 1, PRECISIONS["fp32"]).num_stages


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "--model", "nope"], "unknown preset 'nope'"),
        (["--sizes", "--model", "llama-8b", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (
            ["--sizes", "--model", "llama-8b", "--layers-per-stage", "16,15"],
            "must be non-negative and sum to 32",
        ),
        (["--sizes", "--model", "llama-8b", "--layers-per-stage", "a,b"], "comma-separated integers"),
        (["--sizes", "--model", "llama-8b", "--layers-per-stage", "16,16", "--num-stages", "3"], "disagrees"),
        (["--sizes", "--model", "llama-8b", "--num-stages", "40"], "cannot cut 32 layers into 40 stages"),
        (["--sizes", "--model", "llama-8b", "--gpu-gb", "16,0"], "--gpu-gb sizes must be positive"),
        (["--sizes", "--model", "llama-8b", "--headroom", "1"], "headroom must be in [0, 1)"),
        (["--sizes", "--scenario", "regional"], "--sizes needs no fleet or search: drop --scenario"),
        (["--scenario", "regional", "--micro-batch", "2"], "--micro-batch applies to --sizes"),
        ([], "give a fleet (--scenario, --fleet or --scenario-file), or --sizes"),
    ],
)
def test_cli_rejects_bad_input_with_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and captured.out == ""
