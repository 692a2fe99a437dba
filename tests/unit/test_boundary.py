"""Compression-aware stage boundaries (model/boundary.py): the stages compose to the whole model that
train-local builds (outputs and every parameter's gradient), the wire carries boundary_dim values per
token, the low-rank boundary starts as a projection, and the settings are checked and in the digest."""

import dataclasses

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.config.errors import ConfigError
from swarmtrain.model import build_model, build_stage
from swarmtrain.net.protocol import StageIO

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

KINDS = ("bottleneck", "maxout", "lowrank", "lowrank-embed")


def _config(preset: str, kind: str, dim: int | None = 16, num_stages: int = 2, layers=None):
    cfg = get_preset(preset)
    model = dataclasses.replace(cfg.model, boundary=kind, boundary_dim=dim)
    swarm = dataclasses.replace(cfg.swarm, num_stages=num_stages, layers_per_stage=layers)
    return cfg.replace(model=model, swarm=swarm)


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("kind", KINDS)
def test_stages_compose_to_the_whole_model(preset, kind):
    cfg = _config(preset, kind, num_stages=3, layers=(2, 1, 1))
    whole = build_model(cfg.model, seed=3, cuts=cfg.boundary_cuts())
    stages = [build_stage(cfg.model, spec, seed=3) for spec in cfg.stages()]
    named = {name: p for stage in stages for name, p in stage.named_parameters()}
    assert set(named) == {name for name, _ in whole.named_parameters()}
    for name, param in whole.named_parameters():
        assert torch.equal(param, named[name]), name
    tokens, labels = _windows(cfg, 2)
    hidden = tokens
    for stage in stages[:-1]:
        hidden = stage(hidden)
        assert hidden.shape == (2, cfg.model.seq_len, 16)  # what crosses the boundary
    loss = stages[-1](hidden, labels)
    whole_loss = whole(tokens, labels)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    whole_loss.backward()
    for name, param in whole.named_parameters():
        torch.testing.assert_close(named[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(name.startswith("boundaries.1.") for name in named)


def _windows(cfg, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) as the data pipeline cuts them: windows of seq_len + 1 tokens of one stream."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=generator)
    return rows[:, :-1], rows[:, 1:]


def test_lowrank_embed_starts_as_lowrank_and_only_its_last_boundary_embeds_tokens():
    cfg = _config("llama-tiny", "lowrank-embed", num_stages=3, layers=(2, 1, 1))
    plain = _config("llama-tiny", "lowrank", num_stages=3, layers=(2, 1, 1))
    tokens, labels = _windows(cfg, 2)
    whole = build_model(cfg.model, seed=5, cuts=cfg.boundary_cuts())
    as_lowrank = build_model(plain.model, seed=5, cuts=plain.boundary_cuts())
    torch.testing.assert_close(whole(tokens, labels), as_lowrank(tokens, labels))  # T starts at zero
    embedded = [name for name, _ in whole.named_parameters() if ".tokens." in name]
    assert embedded == ["boundaries.1.up.tokens.weight"]  # before the last stage only
    assert whole.boundaries["1"].up.tokens.weight.shape == (cfg.model.vocab_size + 1, cfg.model.d_model)
    last = build_stage(cfg.model, cfg.stages()[2], seed=5)
    with pytest.raises(ValueError, match="needs the labels"):
        last(torch.randn(2, cfg.model.seq_len, 16))


@pytest.mark.parametrize("kind", ["none", *KINDS])
def test_only_the_last_stage_behind_lowrank_embed_reads_labels(kind):
    """The server passes labels to logits-only forwards where a stage reads them, and only there."""
    cfg = _config("llama-tiny", kind, dim=16 if kind != "none" else None, num_stages=3, layers=(2, 1, 1))
    stages = [build_stage(cfg.model, spec, seed=0) for spec in cfg.stages()]
    assert [s.reads_labels for s in stages] == [False, False, kind == "lowrank-embed"]
    assert not build_model(cfg.model, seed=0, cuts=cfg.boundary_cuts()).reads_labels  # reads its inputs


def test_lowrank_embed_reads_the_current_token_from_the_label_before_it():
    from swarmtrain.model.boundary import current_ids_from_inputs, current_ids_from_labels

    labels = torch.tensor([[5, 7, -100, 3], [1, 2, 3, 9]])
    inputs = torch.tensor([[4, 5, 7, 11], [0, 1, 2, 3]])
    by_labels = current_ids_from_labels(labels, vocab_size=9)
    assert by_labels.tolist() == [[9, 5, 7, 9], [9, 1, 2, 3]]  # position 0 and an ignored label: unknown
    assert current_ids_from_inputs(inputs, vocab_size=9).tolist() == [[9, 5, 7, 11], [9, 1, 2, 3]]
    assert inputs[0, 0] == 4  # not changed in place


def test_a_trained_token_embedding_changes_what_the_last_stage_computes():
    """Once T is not zero the last stage's loss depends on the labels' tokens, identically in the
    stages and the whole model (a changed T, not a shortcut through the labels' own positions)."""
    cfg = _config("llama-tiny", "lowrank-embed")
    whole = build_model(cfg.model, seed=1, cuts=cfg.boundary_cuts())
    stages = [build_stage(cfg.model, spec, seed=1) for spec in cfg.stages()]
    with torch.no_grad():
        fill = torch.randn(
            cfg.model.vocab_size + 1, cfg.model.d_model, generator=torch.Generator().manual_seed(2)
        )
        whole.boundaries["0"].up.tokens.weight.copy_(fill)
        stages[1].boundaries["0"].up.tokens.weight.copy_(fill)
    tokens, labels = _windows(cfg, 3)
    torch.testing.assert_close(
        stages[1](stages[0](tokens), labels), whole(tokens, labels), rtol=1e-5, atol=1e-6
    )
    untrained = build_model(cfg.model, seed=1, cuts=cfg.boundary_cuts())
    with torch.no_grad():
        assert abs(float(untrained(tokens, labels)) - float(whole(tokens, labels))) > 1e-3


def test_a_stage_of_no_layers_between_two_boundaries():
    """layers_per_stage may give a stage no layers: its boundaries still sit in order (up, then down)."""
    cfg = _config("tiny", "bottleneck", num_stages=3, layers=(2, 0, 2))
    whole = build_model(cfg.model, seed=0, cuts=cfg.boundary_cuts())
    stages = [build_stage(cfg.model, spec, seed=0) for spec in cfg.stages()]
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 8))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, whole(tokens), rtol=1e-5, atol=1e-6)


