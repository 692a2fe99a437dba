"""Exact subspace boundaries (model/subspace.py), on both families: the residual of every stage but the
last is E0[token] + coordinates @ B.T, the stages compose to the whole model bit for bit, the hidden
state a stage rebuilds from the coordinates and ids equals the sender's, the gradient that crosses back is
the whole model's, an optimizer step matches, the digest tells kinds and k apart, and `export --hf-out`
writes a plain model that transformers (and train-local) load with the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from swarmtrain.cli.main import main
from swarmtrain.config import get_preset
from swarmtrain.config.errors import ConfigError
from swarmtrain.config.hf_config import read_hf_config
from swarmtrain.model import build_model, build_stage
from swarmtrain.model import hf_checkpoint as hf
from swarmtrain.model.build import fixed_subspace
from swarmtrain.net.token_ids import pack_token_ids

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

K = 8
PRESETS = ("tiny", "llama-tiny")  # GPT-2 style and Llama


def _config(
    preset: str, k: int = K, num_stages: int = 3, layers=(2, 1, 1), seq_len: int = 16, table: str = ""
):
    cfg = get_preset(preset)
    model = dataclasses.replace(
        cfg.model, boundary="subspace", boundary_dim=k, seq_len=seq_len, boundary_table=table
    )
    swarm = dataclasses.replace(cfg.swarm, num_stages=num_stages, layers_per_stage=layers)
    return cfg.replace(model=model, swarm=swarm)


def _windows(cfg, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) as the data pipeline cuts them: windows of seq_len + 1 tokens of one stream."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=generator)
    return rows[:, :-1], rows[:, 1:]


def _trained_like(*modules: torch.nn.Module, seed: int = 7) -> None:
    """Move every parameter off its initial value (the same move in every module holding it), so coordinates,
    biases and norms are not at their starts."""
    for module in modules:
        for name, param in module.named_parameters():
            generator = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            with torch.no_grad():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def _stages_and_whole(cfg, seed: int = 3):
    whole = build_model(cfg.model, seed=seed, cuts=cfg.boundary_cuts())
    stages = [build_stage(cfg.model, spec, seed=seed) for spec in cfg.stages()]
    _trained_like(whole, *stages)
    return stages, whole


def _through_stages(stages, tokens, labels=None):
    """The stages in a row as servers run them: each later stage takes the coordinates and the ids (one
    graph through all, so every stage's gradients come from one backward)."""
    coords, sent = tokens, []
    for stage in stages[:-1]:
        inputs = coords if stage.spec.is_first else pack_token_ids(coords, tokens)
        coords = stage(inputs)
        sent.append((inputs, coords))
    last_inputs = pack_token_ids(coords, tokens)
    last_inputs.retain_grad()
    return stages[-1](last_inputs, labels), sent, last_inputs


def _table_file(cfg_model, path) -> str:
    """A token table file for `cfg_model` (rows of a fixed draw, every third a zero row: drawn from the
    seed), as `swarmtrain boundary-table` writes one."""
    from swarmtrain.model.subspace import save_token_table

    rows = torch.randn(cfg_model.vocab_size, cfg_model.d_model, generator=torch.Generator().manual_seed(11))
    rows[::3] = 0.0
    save_token_table(path, rows)
    return str(path)


@pytest.mark.parametrize("preset, table", [(p, False) for p in PRESETS] + [("llama-tiny", True)])
def test_stages_compose_to_the_whole_model_bit_for_bit_and_send_k_values(preset, table, tmp_path):
    cfg = _config(preset)
    if table:
        cfg = _config(preset, table=_table_file(cfg.model, tmp_path / "table.safetensors"))
    stages, whole = _stages_and_whole(cfg)
    named = {name: p for stage in stages for name, p in stage.named_parameters()}
    assert set(named) == {name for name, _ in whole.named_parameters()}
    assert not any(name.startswith("space.") for name in whole.state_dict())  # E0, B: never saved
    tokens, labels = _windows(cfg, 2)
    loss, sent, _ = _through_stages(stages, tokens, labels)
    for _inputs, coords in sent:
        assert coords.shape == (2, cfg.model.seq_len, K)  # what crosses each boundary
    whole_loss = whole(tokens, labels)
    assert torch.equal(loss, whole_loss)
    loss.backward()
    whole_loss.backward()
    for name, param in whole.named_parameters():
        torch.testing.assert_close(named[name].grad, param.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_rebuilt_hidden_state_is_the_senders_and_the_gradient_crossing_back_is_k_wide(preset):
    cfg = _config(preset, num_stages=2, layers=(2, 2))
    stages, whole = _stages_and_whole(cfg)
    seen = {}

    def keep(key):
        def hook(_module, args):
            seen[key] = args[0]
            args[0].retain_grad()

        return hook

    # the first full-rank layer's input: the whole model's own x at the cut, and what stage 1 rebuilt
    whole.layers["2"].register_forward_pre_hook(keep("whole"))
    stages[1].layers["2"].register_forward_pre_hook(keep("rebuilt"))
    tokens, labels = _windows(cfg, 3, seed=1)
    loss, _, last_inputs = _through_stages(stages, tokens, labels)
    whole_loss = whole(tokens, labels)
    assert torch.equal(seen["rebuilt"], seen["whole"])
    # by construction: x - E0[ids] lies in B's span
    basis, table = fixed_subspace(cfg.model, seed=3)  # _stages_and_whole's seed
    residual = seen["whole"].detach() - table[tokens]
    d_over_k = cfg.model.d_model / K  # B's columns have norm sqrt(d / k)
    torch.testing.assert_close(residual @ basis @ basis.T / d_over_k, residual, rtol=0, atol=1e-6)
    loss.backward()
    whole_loss.backward()
    grad_coords = last_inputs.grad[..., :K]
    assert torch.count_nonzero(last_inputs.grad[..., K:]) == 0  # the ids' column: nothing to send
    torch.testing.assert_close(grad_coords, seen["whole"].grad @ basis, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("preset", PRESETS)
def test_an_optimizer_step_on_the_stages_equals_the_whole_models(preset):
    from swarmtrain.model.optim import build_optimizer

    cfg = _config(preset)
    stages, whole = _stages_and_whole(cfg)
    optimizers = [build_optimizer(m, cfg.training) for m in (*stages, whole)]
    for step in range(2):
        tokens, labels = _windows(cfg, 2, seed=10 + step)
        _through_stages(stages, tokens, labels)[0].backward()
        whole(tokens, labels).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    named = {name: p for stage in stages for name, p in stage.named_parameters()}
    for name, param in whole.named_parameters():
        torch.testing.assert_close(named[name], param, rtol=1e-5, atol=1e-6, msg=name)


def test_only_the_layers_before_the_last_cut_are_confined_and_the_buffers_come_from_the_seed():
    cfg = _config("llama-tiny")
    whole = build_model(cfg.model, seed=3, cuts=cfg.boundary_cuts())
    assert whole.subspace_layers == {0, 1, 2}  # stage 2 (layer 3) writes at full rank
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (cfg.model.vocab_size, K)
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (K, cfg.model.d_ff)
    assert shapes["model.layers.3.self_attn.o_proj.weight"] == (cfg.model.d_model, cfg.model.d_model)
    basis = whole.space.basis
    torch.testing.assert_close(basis.T @ basis, torch.eye(K) * cfg.model.d_model / K, rtol=0, atol=1e-5)
    other = build_model(cfg.model, seed=4, cuts=cfg.boundary_cuts())
    assert torch.equal(build_model(cfg.model, seed=3).space.table, whole.space.table)
    assert not torch.equal(other.space.table, whole.space.table)


@pytest.mark.parametrize("k", (4, 16))
def test_the_fixed_parts_scales_give_a_k_wide_write_a_full_writes_energy_and_e0_its_size(k):
    """B's columns have norm sqrt(d / k), so coordinates c put |c| x sqrt(d / k) into the stream, what
    d values of c's size do (orthonormal columns put k / d of that energy; the loss gap doubled), and E0
    is drawn at TABLE_SCALE x init_std (at init_std the loss gap was larger: docs/LOG.md, "Subspace
    scales")."""
    from swarmtrain.model.subspace import TABLE_SCALE

    model = _config("llama-tiny", k=k).model
    d = model.d_model
    basis, table = fixed_subspace(model, seed=5)
    torch.testing.assert_close(basis.T @ basis, torch.eye(k) * d / k, rtol=0, atol=1e-5)
    coords = torch.randn(1000, k, generator=torch.Generator().manual_seed(0))
    full = torch.randn(1000, d, generator=torch.Generator().manual_seed(1))
    lifted = (coords @ basis.T).pow(2).sum(-1).mean()
    assert lifted / full.pow(2).sum(-1).mean() == pytest.approx(1.0, rel=0.1)
    assert TABLE_SCALE == 8.0
    assert table.std().item() == pytest.approx(TABLE_SCALE * model.init_std, rel=0.02)


def test_the_digest_tells_boundaries_and_k_apart_and_bad_settings_are_one_line_errors():
    base = get_preset("small")

    def digest(kind, k):
        return base.replace(model=dataclasses.replace(base.model, boundary=kind, boundary_dim=k)).digest()

    digests = [base.digest(), digest("subspace", 8), digest("subspace", 16), digest("lowrank", 8)]
    assert len(set(digests)) == len(digests)
    llama = get_preset("llama-tiny").model
    with pytest.raises(ConfigError, match="needs model.tie_embeddings = false"):
        dataclasses.replace(llama, boundary="subspace", boundary_dim=8, tie_embeddings=True)
    with pytest.raises(ConfigError, match="below d_model"):
        dataclasses.replace(llama, boundary="subspace", boundary_dim=llama.d_model)


@pytest.mark.parametrize("preset, table", [(p, False) for p in PRESETS] + [(p, True) for p in PRESETS])
def test_export_hf_out_folds_into_a_plain_model_transformers_loads_with_the_same_logits(
    preset, table, tmp_path
):
    transformers = pytest.importorskip("transformers")
    cfg = _config(preset, num_stages=2, layers=None, seq_len=get_preset(preset).model.seq_len)
    table_flags = []
    if table:  # E0 from a file: the fold writes the file's rows (scaled) into the plain embedding
        path = _table_file(cfg.model, tmp_path / "table.safetensors")
        cfg, table_flags = (
            cfg.replace(model=dataclasses.replace(cfg.model, boundary_table=path)),
            [
                "--boundary-table",
                path,
            ],
        )
    whole = build_model(cfg.model, seed=cfg.training.seed, cuts=cfg.boundary_cuts())
    _trained_like(whole)
    save_file(
        {n: p.detach().contiguous() for n, p in whole.named_parameters()}, str(tmp_path / "m.safetensors")
    )
    flags = ["--preset", preset, "--boundary", "subspace", "--boundary-dim", str(K), *table_flags]
    out = tmp_path / "hf"
    assert main(["export", "--from-file", str(tmp_path / "m.safetensors"), "--hf-out", str(out), *flags]) == 0
    raw = read_hf_config(out)
    assert raw["model_type"] == ("llama" if preset == "llama-tiny" else "gpt2")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    tokens, _ = _windows(cfg, 2, seed=5)
    with torch.no_grad():
        ours = whole.eval()(tokens)
        theirs = model.float().eval()(input_ids=tokens).logits
        assert (ours - theirs).abs().max().item() < 1e-4
        # and train-local's way in (--init-from-hf): a plain model of the run's shape
        plain_model = dataclasses.replace(cfg.model, boundary="none", boundary_dim=0, boundary_table="")
        plain = build_model(plain_model, seed=0)
        hf.load_stage_from_hf(plain, out)
        assert (plain.eval()(tokens) - ours).abs().max().item() < 1e-4


def test_export_refuses_a_config_that_is_not_the_runs(tmp_path, capsys):
    cfg = _config("llama-tiny", num_stages=2, layers=None, seq_len=64)
    whole = build_model(cfg.model, seed=cfg.training.seed, cuts=cfg.boundary_cuts())
    path = tmp_path / "m.safetensors"
    save_file(
        {n: p.detach().contiguous() for n, p in whole.named_parameters()}, str(path), {"digest": '"0123"'}
    )
    args = ["export", "--from-file", str(path), "--hf-out", str(tmp_path / "hf"), "--preset", "llama-tiny"]
    assert main([*args, "--boundary", "subspace", "--boundary-dim", str(K)]) == 2
    assert "fixed token table and basis come from the run's config" in capsys.readouterr().err
    assert main(args) == 2  # the plain preset: the coordinates do not fit its shapes
    assert "of another shape" in capsys.readouterr().err
    assert main([*args, "--boundary", "lowrank", "--boundary-dim", str(K)]) == 2
    assert "use --out" in capsys.readouterr().err


def test_boundary_flags_set_the_run_wherever_its_config_is_read_and_refuse_half_settings(capsys):
    import argparse

    from swarmtrain.cli.common import add_run_config_args, run_config_from_args

    parser = argparse.ArgumentParser()
    add_run_config_args(parser)
    plain = run_config_from_args(parser.parse_args(["--preset", "small"]))
    cfg = run_config_from_args(
        parser.parse_args(["--preset", "small", "--boundary", "subspace", "--boundary-dim", "16"])
    )
    assert (cfg.model.boundary, cfg.model.boundary_dim, cfg.model.wire_dim) == ("subspace", 16, 16)
    assert cfg.digest() != plain.digest() and cfg.training == plain.training
    back = run_config_from_args(parser.parse_args(["--preset", "small", "--boundary", "none"]))
    assert back.digest() == plain.digest()
    for argv, words in (
        (["--boundary", "subspace"], "needs --boundary-dim"),
        (["--boundary-dim", "8"], "needs --boundary KIND"),
        (["--boundary", "none", "--boundary-dim", "8"], "takes no --boundary-dim"),
        (["--boundary", "subspace", "--boundary-dim", "64"], "below d_model"),
    ):
        assert main(["train-local", "--preset", "tiny", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
    for command in ("server", "trainer", "replica", "status", "monitor", "export", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--boundary-dim K" in capsys.readouterr().out, command


def test_init_from_hf_with_a_boundary_is_a_one_line_error(tmp_path, capsys):
    plain = get_preset("tiny").model
    hf.save_hf_model(build_model(plain, seed=0).state_dict(), plain, tmp_path / "hf")
    argv = [
        "train-local",
        "--init-from-hf",
        str(tmp_path / "hf"),
        "--boundary",
        "subspace",
        "--boundary-dim",
        "8",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--init-from-hf starts from a plain model" in err and "'subspace'" in err and "\n" not in err
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\n[model]\nboundary = "lowrank-embed"\nboundary_dim = 32\n')
    assert main(["train-local", "--config", str(toml), "--init-from-hf", str(tmp_path / "hf")]) == 2
    assert "'lowrank-embed'" in capsys.readouterr().err  # no silent drop to a plain model


def test_the_demo_writes_the_boundary_into_the_run_file_every_peer_reads(tmp_path):
    from swarmtrain.config import load_run_config
    from swarmtrain.runtime.harness.demo import DemoOptions, _run_file

    overrides = {"boundary": "subspace", "boundary_dim": 8}
    written = load_run_config(
        _run_file(DemoOptions(preset="llama-tiny", overrides={"model": overrides}), tmp_path)
    )
    assert (written.model.boundary, written.model.boundary_dim, written.preset) == (
        "subspace",
        8,
        "llama-tiny",
    )
    own = tmp_path / "own.toml"
    own.write_text('preset = "tiny"\n[training]\nseed = 5\n')
    options = DemoOptions(config_path=str(own), overrides={"model": overrides})
    derived = load_run_config(_run_file(options, tmp_path))
    assert (derived.model.boundary, derived.training.seed) == ("subspace", 5)
    assert _run_file(DemoOptions(config_path=str(own)), tmp_path) == str(own)


PEER_ADDRESS = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"


@pytest.mark.parametrize(
    "command",
    [
        ["server", "--stage", "0", "--initial-peers", PEER_ADDRESS],
        ["trainer", "--initial-peers", PEER_ADDRESS],
        ["status", "--initial-peers", PEER_ADDRESS],
        ["monitor"],
        ["export", "--checkpoint-dir", "ckpt"],
        ["replica", "--initial-peers", PEER_ADDRESS],
    ],
    ids=lambda argv: argv[0],
)
def test_compression_on_the_command_line_replaces_the_run_files_and_names_the_run(command):
    """The recommended slow-link setting (4-bit + subspace) is a run of its own: every command that finds
    a run by its digest takes `--compression` as the run file's `swarm.compression`."""
    from swarmtrain.cli.common import run_config_from_args
    from swarmtrain.cli.main import build_parser

    def config(*extra):
        return run_config_from_args(build_parser().parse_args([*command, "--preset", "llama-tiny", *extra]))

    low_bit = config("--compression", "4bit", "--boundary", "subspace", "--boundary-dim", "4")
    assert low_bit.swarm.compression == "4bit" and low_bit.model.boundary == "subspace"
    assert low_bit.digest() != config("--boundary", "subspace", "--boundary-dim", "4").digest()
    assert config("--compression", "8bit").digest() == config().digest()  # 8 bits and up: not in it
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--compression", "5bit"])


def test_train_local_and_boundary_table_take_no_compression(capsys):
    from swarmtrain.cli.main import build_parser

    for command in (["train-local"], ["boundary-table", "--out", "table.safetensors"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--compression", "4bit"])
        assert "unrecognized arguments: --compression" in capsys.readouterr().err


def test_the_demo_writes_the_codec_beside_its_own_swarm_settings(tmp_path):
    from swarmtrain.cli.demo import _overrides
    from swarmtrain.cli.main import build_parser
    from swarmtrain.config import load_run_config
    from swarmtrain.runtime.harness.demo import DEMO_SWARM, DemoOptions, _run_file

    args = build_parser().parse_args(["demo", "--preset", "llama-tiny", "--compression", "4bit"])
    overrides = _overrides(args, get_preset("llama-tiny"))
    written = load_run_config(_run_file(DemoOptions(preset="llama-tiny", overrides=overrides), tmp_path))
    assert written.swarm.compression == "4bit" and written.model.boundary == "none"
    assert written.swarm.announce_period_s == DEMO_SWARM["announce_period_s"]
    own = tmp_path / "own.toml"
    own.write_text('preset = "tiny"\n[swarm]\ncompression = "none"\nrequest_timeout_s = 7.0\n')
    derived = load_run_config(_run_file(DemoOptions(config_path=str(own), overrides=overrides), tmp_path))
    assert (derived.swarm.compression, derived.swarm.request_timeout_s) == ("4bit", 7.0)
