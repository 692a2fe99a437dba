"""Exact subspace boundaries (model/subspace.py, net/token_ids.py) through a real swarm: stage servers hand
the coordinates and the token ids to each other over the direct data plane. Without a codec a micro-batch
through three stages (a middle one included) equals the whole model that train-local builds, loss and every
gradient; with 4-bit coordinates it stays close. A short training run with the data's token table
(`swarmtrain boundary-table`, `[model] boundary_table`) and checkpoints exports with `export --hf-out` as
a plain model that transformers loads with no missing or unexpected weights and the
logits of the servers' own stages within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm_fixtures import start_servers
from swarmtrain.cli.common import with_boundary, with_compression
from swarmtrain.cli.main import main
from swarmtrain.data import build_datasets
from swarmtrain.model import build_stage, load_stage_from_checkpoint
from swarmtrain.runtime.server.stage_checkpoint import list_checkpoints
from whole_model import exact_micro_batch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")

SUBSPACE = {"boundary": "subspace", "boundary_dim": 8}
SAMPLES = 128  # 4 global steps of 32
EVAL_SAMPLES = 32
TOL = 1e-4


def test_a_micro_batch_through_three_subspace_stages_equals_the_whole_model(make_swarm):
    swarm, cfg = make_swarm("llama-tiny", {"model": SUBSPACE, "swarm": {"num_stages": 3}})
    start_servers(swarm, {"s0": 0, "s1": 1, "s2": 2})
    probe = make_swarm.probe(cfg, swarm, codec="none")
    probe.wait_for_peers([1, 1, 1])
    inputs, labels, local_loss, local, grads = exact_micro_batch(probe, cfg, 3)
    n = inputs.shape[0]
    for name, grad in grads.items():
        torch.testing.assert_close(grad / n, local[name], rtol=1e-4, atol=1e-6, msg=name)
    direct = sum(probe.info(peer).header["direct_in"] for stage in (1, 2) for peer in probe.peers(stage))
    assert direct >= 2  # the hand-offs took the data plane, ids and all

    probe.set_codec("4bit")
    loss_4bit = probe.forward_backward("4bit", inputs, labels)
    print(f"subspace k=8, 4-bit coordinates: loss {loss_4bit:.5f} vs {local_loss:.5f}")
    assert loss_4bit == pytest.approx(local_loss, rel=0.02)


def test_a_subspace_swarm_trains_and_exports_a_plain_model_transformers_loads(make_swarm, tmp_path, capsys):
    import json as json_module  # the data source: a small stdlib package, read in well under a second

    checkpoints = tmp_path / "checkpoints"
    data = {"source": str(Path(json_module.__file__).parent)}
    # the token table made from the same data, as a user makes it (`swarmtrain boundary-table`)
    table_run, table = tmp_path / "table-run.toml", tmp_path / "table.safetensors"
    table_run.write_text(f'preset = "llama-tiny"\n[data]\nsource = "{data["source"]}"\n')
    assert main(["boundary-table", "--config", str(table_run), "--out", str(table)]) == 0
    # 4-bit coordinates and the boundary given on every command line, as a user of the README's example
    # does, over a run file that names neither (a peer of other settings is refused by the digest)
    flags = [
        "--compression",
        "4bit",
        "--boundary",
        "subspace",
        "--boundary-dim",
        str(SUBSPACE["boundary_dim"]),
    ]
    flags += ["--boundary-table", str(table)]
    swarm, plain = make_swarm("llama-tiny", {"data": data, "training": {"eval_samples": EVAL_SAMPLES}})
    cfg = with_compression(with_boundary(plain, "subspace", SUBSPACE["boundary_dim"], str(table)), "4bit")
    swarm.start_dht()
    for stage in (0, 1):
        swarm.start_server(f"s{stage}", stage, "--checkpoint-dir", str(checkpoints), *flags)
    swarm.wait_ready(["s0", "s1"])
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES)]
    swarm.start_trainer("trainer", "--in-flight", "4", *args, *flags)
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    steps = SAMPLES // cfg.training.global_batch_size
    assert summary["steps"] == steps and summary["microbatches_failed"] == 0, summary
    swarm.stop_all()  # SIGTERM: each server writes its final checkpoint

    hf_out = tmp_path / "hf_out"
    argv = [
        "export",
        "--checkpoint-dir",
        str(checkpoints),
        "--hf-out",
        str(hf_out),
        "--config",
        swarm.config_path,
    ]
    assert main([*argv, *flags[2:]]) == 2  # without --compression: another run's digest, refused
    assert "digest" in capsys.readouterr().err
    assert main([*argv, *flags]) == 0, capsys.readouterr().err
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(hf_out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    exported = exported.float().eval()

    # the swarm's own stages from the servers' final checkpoints (E0 from the table, B from the run's seed)
    stages = []
    for spec in cfg.stages():
        newest = list_checkpoints(checkpoints, spec.index)[-1]
        assert newest.step == steps
        stage = build_stage(cfg.model, spec, seed=cfg.training.seed)
        stages.append(load_stage_from_checkpoint(stage, newest.tensors_path).eval())
    _, val_set = build_datasets(cfg)
    inputs, _ = next(val_set.ordered_batches(cfg.training.micro_batch_size, cfg.training.micro_batch_size))
    with torch.no_grad():
        coords = stages[0](inputs)
        packed = torch.cat((coords, inputs.float().unsqueeze(-1)), dim=-1)
        ours = stages[1](packed)
        theirs = exported(input_ids=inputs).logits
    diff = float((ours - theirs).abs().max())
    print(f"exported subspace model vs the swarm's stages: max logit difference {diff:.2e}")
    assert diff < TOL
