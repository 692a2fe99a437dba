"""Stage checkpoints on disk (runtime/server/stage_checkpoint.py): a round trip restores parameters,
optimizer state, step and samples exactly; the last K are kept; incomplete, corrupt or foreign files
are never loaded; a whole model assembles from stage files."""

import json

import pytest
import torch

from swarmtrain.model import build_model
from swarmtrain.model.checkpoint import load_stage_from_checkpoint
from swarmtrain.net.protocol import StageRequest
from swarmtrain.runtime.server.stage_checkpoint import (
    CheckpointSettings,
    StageCheckpointer,
    StageCheckpointError,
    list_checkpoints,
)
from swarmtrain.runtime.server.stage_worker import StageWorker

pytestmark = pytest.mark.unit


def _trained_worker(cfg, stage: int, steps: int) -> StageWorker:
    """A stage worker after `steps` real optimizer steps (so Adam's moments are not zero)."""
    spec = cfg.stages()[stage]
    worker = StageWorker(cfg, spec)
    generator = torch.Generator().manual_seed(stage)
    for step in range(steps):
        shape = (8, cfg.model.seq_len) if spec.is_first else (8, cfg.model.seq_len, cfg.model.wire_dim)
        x = (
            torch.randint(0, 256, shape, generator=generator)
            if spec.is_first
            else torch.randn(shape, generator=generator)
        )
        if spec.is_last:
            y = torch.randint(0, 256, (8, cfg.model.seq_len), generator=generator)
            worker.forward(StageRequest("forward_backward", f"m{step}", "none", x, step=step, labels=y))
        else:
            out = worker.forward(StageRequest("forward", f"m{step}", "none", x, step=step)).tensor("outputs")
            worker.backward(
                StageRequest("backward", f"m{step}", "none", x, step=step, grad_outputs=torch.ones_like(out))
            )
        bucket = worker.seal(step)
        worker.apply_step(step, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)
    return worker


def _checkpointer(cfg, directory, stage=0, keep=3, every_steps=1):
    spec = cfg.stages()[stage]
    identity = {
        "run_id": "r",
        "digest": cfg.digest(),
        "layer_start": spec.layer_start,
        "layer_end": spec.layer_end,
    }
    settings = CheckpointSettings(directory=directory, every_steps=every_steps, keep=keep)
    return spec, identity, settings


@pytest.mark.parametrize("stage", [0, 1])
def test_round_trip_restores_parameters_optimizer_step_and_samples(tiny_cfg, tmp_path, stage):
    worker = _trained_worker(tiny_cfg, stage, steps=3)
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, stage)
    checkpointer = StageCheckpointer(settings, stage, identity, worker.export_state)
    checkpointer.save(worker.epoch).result(timeout=30)

    fresh = StageWorker(tiny_cfg, tiny_cfg.stages()[stage])
    checkpoint, meta, tensors = checkpointer.load_newest(fresh.names)
    fresh.import_state(meta, tensors)
    assert (checkpoint.step, fresh.epoch, fresh.samples_seen) == (3, 3, worker.samples_seen)
    _, want = worker.export_state()
    _, got = fresh.export_state()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert float(fresh.optimizer.state[fresh.params[0]]["exp_avg_sq"].abs().sum()) > 0
    manifest = json.loads(checkpoint.manifest_path.read_text())
    assert manifest["stage"] == stage and manifest["digest"] == tiny_cfg.digest() and manifest["step"] == 3


def test_keeps_the_last_k_and_saves_only_when_due(tiny_cfg, tmp_path):
    worker = _trained_worker(tiny_cfg, 0, steps=1)
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, keep=2, every_steps=2)
    checkpointer = StageCheckpointer(settings, 0, identity, worker.export_state)
    saved = []
    for step in range(1, 8):
        worker.epoch = step  # the step number is all `due` looks at
        if checkpointer.due(step):
            checkpointer.save(step).result(timeout=30)
            saved.append(step)
    assert saved == [2, 4, 6]
    assert [c.step for c in list_checkpoints(tmp_path, 0, tiny_cfg.digest())] == [4, 6]
    assert sorted(p.name for p in (tmp_path / "stage0").iterdir()) == [
        "step00000004.json",
        "step00000004.safetensors",
        "step00000006.json",
        "step00000006.safetensors",
    ]


def test_a_replayed_step_is_not_saved_over_the_stages_checkpoint(tiny_cfg, tmp_path):
    """The directory is shared by a stage's replicas: a step replayed from a peer's means (`live` False)
    writes no checkpoint, so a replayer whose state was off cannot replace the file the replicas that
    ran the step live wrote; the next live step that is due is saved as usual."""
    worker = _trained_worker(tiny_cfg, 0, steps=1)
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, every_steps=2)
    checkpointer = StageCheckpointer(settings, 0, identity, worker.export_state)
    for step, live in ((1, False), (2, False), (3, True), (4, True)):
        worker.epoch = step
        checkpointer.after_step(step, live)
        if checkpointer._pending is not None:
            checkpointer._pending.result(timeout=30)
    assert [c.step for c in list_checkpoints(tmp_path, 0, tiny_cfg.digest())] == [4]


