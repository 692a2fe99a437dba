"""Hugging Face checkpoints in and out (model/hf_checkpoint.py), against `transformers` as the oracle:
stages filled from a `save_pretrained` directory (single file and sharded, tied and untied, GQA on, bf16)
compose to the Hugging Face model's logits; a stage reads only its own tensors from only its own shards;
`save_hf_model` writes a directory `from_pretrained` loads with no missing/unexpected weights and equal
logits (shared layers unrolled, GPT as GPT2LMHeadModel, the tokenizer); GPT-2 in; the errors; and the
CLI's `--init-from-hf` config derivation."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch

from swarmtrain.config import ConfigError, ModelConfig, get_preset
from swarmtrain.config.errors import UserError
from swarmtrain.config.hf_config import hf_config_from_model, model_config_from_hf, read_hf_config
from swarmtrain.config.model import partition_layers
from swarmtrain.model import build_model, build_stage
from swarmtrain.model import hf_checkpoint as hf
from swarmtrain.model.checkpoint import CheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SEQ = 16


def _llama_hf(tied: bool, vocab: int = 97, seed: int = 1, layers: int = 3):
    """A random LlamaForCausalLM with GQA (4 query heads, 2 key/value heads) and randomized norms."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(tied, sharded) -> (HF model, its directory), each saved once per module."""
    cache: dict[tuple[bool, bool], tuple] = {}

    def get(tied: bool, sharded: bool):
        if (tied, sharded) not in cache:
            model = _llama_hf(tied)
            path = tmp_path_factory.mktemp(f"llama_tied{int(tied)}_sharded{int(sharded)}")
            model.save_pretrained(path, max_shard_size="20KB" if sharded else "10GB")
            cache[tied, sharded] = (model, path)
        return cache[tied, sharded]

    return get


def _derived(path) -> ModelConfig:
    return model_config_from_hf(read_hf_config(path), ModelConfig(seq_len=SEQ))


def _stages_from(path, cfg: ModelConfig, num_stages: int):
    stages = [build_stage(cfg, spec, seed=7) for spec in partition_layers(cfg.num_layers, num_stages)]
    for stage in stages:
        hf.load_stage_from_hf(stage, path)
    return stages


@torch.no_grad()
def _compose(stages, tokens):
    x = tokens
    for stage in stages:
        x = stage.eval()(x)
    return x


