"""A swarm as a GPU user would run it, on CPU: stage servers in bf16 with request batching on, several
trainers with small micro-batches, two replicas of stage 0. It must learn like fp32 local training on the
same samples, every step must apply exactly the global batch on every server, micro-batches must really
share compute calls, and the replicas must hold identical parameters."""

import dataclasses
import json

import pytest
import torch

from swarmtrain.data import build_datasets
from swarmtrain.model import build_model
from swarmtrain.runtime.local import LocalTrainer, validation_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(500)]

SAMPLES = 2040  # 85 steps of 24
EVAL_SAMPLES = 128
TRAINERS = 3
MICRO_BATCH = 2


def test_bf16_servers_batching_requests_of_three_trainers_match_local_fp32(make_swarm):
    training = {
        "max_samples": SAMPLES,
        "eval_samples": EVAL_SAMPLES,
        "micro_batch_size": MICRO_BATCH,
        "global_batch_size": 24,  # 8 per trainer: 4 micro-batches each per step
        # stages clip their own gradient norm, local training the whole model's: early in training that
        # alone put in-process stage workers 3.1% below local at this point (2.735 vs 2.823); without
        # clipping they agree to 0.1%
        "grad_clip_norm": 0.0,
    }
    swarm, cfg = make_swarm("tiny", {"training": training})
    tokens = 4 * MICRO_BATCH * cfg.model.seq_len  # up to 4 micro-batches share a call
    swarm.start_dht()
    names = (("s0a", 0), ("s0b", 0), ("s1", 1))
    for name, stage in names:
        swarm.start_server(name, stage, "--dtype", "bf16", "--max-batch-tokens", str(tokens))
    swarm.wait_ready([n for n, _ in names])
    steps = SAMPLES // cfg.training.global_batch_size
    samples = steps * cfg.training.global_batch_size
    for k in range(TRAINERS):
        # no --max-samples: every trainer stops where the run does, at training.max_samples
        args = ["--shard", f"{k}/{TRAINERS}", "--in-flight", "4"]
        if k == 0:
            args += ["--eval-samples", str(EVAL_SAMPLES)]
        swarm.start_trainer(f"trainer{k}", *args, "--compression", "8bit", "--log-period-s", "10")
    for k in range(TRAINERS):
        code = swarm.wait_exit(f"trainer{k}", 400)
        assert code == 0, swarm.processes[f"trainer{k}"].log_text()[-3000:]
    summaries = [json.loads(swarm.summary_path(f"trainer{k}").read_text()) for k in range(TRAINERS)]

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    infos = {peer: probe.info(peer, want="params") for stage in (0, 1) for peer in probe.peers(stage)}
    torch.set_num_threads(1)
    local_cfg = cfg.replace(
        training=dataclasses.replace(cfg.training, max_samples=samples, eval_every_samples=0)
    )
    local = LocalTrainer(local_cfg, progress=False).train()
    batched = {p[-6:]: i.header["compute"] for p, i in infos.items()}
    swarm_model = build_model(cfg.model, seed=0)
    stage_params = {n: i.tensor(n) for i in infos.values() for n in i.tensors}
    swarm_model.load_state_dict(stage_params, strict=True)
    _, val_set = build_datasets(cfg)
    swarm_val = validation_loss(swarm_model, val_set, MICRO_BATCH, EVAL_SAMPLES)
    print(
        f"val loss after {samples} samples: swarm bf16 {summaries[0]['val_loss']:.4f} (its weights evaluated "
        f"here: {swarm_val:.4f}), local fp32 {local.final_val_loss:.4f}; compute requests/calls per server "
        f"{batched}"
    )
    assert all(s["microbatches_failed"] == 0 for s in summaries)
    # At 2,040 samples tiny leaves a plateau, and when depends on any numerical perturbation: local fp32
    # 2.931, local bf16 3.101 (+5.8%); swarms of fp32 servers without batching 2.931 twice, with batching
    # (gradients summed in another order) 2.916, 3.102 and 3.108. The convergence bench measures the bf16
    # bound at 8,192 samples (within 3%); here the bound only says the swarm learned as much as local.
    assert swarm_val == pytest.approx(local.final_val_loss, rel=0.08)
    assert swarm_val < 0.6 * local.initial_val_loss
    short = MICRO_BATCH * sum(s["retries_not_accumulated"] for s in summaries)
    for info in infos.values():
        assert info.header["device"] == "cpu bf16"
        assert info.header["epoch"] == steps, info.header
        assert samples - short <= info.header["samples_seen"] <= samples, info.header
    # the last stage serves every micro-batch: with 3 trainers x 4 in flight, calls must be shared
    last = next(i for i in infos.values() if i.header["stage"] == 1).header["compute"]
    assert last["calls"] < last["requests"], last
    # and stage 0 handed micro-batches of one call to stage 1 together (net/bundle.py)
    assert sum(i.header["compute"]["bundles_sent"] for i in infos.values() if i.header["stage"] == 0) > 0
    a, b = (infos[peer] for peer in probe.peers(0))
    for name in a.tensors:
        assert a.tensor(name).dtype == torch.float32  # master weights stay fp32 under bf16 compute
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)