def test_incomplete_corrupt_and_foreign_checkpoints_are_skipped(tiny_cfg, tmp_path):
    worker = _trained_worker(tiny_cfg, 0, steps=2)
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, keep=10)
    checkpointer = StageCheckpointer(settings, 0, identity, worker.export_state)
    checkpointer.save(2).result(timeout=30)
    folder = tmp_path / "stage0"
    # step 3: tensors without a manifest (a crash between the two renames)
    (folder / "step00000003.safetensors").write_bytes(b"half")
    # step 4: a manifest whose tensors are corrupt
    manifest = json.loads((folder / "step00000002.json").read_text())
    (folder / "step00000004.json").write_text(json.dumps(dict(manifest, step=4)))
    (folder / "step00000004.safetensors").write_bytes(b"not a safetensors file")
    # step 5: another run config's checkpoint
    (folder / "step00000005.json").write_text(json.dumps(dict(manifest, step=5, digest="other")))
    (folder / "step00000005.safetensors").write_bytes((folder / "step00000002.safetensors").read_bytes())

    assert [c.step for c in list_checkpoints(tmp_path, 0, tiny_cfg.digest())] == [2, 4]
    checkpoint, meta, _ = checkpointer.load_newest(worker.names)
    assert checkpoint.step == 2 and meta["epoch"] == 2


def test_stage_files_assemble_into_the_whole_model(tiny_cfg, tmp_path):
    paths = []
    for stage in (0, 1):
        worker = _trained_worker(tiny_cfg, stage, steps=1)
        _, identity, settings = _checkpointer(tiny_cfg, tmp_path, stage)
        StageCheckpointer(settings, stage, identity, worker.export_state).save(1).result(timeout=30)
        paths.append(tmp_path / f"stage{stage}" / "step00000001.safetensors")
    model = load_stage_from_checkpoint(build_model(tiny_cfg.model, seed=123), paths)
    worker = _trained_worker(tiny_cfg, 1, steps=1)
    assert torch.equal(dict(model.named_parameters())[worker.names[0]], worker.params[0])


def test_keep_must_be_positive(tiny_cfg, tmp_path):
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, keep=0)
    with pytest.raises(StageCheckpointError):
        StageCheckpointer(settings, 0, identity, lambda: None)


def _export_two_trained_stages(cfg, tmp_path):
    """Both stages after 2 steps, checkpointed at step 2 and exported (`swarmtrain export --out`)."""
    from swarmtrain.cli.main import main

    workers = []
    for stage in (0, 1):
        worker = _trained_worker(cfg, stage, steps=2)
        _, identity, settings = _checkpointer(cfg, tmp_path / "ckpt", stage)
        identity["num_stages"] = 2
        StageCheckpointer(settings, stage, identity, worker.export_state).save(2).result(timeout=30)
        workers.append(worker)
    out = tmp_path / "model.safetensors"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    return workers, out


def test_export_then_train_local_init_from_gives_the_swarm_stages_logits(tiny_cfg, tmp_path, capsys):
    from swarmtrain.runtime.local import LocalTrainer

    workers, out = _export_two_trained_stages(tiny_cfg, tmp_path)
    assert "2 stage(s) at step 2" in capsys.readouterr().out

    local = LocalTrainer(tiny_cfg, progress=False, init_from=out)
    tokens = torch.randint(0, 256, (2, tiny_cfg.model.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = workers[1].module(workers[0].module(tokens))
        assert torch.equal(local.model(tokens), expected)


def test_stage_checkpoints_carry_the_boundary_layers_into_export_and_train_local(tiny_cfg, tmp_path, capsys):
    """Each stage saves its half of the boundary under global names (the last stage's token embedding
    too, trained off zero), and the exported whole model computes what the two stages do."""
    import dataclasses

    from swarmtrain.runtime.local import LocalTrainer

    cfg = tiny_cfg.replace(
        model=dataclasses.replace(tiny_cfg.model, boundary="lowrank-embed", boundary_dim=16)
    )
    workers, out = _export_two_trained_stages(cfg, tmp_path)
    halves = {"boundaries.0.down.proj.weight", "boundaries.0.up.proj.weight", "boundaries.0.up.tokens.weight"}
    assert halves <= set(workers[0].names) | set(workers[1].names)
    tokens_weight = workers[1].params[workers[1].names.index("boundaries.0.up.tokens.weight")]
    assert float(tokens_weight.detach().abs().max()) > 0  # trained off its zero start

    local = LocalTrainer(cfg, progress=False, init_from=out)
    rows = torch.randint(0, 256, (2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(5))
    tokens, labels = rows[:, :-1], rows[:, 1:]
    with torch.no_grad():
        expected = workers[1].module(workers[0].module(tokens), labels, True)
        torch.testing.assert_close(local.model(tokens, labels, True), expected, rtol=1e-5, atol=1e-6)


def test_export_refuses_an_incomplete_model(tiny_cfg, tmp_path, capsys):
    from swarmtrain.cli.main import main

    worker = _trained_worker(tiny_cfg, 0, steps=1)
    _, identity, settings = _checkpointer(tiny_cfg, tmp_path, 0)
    identity["num_stages"] = 2
    StageCheckpointer(settings, 0, identity, worker.export_state).save(1).result(timeout=30)
    assert main(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "m.safetensors")]) != 0
    assert "no checkpoint of stage(s) [1]" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


def test_time_based_checkpoints_fall_on_the_next_step_after_the_period(tiny_cfg, tmp_path, monkeypatch):
    import swarmtrain.runtime.server.stage_checkpoint as module

    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    worker = _trained_worker(tiny_cfg, 0, steps=1)
    spec, identity, _ = _checkpointer(tiny_cfg, tmp_path)
    settings = CheckpointSettings(directory=tmp_path, every_steps=0, every_s=60.0)
    checkpointer = StageCheckpointer(settings, 0, identity, worker.export_state)
    assert not checkpointer.due(1)
    clock[0] += 61.0
    assert checkpointer.due(2)
    checkpointer.save(2).result(timeout=30)
    assert not checkpointer.due(3)  # the period starts again at the save
