"""Training through a real swarm, in the configuration SWARM exists for (two replicas of a stage, the
whole global batch in flight): at equal samples it reaches local training's validation loss, every
stage takes one step per global batch, and the replicas hold identical parameters."""

import dataclasses
import json
import time

import pytest
import torch

from swarmtrain.runtime.harness.accounting import account_stage
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.local import LocalTrainer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SAMPLES = 4096
EVAL_SAMPLES = 256


@pytest.mark.parametrize(
    "exchange",
    # the stage-0 replicas' gradient sums in fp32 (the default), and blockwise 8-bit with the rounding
    # carried to the next step (runtime/server/sums_codec.py): the replicas must still hold identical
    # parameters and match local training
    ["none", pytest.param("8bit", marks=pytest.mark.slow)],
)
def test_two_replicas_with_the_batch_in_flight_match_local_training(make_swarm, exchange):
    overrides = {
        "training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES},
        "swarm": {"exchange_compression": exchange},
    }
    swarm, cfg = make_swarm("tiny", overrides)
    swarm.start_dht()
    for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1)):
        swarm.start_server(name, stage)
    swarm.wait_ready(["s0a", "s0b", "s1"])
    in_flight = cfg.training.global_batch_size // cfg.training.micro_batch_size  # the whole batch
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES), "--in-flight", str(in_flight)]
    swarm.start_trainer("trainer", *args, "--compression", "8bit", "--log-period-s", "5")
    assert swarm.wait_exit("trainer", 300) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    infos = {peer: probe.info(peer, want="params") for stage in (0, 1) for peer in probe.peers(stage)}
    torch.set_num_threads(1)
    local_cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    local = LocalTrainer(local_cfg, progress=False).train()
    steps = SAMPLES // cfg.training.global_batch_size
    print(
        f"val loss after {SAMPLES} samples: swarm {summary['val_loss']:.4f} (2+1 servers, 8-bit, "
        f"exchange {exchange}, "
        f"{in_flight} in flight, {summary['samples_per_s']:.1f} samples/s), local {local.final_val_loss:.4f}; "
        f"steps per server {[i.header['epoch'] for i in infos.values()]}"
    )
    assert summary["microbatches_completed"] == SAMPLES // cfg.training.micro_batch_size
    assert summary["microbatches_failed"] == 0 and summary["steps"] == steps
    assert summary["val_loss"] == pytest.approx(local.final_val_loss, rel=0.03)
    # exactly one global batch per step on every server, less the micro-batches whose backward reply was
    # cut off and retried without accumulating (hivemind streams sometimes end empty under load: at
    # most once per stage, by design), which the trainer counts
    short = cfg.training.micro_batch_size * summary["retries_not_accumulated"]
    seen = {info.header["samples_seen"] for info in infos.values()}
    for info in infos.values():
        assert info.header["epoch"] == steps, info.header
        assert SAMPLES - short <= info.header["samples_seen"] <= SAMPLES, (
            info.header,
            summary["retries_not_accumulated"],
        )
    assert short or seen == {SAMPLES}
    # every micro-batch came to stage 0 (the trainer's chain) and to stage 1 (the hand-off) over the
    # servers' direct data planes (net/direct_first.py)
    direct = {info.header["stage"]: 0 for info in infos.values()}
    for info in infos.values():
        direct[info.header["stage"]] += info.header["direct_in"]
    assert min(direct.values()) >= summary["microbatches_completed"], direct
    # the replicas share each step's micro-batches (routing charges a forward with its backward); when
    # the backward was charged only as it was sent, 42 of these 128 steps ran on one replica (96 of 128
    # with 8 in flight and servers in 0.5-CPU cgroups)
    shares = [_accumulated_per_step(swarm.ledger_path(name)) for name in ("s0a", "s0b")]
    shared = sum(1 for step in range(steps) if shares[0].get(step, 0) and shares[1].get(step, 0))
    print(f"steps shared by both stage-0 replicas: {shared} of {steps}")
    assert shared >= 0.9 * steps, (shared, steps)
    a, b = (infos[peer] for peer in probe.peers(0))
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)
    # per-call timings (the simulator's calibration inputs): compute <= server time <= round trip
    # (direct hand-off: one chain call per micro-batch, timed by its stage-0 server's report)
    rpc = summary["rpc"]
    # validation goes along the chain too (`evaluate_chain`) and is not timed: only training calls are
    assert set(rpc) == {"stage0_chain"}
    assert rpc["stage0_chain"]["calls"] == summary["microbatches_completed"]
    for name, t in rpc.items():
        assert 0 < t["mean_compute_s"] <= t["mean_call_s"], (name, t)


def _accumulated_per_step(ledger_path) -> dict[int, int]:
    steps = (json.loads(line) for line in ledger_path.read_text().splitlines())
    return {e["step"]: e["n"] for e in steps if e.get("e") == "step"}


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
    assert epochs[0] == epochs[1] == 256 // cfg.training.global_batch_size
    a, b = infos.values()
    for name in a.tensors:
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    assert any(
        e.get("e") == "resync" for e in map(json.loads, swarm.ledger_path("s0b").read_text().splitlines())
    )


@pytest.mark.slow
def test_local_steps_replicas_sync_every_h_steps_and_match_local(make_swarm):
    """swarm.local_steps = 4 (rare sync inside SWARM): each stage-0 replica steps on its own share of
    the batch and the two average pseudo-gradients every 4 steps; at equal samples the swarm stays
    within 3% of one process, and after the last round (step 128 = 32 x 4) the replicas are equal."""
    overrides = {
        "training": {"max_samples": SAMPLES, "eval_samples": EVAL_SAMPLES},
        "swarm": {"local_steps": 4},
    }
    swarm, cfg = make_swarm("tiny", overrides)
    swarm.start_dht()
    for name, stage in (("s0a", 0), ("s0b", 0), ("s1", 1)):
        swarm.start_server(name, stage)
    swarm.wait_ready(["s0a", "s0b", "s1"])
    args = ["--max-samples", str(SAMPLES), "--eval-samples", str(EVAL_SAMPLES), "--in-flight", "4"]
    swarm.start_trainer("trainer", *args, "--compression", "8bit")
    assert swarm.wait_exit("trainer", 300) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    a, b = (probe.info(peer, want="params") for peer in probe.peers(0))
    torch.set_num_threads(1)
    local_cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    local = LocalTrainer(local_cfg, progress=False).train()
    print(f"local steps H=4: swarm {summary['val_loss']:.4f} vs local {local.final_val_loss:.4f}")
    steps = SAMPLES // cfg.training.global_batch_size
    assert a.header["epoch"] == b.header["epoch"] == steps
    # every micro-batch applied once, at one replica (the ledgers, whatever else happened)
    completed = {e["mb"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"}
    ledgers = {name: read_ledger(swarm.ledger_path(name)) for name in ("s0a", "s0b")}
    account = account_stage(0, ledgers, dead=set(), completed=completed)
    resyncs = a.header["sync"]["resyncs"] + b.header["sync"]["resyncs"]
    print(f"stage 0: {account.summary()}, resyncs {resyncs}")
    assert account.balanced and not account.double_applied and not account.pending, account.summary()
    if resyncs == 0:  # a state download copies the donor's count: the shares add up only without one
        assert a.header["samples_seen"] + b.header["samples_seen"] == SAMPLES  # each its own share
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-6, atol=1e-7, msg=name)
    assert summary["val_loss"] == pytest.approx(local.final_val_loss, rel=0.03)