def test_the_lowrank_boundary_starts_as_a_projection_onto_its_subspace():
    cfg = _config("tiny", "lowrank", dim=8)
    whole = build_model(cfg.model, seed=0, cuts=cfg.boundary_cuts())
    boundary = whole.boundaries["0"]
    x = torch.randn(5, cfg.model.d_model)
    with torch.no_grad():
        once = boundary(x)
        twice = boundary(once)
    torch.testing.assert_close(twice, once, rtol=1e-5, atol=1e-5)  # a projection is idempotent
    basis = boundary.up.proj.weight.detach()  # d x r, orthonormal columns
    torch.testing.assert_close(basis.T @ basis, torch.eye(8), rtol=1e-5, atol=1e-5)
    residual = x - once
    assert float((residual @ basis).abs().max()) < 1e-5  # what is dropped is orthogonal to the subspace


def test_maxout_takes_the_larger_of_each_pair():
    cfg = _config("tiny", "maxout", dim=4)
    stage0 = build_stage(cfg.model, cfg.stages()[0], seed=0)
    down = stage0.boundaries["0"].down  # type: ignore[union-attr]
    x = torch.randn(3, cfg.model.d_model)
    pairs = down.proj(x).view(3, 4, 2)
    torch.testing.assert_close(down(x), pairs.max(dim=-1).values)


