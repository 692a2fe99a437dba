"""The fewest bytes per sample through a real swarm: boundary layers ([model] boundary) and a codec below
8 bits, over the servers' direct data plane. Without the codec a micro-batch equals the whole model that
train-local builds (loss and every gradient, the boundary layers' included); with it, a training run of two
stage-0 replicas and the whole global batch in flight reaches train-local's loss at equal samples."""

import dataclasses
import json

import pytest
import torch

from swarm_fixtures import TWO_REPLICAS_OF_STAGE_0, start_servers
from swarmtrain.runtime.local import LocalTrainer
from whole_model import exact_micro_batch, server_grads

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

BOUNDARY = {"boundary": "lowrank-embed", "boundary_dim": 32}
SAMPLES = 2048
EVAL_SAMPLES = 256


def _train_local(cfg):
    torch.set_num_threads(1)
    return LocalTrainer(
        cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0)), progress=False
    ).train()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_a_micro_batch_through_boundary_layers_equals_the_whole_model(make_swarm):
    swarm, cfg = make_swarm("llama-tiny", {"model": BOUNDARY, "swarm": {"compression": "4bit"}})
    start_servers(swarm, {"s0": 0, "s1": 1})
    probe = make_swarm.probe(cfg, swarm, codec="none")
    probe.wait_for_peers([1, 1])
    inputs, labels, local_loss, local, grads = exact_micro_batch(probe, cfg, 2)
    n = inputs.shape[0]
    # the last stage's token embedding starts at zero: its gradient is where wrong current-token ids
    # (the labels shifted by one) would show
    assert {
        "boundaries.0.down.proj.weight",
        "boundaries.0.up.proj.weight",
        "boundaries.0.up.tokens.weight",
    } <= set(grads)
    assert float(local["boundaries.0.up.tokens.weight"].abs().max()) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad / n, local[name], rtol=1e-4, atol=1e-6, msg=name)

    # the run's codec: 32 values per token at 4 bits each way. The loss at initialization hardly
    # depends on the activations, so the check is on the gradients that crossed the boundary backwards
    # (stage 0's, 4-bit and stochastically rounded): changed by the codec, still pointing the same way
    probe.set_codec("4bit")
    loss_4bit = probe.forward_backward("4bit", inputs, labels)
    after = server_grads(probe, 2)
    stage0 = [name for name in local if not name.startswith(("lm_head", "model.norm", "boundaries.0.up"))]
    stage0 = [name for name in stage0 if not name.startswith("model.layers.") or int(name.split(".")[2]) < 2]
    delta = {name: (after[name] - grads[name]) / n for name in stage0}
    cosine = _cosine(
        torch.cat([delta[k].flatten() for k in stage0]), torch.cat([local[k].flatten() for k in stage0])
    )
    changed = max(float((delta[k] - local[k]).abs().max()) for k in stage0)
    print(
        f"4-bit over a lowrank-embed:32 boundary: loss {loss_4bit:.5f} vs {local_loss:.5f}; stage-0 grad cosine {cosine:.4f}, max change {changed:.2e}"
    )
    assert loss_4bit == pytest.approx(local_loss, rel=0.02)
    assert changed > 1e-6  # the codec was applied
    assert cosine >= 0.95


@pytest.mark.slow
def test_two_replicas_train_through_a_compressed_boundary_as_train_local_does(make_swarm):
    overrides = {
        "model": BOUNDARY,
        "swarm": {"compression": "4bit"},
        "training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES},
    }
    swarm, cfg = make_swarm("tiny", overrides)
    start_servers(swarm, TWO_REPLICAS_OF_STAGE_0)
    in_flight = cfg.training.global_batch_size // cfg.training.micro_batch_size
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES), "--in-flight", str(in_flight)]
    swarm.start_trainer("trainer", *args, "--log-period-s", "5")  # the run's codec: swarm.compression
    assert swarm.wait_exit("trainer", 300) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    infos = {peer: probe.info(peer, want="params") for stage in (0, 1) for peer in probe.peers(stage)}

    local = _train_local(cfg)  # the same model, boundary layers included
    print(
        f"val loss after {SAMPLES} samples: swarm {summary['val_loss']:.4f} (4-bit, lowrank-embed:32, 2+1 servers, "
        f"{in_flight} in flight), train-local {local.final_val_loss:.4f}"
    )
    assert summary["microbatches_failed"] == 0
    assert summary["steps"] == SAMPLES // cfg.training.global_batch_size
    assert summary["val_loss"] == pytest.approx(local.final_val_loss, rel=0.03)
    direct = sum(info.header["direct_in"] for info in infos.values() if info.header["stage"] == 1)
    assert direct >= summary["microbatches_completed"]  # hand-offs took the data plane
    a, b = (infos[peer] for peer in probe.peers(0))
    assert "boundaries.0.down.proj.weight" in a.tensors  # replicas average the boundary layer too
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)
