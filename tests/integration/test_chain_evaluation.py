"""Validation along the chain: with direct hand-off (the default) a trainer's evaluation goes from server
to server as its training micro-batches do (`evaluate_chain`, the last stage taking `evaluate` over the
data plane), and it computes what the relayed evaluation computes. A real swarm of three `tiny` stages on
127.0.0.1 (tests/integration/test_nat.py has a last stage that accepts no inbound connection)."""

import pytest

from swarm_fixtures import start_servers
from swarmtrain.data import build_datasets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EVAL_SAMPLES = 64  # 8 micro-batches of tiny's 8


def test_evaluation_along_the_chain_equals_the_relayed_one(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"num_stages": 3}})
    start_servers(swarm, {"s0": 0, "s1": 1, "s2": 2})
    _, val_set = build_datasets(cfg)
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1, 1])
    peers = [probe.peers(stage)[0] for stage in range(3)]
    before = [probe.info(peer).header for peer in peers]

    assert probe.trainer.chain is not None  # the default: direct hand-off
    along_the_chain = probe.run(probe.trainer.evaluate(val_set, EVAL_SAMPLES), timeout_s=120)
    after = [probe.info(peer).header for peer in peers]
    chain, probe.trainer.chain = probe.trainer.chain, None  # what `--hand-off relay` selects
    relayed = probe.run(probe.trainer.evaluate(val_set, EVAL_SAMPLES), timeout_s=120)
    probe.trainer.chain = chain
    print(
        f"val loss over {EVAL_SAMPLES} samples: along the chain {along_the_chain:.6f}, relayed {relayed:.6f}"
    )

    micro_batches = EVAL_SAMPLES // cfg.training.micro_batch_size
    evaluated = [a["counters"]["eval"] - b["counters"]["eval"] for a, b in zip(after, before, strict=True)]
    handed_in = [a["direct_in"] - b["direct_in"] for a, b in zip(after, before, strict=True)]
    assert evaluated == [micro_batches] * 3, evaluated
    # stages 1 and 2 got every evaluation from the stage before over the data plane, not from the trainer
    assert handed_in[1:] == [micro_batches] * 2 and handed_in[0] == 0, handed_in
    assert along_the_chain == pytest.approx(relayed, rel=1e-5)
    for header in after:
        assert header["epoch"] == 0 and header["pending_samples"] == 0  # nothing accumulated
