import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.model import (
    assemble_state_dict,
    build_model,
    build_stages,
    load_stage_from_checkpoint,
    save_stage_checkpoint,
)
from swarmtrain.model.checkpoint import CheckpointError

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def _batch(cfg, batch_size=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, -5:] = cfg.pad_token_id  # padding must be ignored by the loss
    return tokens[:, :-1], labels


def _chain_loss_and_grads(stages, inputs, labels):
    """Run stages the way the swarm does: each boundary is a leaf tensor; backward goes in reverse."""
    boundaries, x = [], inputs
    for stage in stages[:-1]:
        out = stage(x)
        boundaries.append((x, out))
        x = out.detach().requires_grad_(True)
    loss = stages[-1](x, labels)
    loss.backward()
    grad = x.grad
    for stage_input, stage_output in reversed(boundaries):
        stage_output.backward(grad)
        grad = stage_input.grad if stage_input.is_floating_point() else None
    grads = {}
    for stage in stages:
        grads.update({name: p.grad for name, p in stage.named_parameters()})
    return loss, grads


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_chained_stages_equal_whole_model(num_stages):
    cfg = get_preset("tiny").model
    inputs, labels = _batch(cfg)
    model = build_model(cfg, seed=3)
    ref_loss = model(inputs, labels)
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in model.named_parameters()}

    loss, grads = _chain_loss_and_grads(build_stages(cfg, num_stages, seed=3), inputs, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        rel = (grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel <= 1e-4, name


def test_padding_is_ignored():
    cfg = get_preset("tiny").model
    inputs, labels = _batch(cfg)
    model = build_model(cfg)
    all_pad = torch.full_like(labels, cfg.pad_token_id)
    all_pad[:, 0] = labels[:, 0]
    changed = labels.clone()
    changed[:, 1:] = cfg.pad_token_id
    assert torch.allclose(model(inputs, all_pad), model(inputs, changed))


def test_initial_loss_is_near_uniform():
    cfg = get_preset("tiny").model
    inputs, labels = _batch(cfg)
    assert abs(build_model(cfg)(inputs, labels).item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_checkpoints_move_between_stage_and_whole_model(tmp_path):
    cfg = get_preset("tiny").model
    stages = build_stages(cfg, 2, seed=5)
    paths = []
    for i, stage in enumerate(stages):
        paths.append(tmp_path / f"stage{i}.safetensors")
        save_stage_checkpoint(stage, paths[-1])
    whole = load_stage_from_checkpoint(build_model(cfg, seed=99), paths)
    inputs, labels = _batch(cfg)
    expected = stages[1](stages[0](inputs), labels)
    assert torch.allclose(whole(inputs, labels), expected, atol=1e-6)

    save_stage_checkpoint(whole, tmp_path / "whole.safetensors")
    rebuilt = build_stages(cfg, 4, seed=11)
    for stage in rebuilt:
        load_stage_from_checkpoint(stage, tmp_path / "whole.safetensors")
    assert set(assemble_state_dict([tmp_path / "whole.safetensors"])) == set(whole.state_dict())
    x = inputs
    for stage in rebuilt[:-1]:
        x = stage(x)
    assert torch.allclose(rebuilt[-1](x, labels), expected, atol=1e-6)


def test_checkpoint_errors(tmp_path):
    cfg = get_preset("tiny").model
    first, last = build_stages(cfg, 2)
    save_stage_checkpoint(first, tmp_path / "first.safetensors")
    with pytest.raises(CheckpointError, match="lacks"):
        load_stage_from_checkpoint(last, tmp_path / "first.safetensors")
    with pytest.raises(CheckpointError, match="not found"):
        load_stage_from_checkpoint(last, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_stage_from_checkpoint(last, tmp_path / "junk.safetensors")
