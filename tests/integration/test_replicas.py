"""`swarmtrain replica` on real processes, at the defaults (H = 20, blockwise 8-bit pseudo-gradients): two
DiLoCo replicas of `tiny` learn as well as one process at equal total samples, end with the same weights,
and send far fewer synchronization bytes than averaging every step in fp32 would (20 x 4 / 1.016 = 79x
fewer, less the rounds a replica took alone), also counting what repairing partial rounds costs; a
state download (a round lost under load, replaced) is reported apart."""

import json

import pytest
import torch

from swarm_fixtures import in_background
from swarmtrain.model import build_model
from swarmtrain.runtime.local import local_reference_val_loss

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def every_step_bytes(cfg, steps: int, replicas: int) -> float:
    """What one replica would send averaging every step's gradient in fp32 (as stage replicas do) with
    the same butterfly all-reduce: (n-1)/n of the vector out to reduce, as much of the mean back."""
    elements = sum(p.numel() for p in build_model(cfg.model).parameters())
    return steps * 2 * elements * 4.0 * (replicas - 1) / replicas


def test_two_replicas_match_local_training_at_equal_samples(make_swarm):
    swarm, cfg = make_swarm("tiny")
    # one process on the same samples, on one thread, computed while the replicas train (`in_background`)
    torch.set_num_threads(1)
    reference = in_background(
        lambda: local_reference_val_loss(cfg, cfg.training.max_samples, eval_samples=256)
    )
    swarm.start_dht()
    for k in range(2):
        swarm.start_replica(
            f"replica{k}", f"{k}/2", "--threads", "1", "--eval-samples", "256", "--wait-for-replicas", "2"
        )
    for k in range(2):
        proc = swarm.processes[f"replica{k}"]
        assert swarm.wait_exit(f"replica{k}", 300) == 0, proc.log_text()[-3000:]
    a, b = (json.loads(swarm.summary_path(f"replica{k}").read_text()) for k in range(2))

    steps = cfg.training.max_samples // cfg.training.global_batch_size  # 256 local steps each
    for s in (a, b):
        assert s["inner_steps"] == steps and s["samples"] == cfg.training.max_samples // 2, s
        assert s["outer_steps"] == -(-steps // cfg.diloco.inner_steps)  # 13 rounds, the last one short
        assert s["rounds_averaged"] >= s["outer_steps"] - 4, s  # most rounds with the other
    assert a["fingerprint"] == pytest.approx(b["fingerprint"], rel=5e-3)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=5e-3)

    local = reference.result(timeout=300)
    gap = a["val_loss"] / local - 1
    every = every_step_bytes(cfg, steps, 2)
    ratio = every / a["sync_bytes_sent"]
    # what fixing rounds costs on top: partial rounds filled from a member's mean. A round lost under
    # load is replaced by a state download (a natural event: one cost the bound in CI once); it is
    # measured apart, and only a replica that resynced may have downloaded
    all_in = [every / (s["sync_bytes_sent"] + s["repair_bytes_received"]) for s in (a, b)]
    for s in (a, b):
        assert s["state_bytes_received"] == 0 or s["rounds_resynced"] > 0, s
    print(
        f"replicas {a['val_loss']:.4f} vs local {local:.4f} ({gap:+.2%}); {ratio:.0f}x fewer sync bytes, "
        f"{min(all_in):.0f}x with repairs ({a['rounds_partial']}+{b['rounds_partial']} partial rounds, "
        f"{a['rounds_repaired']}+{b['rounds_repaired']} repaired, {a['rounds_resynced']}+{b['rounds_resynced']} "
        f"resynced, state downloads {a['state_bytes_received']}+{b['state_bytes_received']} B)"
    )
    assert gap < 0.03
    assert ratio >= 50 and min(all_in) >= 50
