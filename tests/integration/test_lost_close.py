"""A step whose close never reaches a stage (planner/held_step.py), on a real swarm: a trainer runs two
micro-batches of step 0 through both stages and closes the step at stage 0 only, as a trainer that died
between its closes, or gave up the close to a server behind a NAT, leaves it. Stage 0 applies the step;
stage 1 holds every sample of it and no close. Before the held-step rule it stayed at step 0 for good
(`behind_other_stages` never advances a replica holding samples, the lenient fallback needs a close), and
every micro-batch of step 1 timed out at it. Now it applies the samples it holds a close timeout after
stage 0 went on: nothing lost, and the next step trains through both stages."""

import time

import pytest
import torch

from swarm_fixtures import start_servers
from swarmtrain.net.protocol import close_message
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLOSE_TIMEOUT_S = 3.0  # the request timeout: how long the replica waits for a close that will not come


def _epochs(probe, peers):
    return {name: probe.info(peer).header["epoch"] for name, peer in peers.items()}


def _until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def test_a_stage_whose_close_was_lost_applies_its_held_samples_after_the_close_timeout(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"request_timeout_s": CLOSE_TIMEOUT_S}})
    start_servers(swarm, {"s0": 0, "s1": 1})
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1])
    peers = {"s0": probe.peers(0)[0], "s1": probe.peers(1)[0]}
    generator = torch.Generator().manual_seed(0)
    batch = 4

    def micro_batch(mb: str, step: int) -> float:
        ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=generator)
        return probe.forward_backward(mb, ids[:, :-1], ids[:, 1:], step=step)

    for i in range(2):
        micro_batch(f"a{i}", 0)
    close = close_message(0, 0, cfg.digest(), 0, 1, {peers["s0"]: 2 * batch}, [peers["s0"]])
    probe.run(probe.trainer.client.call(peers["s0"], close, timeout_s=10.0), 15.0)
    _until(lambda: _epochs(probe, peers)["s0"] == 1, 30.0, "stage 0 did not apply its closed step")
    held = probe.info(peers["s1"]).header
    assert held["epoch"] == 0  # no close: it holds the step's samples for now

    _until(lambda: _epochs(probe, peers)["s1"] == 1, 60.0, "stage 1 stayed at the step nobody closed")
    steps = probe.info(peers["s1"]).header["steps"]
    assert steps["held_steps"] == 1 and steps["lenient_steps"] == 0
    # nothing lost: both micro-batches applied at stage 1, as at stage 0
    events = read_ledger(swarm.ledger_path("s1"))
    assert not [e for e in events if e["e"] == "lost"], events
    assert probe.info(peers["s1"]).header["samples_seen"] == 2 * batch

    # and the swarm trains on: a micro-batch of step 1 through both stages, closed at both
    loss = micro_batch("b0", 1)
    assert loss == loss  # finite: it went through both stages at step 1
    for name in ("s0", "s1"):
        close = close_message(1, int(name[1]), cfg.digest(), 0, 1, {peers[name]: batch}, [peers[name]])
        probe.run(probe.trainer.client.call(peers[name], close, timeout_s=10.0), 15.0)
    _until(lambda: set(_epochs(probe, peers).values()) == {2}, 30.0, "step 1 was not applied at both")
    assert probe.info(peers["s1"]).header["steps"]["held_steps"] == 1