def _tokens(vocab: int, batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied,num_stages", [(False, 2), (False, 3), (True, 1)])
def test_stages_filled_from_a_hf_directory_give_its_logits(saved, tied, sharded, num_stages):
    model, path = saved(tied, sharded)
    assert (path / hf.INDEX_FILE).is_file() == sharded
    cfg = _derived(path)
    assert (cfg.arch, cfg.kv_heads, cfg.tie_embeddings, cfg.rope_theta) == ("llama", 2, tied, 500.0)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    assert _max_diff(_compose(_stages_from(path, cfg, num_stages), tokens), expected) < TOL


def test_a_tied_checkpoint_fills_untied_stages_with_a_copy_of_the_embedding(saved, caplog):
    model, path = saved(True, True)
    cfg = ModelConfig(**{**_derived(path).__dict__, "tie_embeddings": False})
    with caplog.at_level(logging.WARNING, logger="swarmtrain"):
        stages = _stages_from(path, cfg, 2)
    assert "lm_head.weight starts as a copy of model.embed_tokens.weight" in caplog.text
    assert torch.equal(stages[1].lm_head.weight, model.model.embed_tokens.weight)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(_compose(stages, tokens), model(input_ids=tokens).logits) < TOL


class _Recorder:
    """Wraps safetensors' safe_open: which files are opened and which tensors are read from them."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, path, framework):
        self.opened.append(Path(path).name)
        recorder, handle = self, self.real(path, framework=framework)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return handle.get_slice(name)  # a header: its shape (a slice read is a get_tensor below)

            def get_tensor(self, name):
                recorder.read.append(name)
                return handle.get_tensor(name)

        return Handle()


def test_a_stage_reads_only_its_own_tensors_from_only_its_own_shards(saved, monkeypatch):
    _, path = saved(False, True)
    weight_map = json.loads((path / hf.INDEX_FILE).read_text())["weight_map"]
    cfg = _derived(path)
    for spec in partition_layers(cfg.num_layers, 3):
        recorder = _Recorder(hf.safe_open)
        monkeypatch.setattr(hf, "safe_open", recorder)
        stage = build_stage(cfg, spec, seed=0)
        hf.load_stage_from_hf(stage, path)
        own = set(stage.state_dict())
        assert sorted(recorder.read) == sorted(own)  # each of its tensors once, nothing else
        assert set(recorder.opened) == {weight_map[name] for name in own}
        assert len(set(recorder.opened)) < len(set(weight_map.values()))


def test_a_bf16_checkpoint_loads_into_fp32_parameters(tmp_path):
    model = _llama_hf(False).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg = _derived(tmp_path)
    stage = build_model(cfg, seed=0)
    hf.load_stage_from_hf(stage, tmp_path)
    for name, param in stage.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, model.state_dict()[name].float()), name


def _loading_log(load):
    """(result of load(), transformers' log text at WARNING and above while it ran)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    root = transformers.logging.get_logger()
    root.addHandler(handler)
    try:
        return load(), stream.getvalue()
    finally:
        root.removeHandler(handler)


def _from_pretrained(path):
    (model, info), log = _loading_log(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    for word in ("MISSING", "UNEXPECTED", "MISMATCH", "newly initialized", "not used"):
        assert word.lower() not in log.lower(), log
    return model.float().eval()


@pytest.mark.parametrize(
    "tied,shard_bytes", [(False, 30_000), (False, hf.DEFAULT_MAX_SHARD_BYTES), (True, 30_000)]
)
def test_save_hf_model_loads_in_transformers_with_no_weight_warnings_and_equal_logits(
    tmp_path, tied, shard_bytes
):
    cfg = ModelConfig(
        arch="llama", vocab_size=300, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48,
        seq_len=SEQ, rope_theta=500.0, tie_embeddings=tied,
    )  # fmt: skip
    ours = build_model(cfg, seed=3).eval()
    out = tmp_path / "export"
    report = hf.save_hf_model(
        ours.state_dict(), cfg, out, byte_level_tokenizer=True, max_shard_bytes=shard_bytes
    )
    sharded = shard_bytes < hf.DEFAULT_MAX_SHARD_BYTES
    assert (out / hf.INDEX_FILE).is_file() == sharded and (out / hf.SINGLE_FILE).is_file() != sharded
    if sharded:
        index = json.loads((out / hf.INDEX_FILE).read_text())
        sizes = {f: (out / f).stat().st_size for f in set(index["weight_map"].values())}
        assert len(sizes) > 2 and index["metadata"]["total_size"] == report.bytes_written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    model = _from_pretrained(out)
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(model(input_ids=tokens).logits, ours(tokens)) < TOL

    # the byte-level tokenizer: ids are the UTF-8 bytes, and back
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "héllo, swarm\x00\n"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text


def test_shared_layers_are_unrolled_into_the_same_function(tmp_path):
    cfg = ModelConfig(
        arch="llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
        seq_len=SEQ, shared_layer_repeats=3,
    )  # fmt: skip
    ours = build_model(cfg, seed=4).eval()
    hf.save_hf_model(ours.state_dict(), cfg, tmp_path / "out", max_shard_bytes=20_000)
    assert read_hf_config(tmp_path / "out")["num_hidden_layers"] == 6
    model = _from_pretrained(tmp_path / "out")
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(model(input_ids=tokens).logits, ours(tokens)) < TOL
    # and the unrolled directory loads back as a plain 6-layer model
    back = build_model(_derived(tmp_path / "out"), seed=0)
    hf.load_stage_from_hf(back, tmp_path / "out")
    with torch.no_grad():
        assert _max_diff(back.eval()(tokens), ours(tokens)) < TOL


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_gpt_model_exports_as_gpt2(tmp_path, repeats):
    cfg = ModelConfig(
        vocab_size=97,
        d_model=32,
        num_layers=2,
        num_heads=4,
        d_ff=64,
        seq_len=SEQ,
        shared_layer_repeats=repeats,
    )
    ours = build_model(cfg, seed=5).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in ours.named_parameters():
            if ".ln_" in f".{name}" or name.startswith("ln_") or name.endswith("bias"):
                p.uniform_(-0.5, 1.5)
    hf.save_hf_model(ours.state_dict(), cfg, tmp_path / "gpt2")
    model = _from_pretrained(tmp_path / "gpt2")
    assert type(model).__name__ == "GPT2LMHeadModel"
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(model(input_ids=tokens).logits, ours(tokens)) < TOL


def _gpt2_hf(tmp_path, activation: str, positions: int = 32):
    torch.manual_seed(2)
    config = transformers.GPT2Config(
        vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=positions, activation_function=activation,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.uniform_(-0.5, 1.5)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    return model


def test_gpt2_in_with_exact_gelu_gives_its_logits(tmp_path, caplog):
    model = _gpt2_hf(tmp_path, "gelu")
    cfg = _derived(tmp_path)  # seq_len 16 < 32 positions: only the first 16 position rows are read
    assert (cfg.arch, cfg.seq_len, cfg.d_ff) == ("gpt", SEQ, 128)
    with caplog.at_level(logging.WARNING, logger="swarmtrain"):
        stages = _stages_from(tmp_path, cfg, 2)
    assert "lm_head.weight starts as a copy of transformer.wte.weight" in caplog.text
    assert "tanh GELU" not in caplog.text
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(_compose(stages, tokens), model(input_ids=tokens).logits) < TOL


def test_gpt2_tanh_gelu_is_loaded_as_exact_gelu_and_said(tmp_path, caplog):
    model = _gpt2_hf(tmp_path, "gelu_new")
    cfg = _derived(tmp_path)
    with caplog.at_level(logging.WARNING, logger="swarmtrain"):
        stages = _stages_from(tmp_path, cfg, 1)
    assert "tanh GELU" in caplog.text
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = _max_diff(_compose(stages, tokens), model(input_ids=tokens).logits)
    print(f"gelu_new checkpoint, exact GELU here: max logit difference {diff:.2e}")
    assert diff < 1e-2


def test_gpt2_settings_we_do_not_compute_are_refused(tmp_path):
    raw = json.loads(json.dumps(_gpt2_hf(tmp_path, "gelu").config.to_dict()))
    for change in ({"activation_function": "relu"}, {"scale_attn_by_inverse_layer_idx": True}):
        with pytest.raises(ConfigError, match=next(iter(change))):
            model_config_from_hf({**raw, **change}, ModelConfig())


# errors -----------------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_missing_tensor_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = saved(False, False)
    broken = _copy(path, tmp_path / "broken")
    tensors = load_file(broken / hf.SINGLE_FILE)
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, broken / hf.SINGLE_FILE, metadata={"format": "pt"})
    cfg = _derived(broken)
    hf.load_stage_from_hf(build_stage(cfg, partition_layers(3, 2)[0], seed=0), broken)  # has all it needs
    with pytest.raises(
        CheckpointError, match=r"lacks 1 tensor\(s\) stage 1 needs, e.g. model.layers.2.mlp.up_proj"
    ):
        hf.load_stage_from_hf(build_stage(cfg, partition_layers(3, 2)[1], seed=0), broken)


def test_a_tensor_of_another_shape_is_named_with_both_shapes(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = saved(False, False)
    broken = _copy(path, tmp_path / "broken")
    tensors = load_file(broken / hf.SINGLE_FILE)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, broken / hf.SINGLE_FILE, metadata={"format": "pt"})
    stage = build_model(_derived(broken), seed=0)
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"k_proj.weight: checkpoint shape \(8, 32\).*shape \(16, 32\)"):
        hf.load_stage_from_hf(stage, broken)
    assert all(torch.equal(before[k], v) for k, v in stage.state_dict().items())  # nothing half-loaded


def test_missing_files_are_named(saved, tmp_path):
    _, path = saved(False, True)
    cfg = _derived(path)
    no_shard = _copy(path, tmp_path / "no_shard")
    (no_shard / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00007.safetensors"):
        hf.load_stage_from_hf(build_model(cfg, seed=0), no_shard)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match="no model.safetensors or model.safetensors.index.json.*convert"
    ):
        hf.load_stage_from_hf(build_model(cfg, seed=0), no_weights)
    with pytest.raises(ConfigError, match="no config.json"):
        hf.load_stage_from_hf(build_model(cfg, seed=0), tmp_path)


def test_a_model_of_another_shape_is_refused(saved):
    _, path = saved(False, False)
    cfg = _derived(path)
    for change in ({"d_ff": 64}, {"num_layers": 4}, {"rope_theta": 10000.0}, {"tie_embeddings": True}):
        other = ModelConfig(**{**cfg.__dict__, **change})
        with pytest.raises(CheckpointError, match="describes another model"):
            hf.load_stage_from_hf(build_model(other, seed=0), path)
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        hf.load_stage_from_hf(build_model(get_preset("tiny").model, seed=0), path)


def test_export_refuses_a_mismatched_state_dict_and_a_foreign_directory(tmp_path, monkeypatch):
    cfg = ModelConfig(
        arch="llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, d_ff=48, seq_len=SEQ
    )
    state = build_model(cfg, seed=0).state_dict()
    with pytest.raises(CheckpointError, match="1 missing, e.g. model.norm.weight"):
        hf.save_hf_model({k: v for k, v in state.items() if k != "model.norm.weight"}, cfg, tmp_path / "a")
    wrong = dict(state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match=r"up_proj.weight \(3, 3\) \(model \(48, 32\)\)"):
        hf.save_hf_model(wrong, cfg, tmp_path / "a")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not replacing .*notes.txt"):
        hf.save_hf_model(state, cfg, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"

    # a failure half-way leaves neither the directory nor a temporary; a previous export stays whole
    hf.save_hf_model(state, cfg, tmp_path / "b")
    before = sorted(p.name for p in (tmp_path / "b").iterdir())
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_save(tensors, path, metadata=metadata)

    real_save = hf.save_file
    monkeypatch.setattr(hf, "save_file", failing_save)
    for target in (tmp_path / "c", tmp_path / "b"):
        calls.clear()
        with pytest.raises(CheckpointError, match="No space left"):
            hf.save_hf_model(state, cfg, target, max_shard_bytes=10_000)
    assert not (tmp_path / "c").exists()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()  # and a successful export replaces the previous one whole
    hf.save_hf_model(state, cfg, tmp_path / "b", max_shard_bytes=10_000)
    assert (tmp_path / "b" / hf.INDEX_FILE).is_file() and not (tmp_path / "b" / hf.SINGLE_FILE).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_exported_tokenizer_file_loads_with_its_end_of_text_token(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(hf.byte_level_tokenizer_json())
    tok.add_special_tokens(["<|endoftext|>"])  # id 256, as after the bytes
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(
        arch="llama", vocab_size=300, d_model=32, num_layers=1, num_heads=4, d_ff=48, seq_len=SEQ
    )
    out = tmp_path / "out"
    hf.save_hf_model(
        build_model(cfg, seed=0).state_dict(), cfg, out, tokenizer_file=tmp_path / "tokenizer.json"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256
    assert tokenizer.model_max_length == SEQ
    assert read_hf_config(out)["eos_token_id"] == 256
    assert tokenizer("ab")["input_ids"] == [97, 98]
    small = ModelConfig(
        arch="llama", vocab_size=200, d_model=32, num_layers=1, num_heads=4, d_ff=48, seq_len=SEQ
    )
    with pytest.raises(CheckpointError, match="beyond the model's vocab_size 200"):
        hf.save_hf_model(
            build_model(small, seed=0).state_dict(),
            small,
            tmp_path / "x",
            tokenizer_file=tmp_path / "tokenizer.json",
        )


# the CLI's derivation -----------------------------------------------------------------------------------
def test_init_from_hf_replaces_the_model_and_the_digest(saved, tmp_path, capsys):
    import argparse

    from swarmtrain.cli.common import add_run_config_args, run_config_from_args
    from swarmtrain.cli.main import main

    parser = argparse.ArgumentParser()
    add_run_config_args(parser)
    _, untied = saved(False, True)
    plain = run_config_from_args(parser.parse_args([]))
    first = run_config_from_args(parser.parse_args(["--init-from-hf", str(untied)]))
    again = run_config_from_args(parser.parse_args(["--preset", "tiny", "--init-from-hf", str(untied)]))
    assert first.model == _derived(untied) and first.training == plain.training
    assert first.digest() == again.digest() != plain.digest()

    # tied embeddings across the swarm's stages: one line, exit 2, before any process starts
    _, tied = saved(True, False)
    capsys.readouterr()  # save_pretrained's progress bar
    assert (
        main(["trainer", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--init-from-hf", str(tied)]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"swarmtrain trainer: error: --init-from-hf {tied}: this model ties")
        and "\n" not in err
    )
    assert main(["train-local", "--init-from", "a", "--init-from-hf", str(tied)]) == 2
    assert "--init-from or --init-from-hf, not both" in capsys.readouterr().err


def test_hf_config_for_export_matches_transformers_reading_of_it():
    cfg = ModelConfig(
        arch="llama", vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
        seq_len=SEQ, rope_theta=321.0,
    )  # fmt: skip
    raw = hf_config_from_model(cfg)
    assert model_config_from_hf(raw, cfg) == cfg
    hf_cfg = transformers.LlamaConfig(**raw)
    rope = getattr(hf_cfg, "rope_parameters", None) or {"rope_theta": hf_cfg.rope_theta}
    assert rope["rope_theta"] == 321.0
    # transformers 5 writes rope_parameters; 4 wrote rope_theta: both read the same base
    assert model_config_from_hf(json.loads(json.dumps(hf_cfg.to_dict())), cfg).rope_theta == 321.0


def test_train_local_and_replica_start_from_the_hf_weights(tmp_path, small_text_dir):
    from swarmtrain.cli.common import with_hf_model
    from swarmtrain.config.run import DataConfig
    from swarmtrain.runtime.local import LocalTrainer
    from swarmtrain.runtime.replica.replica_inner import InnerTrainer

    model = _llama_hf(False, vocab=300)  # byte-level data needs 256 ids
    model.save_pretrained(tmp_path)
    base = get_preset("tiny").replace(data=DataConfig(source=str(small_text_dir)))
    cfg = with_hf_model(base, str(tmp_path))
    expected = model.state_dict()
    local = LocalTrainer(cfg, progress=False, init_from_hf=tmp_path).model
    replica = InnerTrainer(cfg, init_from_hf=str(tmp_path)).model
    for whole in (local, replica):
        assert all(torch.equal(p, expected[n]) for n, p in whole.named_parameters())
    with pytest.raises(UserError, match="not both"):
        LocalTrainer(cfg, progress=False, init_from="x.safetensors", init_from_hf=tmp_path)


def test_export_from_a_whole_model_file_writes_a_hf_directory(saved, tmp_path, capsys):
    from swarmtrain.cli.main import main
    from swarmtrain.model import save_model_checkpoint

    _, path = saved(False, True)
    cfg = _derived(path)
    ours = build_model(cfg, seed=9).eval()
    save_model_checkpoint(ours, tmp_path / "model.safetensors")  # what train-local's --checkpoint-dir holds
    argv = ["export", "--from-file", str(tmp_path / "model.safetensors"), "--hf-out", str(tmp_path / "hf")]
    assert main([*argv, "--init-from-hf", str(path)]) == 0
    assert f"wrote {tmp_path / 'hf'}" in capsys.readouterr().out
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        assert _max_diff(_from_pretrained(tmp_path / "hf")(input_ids=tokens).logits, ours(tokens)) < TOL
    # the tiny preset's GPT is not this model: one line, nothing written
    assert main([*argv[:-1], str(tmp_path / "other")]) == 2
    assert "does not match the run's model config" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
