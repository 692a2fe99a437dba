"""Training through a real swarm: replicas of a stage stay identical after every global step, and a
short run on `tiny` reaches the local baseline's validation loss (within 5%) after the same samples."""

import dataclasses
import json
import time

import pytest
import torch

from swarmtrain.runtime.local import LocalTrainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SAMPLES = 1024
EVAL_SAMPLES = 128


def test_short_swarm_run_matches_local_validation_loss(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES}})
    swarm.start_dht()
    swarm.start_server("s0", 0)
    swarm.start_server("s1", 1)
    swarm.wait_ready(["s0", "s1"])
    swarm.start_trainer(
        "trainer",
        "--max-samples",
        str(SAMPLES),
        "--eval-samples",
        str(EVAL_SAMPLES),
        "--in-flight",
        "2",
        "--log-period-s",
        "2",
    )
    assert swarm.wait_exit("trainer", 240) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())

    torch.set_num_threads(1)
    local_cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    local = LocalTrainer(local_cfg, progress=False).train()
    print(
        f"val loss after {SAMPLES} samples: swarm {summary['val_loss']:.4f} (8-bit, 2 in flight), "
        f"local {local.final_val_loss:.4f}; initial {local.initial_val_loss:.4f}"
    )
    assert summary["microbatches_completed"] == SAMPLES // cfg.training.micro_batch_size
    assert summary["microbatches_failed"] == 0
    assert summary["val_loss"] < local.initial_val_loss - 1.0  # it learned
    assert summary["val_loss"] == pytest.approx(local.final_val_loss, rel=0.05)
    # per-call timings (the simulator's calibration inputs): compute <= server time <= round trip
    rpc = summary["rpc"]
    assert set(rpc) == {"stage0_forward", "stage1_forward", "stage0_backward"}
    assert rpc["stage0_backward"]["calls"] == summary["microbatches_completed"]
    for name, t in rpc.items():
        assert 0 < t["mean_compute_s"] <= t["mean_server_s"] <= t["mean_call_s"], (name, t)


def test_replicas_hold_the_same_parameters_after_global_steps(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": 4096}})
    swarm.start_dht()
    for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1)):
        swarm.start_server(name, stage)
    swarm.wait_ready(["s0a", "s0b", "s1"])
    swarm.start_trainer("trainer", "--max-samples", "512", "--in-flight", "4")
    assert swarm.wait_exit("trainer", 240) == 0, swarm.processes["trainer"].log_text()[-3000:]

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    peers = probe.peers(0)
    deadline = time.monotonic() + 30
    while True:  # the last round may still be running when the trainer exits
        infos = [probe.info(peer, want="params") for peer in peers]
        epochs = [info.header["epoch"] for info in infos]
        if len(set(epochs)) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    sync = [info.header["sync"] for info in infos]
    print(
        f"stage 0 replicas: epochs {epochs}, rounds {[s['rounds'] for s in sync]}, "
        f"partial {[s['partial_rounds'] for s in sync]}, resyncs {[s['resyncs'] for s in sync]}"
    )
    assert len(set(epochs)) == 1 and epochs[0] >= 3
    assert all(s["rounds"] + s["resyncs"] >= 1 for s in sync)
    a, b = infos
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_waits_for_a_missing_stage_and_a_late_replica_catches_up(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": 4096}})
    swarm.start_dht()
    swarm.start_server("s0a", 0)
    swarm.wait_ready(["s0a"])
    swarm.start_trainer("trainer", "--max-samples", "256", "--in-flight", "2")
    trainer = swarm.processes["trainer"]
    deadline = time.monotonic() + 60
    while "stage 1 has no live peer; waiting" not in trainer.log_text():
        assert trainer.alive and time.monotonic() < deadline, trainer.log_text()[-2000:]
        time.sleep(0.2)
    swarm.start_server("s1", 1)  # the trainer resumes once stage 1 announces itself
    assert swarm.wait_exit("trainer", 120) == 0, trainer.log_text()[-3000:]

    swarm.start_server("s0b", 0)  # joins after the stage has trained: must download before serving
    swarm.wait_ready(["s0b"])
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    infos = {peer: probe.info(peer, want="params") for peer in probe.peers(0)}
    epochs = sorted(info.header["epoch"] for info in infos.values())
    print(f"stage 0 epochs after the late join: {epochs}")
    assert epochs[0] == epochs[1] >= 4
    a, b = infos.values()
    for name in a.tensors:
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    assert any(
        e.get("e") == "resync" for e in map(json.loads, swarm.ledger_path("s0b").read_text().splitlines())
    )
