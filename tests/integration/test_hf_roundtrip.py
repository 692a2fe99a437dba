"""A Hugging Face model through a real swarm and back: a tiny Llama saved with `save_pretrained` seeds two
stage servers (`--init-from-hf`), a trainer takes a few steps, `swarmtrain export --hf-out` writes a
directory `transformers` loads with no weight warnings, and that model computes what the swarm's stages
do: the logits of the servers' final stage checkpoints, and the trainer's last validation loss. The
step-0 losses the trainer recorded are the Hugging Face model's own, so the swarm did start from its
weights (a server ignoring --init-from-hf would have started from the seed's)."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarm_fixtures import on_a_thread
from swarmtrain.cli.common import with_hf_model
from swarmtrain.data import build_datasets, iterate_batches
from swarmtrain.model import build_stage, load_stage_from_checkpoint
from swarmtrain.runtime.server.stage_checkpoint import list_checkpoints

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
transformers = pytest.importorskip("transformers")

SAMPLES = 128  # 4 global steps of 32
EVAL_SAMPLES = 32
TOL = 1e-4


def _hf_llama(path: Path):
    """Untied, grouped-query (4 query heads, 2 key/value heads), a byte vocabulary and a little more."""
    torch.manual_seed(11)
    config = transformers.LlamaConfig(
        vocab_size=288,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1000.0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="40KB")
    return model


@torch.no_grad()
def _hf_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    logits = model(input_ids=inputs).logits
    return float(
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
    )


def _ledger(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_swarm_seeded_from_a_hf_model_exports_one_transformers_loads(make_swarm, tmp_path, capsys):
    import json as json_module  # the data source: a small stdlib package, read in well under a second

    started_s = time.monotonic()
    data = {"source": str(Path(json_module.__file__).parent)}
    swarm, base = make_swarm("tiny", {"data": data, "training": {"eval_samples": EVAL_SAMPLES}})
    hf_in = tmp_path / "hf_in"
    made = on_a_thread(lambda: _hf_llama(hf_in))
    swarm.start_dht()  # while the Hugging Face model is made: the DHT needs none of it
    original = made.result(timeout=120)
    checkpoints = tmp_path / "checkpoints"
    cfg = with_hf_model(base, str(hf_in))
    assert (cfg.model.arch, cfg.model.kv_heads, cfg.model.num_layers) == ("llama", 2, 4)
    for stage in (0, 1):
        swarm.start_server(
            f"s{stage}", stage, "--init-from-hf", str(hf_in), "--checkpoint-dir", str(checkpoints)
        )
    swarm.wait_ready(["s0", "s1"])
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES), "--compression", "none"]
    swarm.start_trainer("trainer", "--init-from-hf", str(hf_in), "--in-flight", "4", *args)
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    steps = SAMPLES // cfg.training.global_batch_size
    assert summary["steps"] == steps and summary["microbatches_failed"] == 0, summary
    swarm.stop_all()  # SIGTERM: each server writes its final checkpoint
    swarm_s = time.monotonic() - started_s

    # step 0 ran on the Hugging Face weights: each of its micro-batches' loss is the original model's
    torch.set_num_threads(1)
    train_set, val_set = build_datasets(cfg)
    mb = cfg.training.micro_batch_size
    stream = iterate_batches(train_set, mb, seed=cfg.training.seed)
    ledger = _ledger(swarm.ledger_path("trainer"))
    step0 = [e["mb"] for e in ledger if e["e"] == "start" and e["step"] == 0]
    losses = {e["mb"]: e["loss"] for e in ledger if e["e"] == "done"}
    assert len(step0) == cfg.training.global_batch_size // mb, ledger[:6]
    first_diffs = []
    for micro_batch in step0:  # started in data order
        inputs, labels = next(stream)
        first_diffs.append(abs(losses[micro_batch] - _hf_loss(original, inputs, labels)))
    assert max(first_diffs) < TOL, first_diffs

    # export the servers' final checkpoints as a Hugging Face directory
    hf_out = tmp_path / "hf_out"
    argv = ["export", "--checkpoint-dir", str(checkpoints), "--hf-out", str(hf_out)]
    argv += ["--config", swarm.config_path, "--init-from-hf", str(hf_in)]
    from swarmtrain.cli.main import main

    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {hf_out}" in printed and f"(step {steps})" in printed, printed

    stream_log = io.StringIO()
    handler = logging.StreamHandler(stream_log)
    handler.setLevel(logging.WARNING)
    transformers.logging.get_logger().addHandler(handler)
    try:
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(hf_out, output_loading_info=True)
    finally:
        transformers.logging.get_logger().removeHandler(handler)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert not stream_log.getvalue(), stream_log.getvalue()
    exported = exported.float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_out)
    assert tokenizer("def f():")["input_ids"] == list(b"def f():")
    # trained: the weights moved away from the original
    assert not torch.equal(exported.lm_head.weight, original.lm_head.weight)

    # the same logits as the swarm's own stages, built from the servers' final checkpoints
    stages = []
    for spec in cfg.stages():
        newest = list_checkpoints(checkpoints, spec.index)[-1]
        assert newest.step == steps
        stages.append(
            load_stage_from_checkpoint(build_stage(cfg.model, spec, seed=0), newest.tensors_path).eval()
        )
    inputs, labels = next(val_set.ordered_batches(mb, mb))
    with torch.no_grad():
        ours = stages[1](stages[0](inputs))
        theirs = exported(input_ids=inputs).logits
    logit_diff = float((ours - theirs).abs().max())
    assert logit_diff < TOL

    # and the trainer's last validation loss (through the swarm, after the last step, fp32 on the wire)
    total, count = 0.0, 0
    for inputs, labels in val_set.ordered_batches(mb, EVAL_SAMPLES):
        total += _hf_loss(exported, inputs, labels) * inputs.shape[0]
        count += inputs.shape[0]
    loss_diff = abs(total / count - summary["val_loss"])
    print(
        f"HF round trip: step-0 loss vs HF max diff {max(first_diffs):.2e}; exported vs stage checkpoints max "
        f"logit diff {logit_diff:.2e}; val loss exported {total / count:.6f} vs trainer {summary['val_loss']:.6f} "
        f"(diff {loss_diff:.2e}); swarm part {swarm_s:.1f}s, total {time.monotonic() - started_s:.1f}s"
    )
    assert loss_diff < TOL