def test_stage_io_accepts_boundary_dim_values_per_token():
    cfg = _config("tiny", "bottleneck", dim=24)
    io = StageIO.from_config(cfg.model, cfg.stages()[1], max_batch=8)
    assert io.wire_dim == 24
    assert StageIO.from_config(get_preset("tiny").model, cfg.stages()[1], 8).wire_dim == 64


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"boundary": "zip", "boundary_dim": 8}, "model.boundary must be one of"),
        ({"boundary": "lowrank", "boundary_dim": 0}, "boundary_dim must be in 1..63"),
        ({"boundary": "lowrank", "boundary_dim": 64}, "boundary_dim must be in 1..63"),
        ({"boundary_dim": 8}, "boundary_dim needs model.boundary"),
    ],
)
def test_bad_boundary_settings_are_one_line_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(get_preset("tiny").model, **fields)


def test_boundary_layers_are_in_the_digest_and_plain_digests_stay():
    plain = get_preset("tiny")
    assert _config("tiny", "lowrank").digest() != plain.digest()
    assert _config("tiny", "lowrank").digest() != _config("tiny", "bottleneck").digest()
    assert _config("tiny", "lowrank", dim=8).digest() != _config("tiny", "lowrank", dim=16).digest()
    model = dataclasses.replace(plain.model, boundary="none", boundary_dim=0)
    assert plain.replace(model=model).digest() == plain.digest()
    assert plain.boundary_cuts() == () and _config("tiny", "lowrank").boundary_cuts() == (2,)


def test_train_local_carries_the_boundary_layers_in_its_checkpoint(tmp_path):
    from safetensors import safe_open

    from swarmtrain.runtime.local import LocalTrainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000))
    )
    cfg = _config("tiny", "lowrank")
    cfg = cfg.replace(
        training=dataclasses.replace(cfg.training, max_samples=64, eval_every_samples=0, eval_samples=8),
        data=dataclasses.replace(cfg.data, source=str(corpus)),
    )
    trainer = LocalTrainer(cfg, checkpoint_dir=tmp_path / "ckpt", progress=False)
    trainer.train()
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"boundaries.0.down.proj.weight", "boundaries.0.up.proj.weight"} <= names


def _write_whole_model(cfg, path):
    from safetensors.torch import save_file

    model = build_model(cfg.model, seed=0, cuts=cfg.boundary_cuts())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def test_export_to_hugging_face_refuses_boundary_layers_in_one_line(tmp_path, capsys):
    from swarmtrain.cli.main import main
    from swarmtrain.runtime.harness.local_swarm import write_run_toml

    cfg = _config("llama-tiny", "lowrank")
    run = write_run_toml(
        tmp_path / "run.toml", "llama-tiny", {"model": {"boundary": "lowrank", "boundary_dim": 16}}
    )
    _write_whole_model(cfg, tmp_path / "model.safetensors")
    argv = ["export", "--from-file", str(tmp_path / "model.safetensors"), "--config", str(run)]
    assert main([*argv, "--hf-out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no longer a plain Llama" in err and "--out" in err
    assert not (tmp_path / "hf").exists()
    assert main([*argv, "--out", str(tmp_path / "out.safetensors")]) == 0  # its own format carries them


def test_a_codec_only_run_still_exports_a_plain_hugging_face_model(tmp_path):
    from swarmtrain.cli.main import main
    from swarmtrain.runtime.harness.local_swarm import write_run_toml

    run = write_run_toml(tmp_path / "run.toml", "llama-tiny", {"swarm": {"compression": "4bit-rht"}})
    _write_whole_model(get_preset("llama-tiny"), tmp_path / "model.safetensors")
    argv = ["export", "--from-file", str(tmp_path / "model.safetensors"), "--config", str(run)]
    assert main([*argv, "--hf-out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
