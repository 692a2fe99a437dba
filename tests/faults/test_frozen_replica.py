"""A frozen replica must not stall the swarm (issue 23). SIGSTOP one of two stage-0 replicas for 12 s
with the default request timeout (30 s): before any of this, the whole swarm completed nothing for the
freeze. Now a chain that runs past its stage-0 peer's usual time makes the trainer ping the route's peers
(answered by their event loops at once, however busy); the silent one is banned and the chain is hedged
on the other replica, first answer wins (runtime/trainer/hedging.py). The hedge accumulates nothing, so
every stage still applies each micro-batch at most once; the thawed replica catches up and ends with the
same parameters as the other."""

import json
import os
import signal
import time

import pytest
import torch

from swarm_fixtures import TWO_REPLICAS_OF_STAGE_0, start_servers
from swarmtrain.runtime.harness.accounting import account_stage
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(400), pytest.mark.serial]

MICRO_BATCHES = 100_000  # more than the test runs: the trainer is stopped after the thaw
FROZEN_S = 12.0
# the longest the swarm may go without completing a micro-batch while a replica is frozen: a silent call
# is checked after 0.5-1 s (planner/deadlines.py CHECK_FLOOR_S, UNMEASURED_CHECK_S), its peer's ping times
# out after 1 s (PING_TIMEOUT_FLOOR_S), then the hedge on the other replica runs (~0.1 s for `tiny`);
# 1.4-2.1 s measured
HEDGE_BOUND_S = 3.0
AFTER_THAW_S = 5.0  # the thawed replica answers a ping within this (polled: it answers in well under 1 s)


def _done_times(swarm) -> list[float]:
    return [e["t"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"]


def test_a_frozen_replica_is_hedged_around_and_the_swarm_keeps_completing_micro_batches(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"request_timeout_s": 30.0, "averaging_timeout_s": 30.0}})
    servers = TWO_REPLICAS_OF_STAGE_0
    start_servers(swarm, servers)
    samples = MICRO_BATCHES * cfg.training.micro_batch_size
    trainer = swarm.start_trainer("trainer", "--max-samples", str(samples), "--in-flight", "4")
    deadline = time.monotonic() + 120
    while len(_done_times(swarm)) < 60:  # both replicas' usual times measured (8 calls each at least)
        assert trainer.alive and time.monotonic() < deadline, trainer.log_text()[-3000:]
        time.sleep(0.2)

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    stage_0 = probe.peers(0)
    assert probe.silent(0, stage_0) == []  # busy servers answer a ping at once
    frozen = swarm.processes["s0b"]
    frozen_at = time.time()
    os.kill(frozen.pid, signal.SIGSTOP)  # the server process only: its p2pd keeps accepting streams
    try:
        silent_while_frozen = probe.silent(0, stage_0)
        time.sleep(max(0.0, frozen_at + FROZEN_S - time.time()))
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    thawed_at = time.time()
    assert len(silent_while_frozen) == 1, silent_while_frozen  # s0b, and only s0b
    _wait_until_all_answer(probe, stage_0, thawed_at + AFTER_THAW_S)
    assert trainer.alive, trainer.log_text()[-3000:]
    os.kill(trainer.pid, signal.SIGTERM)  # stops at once; the step in progress is closed short
    assert swarm.wait_exit("trainer", 120) == 0, trainer.log_text()[-3000:]

    during = [t for t in _done_times(swarm) if frozen_at <= t <= thawed_at]
    edges = [frozen_at, *during, thawed_at]
    longest_gap_s = max(b - a for a, b in zip(edges, edges[1:], strict=False))
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    print(
        f"{len(during)} micro-batches completed while s0b was frozen for {FROZEN_S:.0f} s; longest gap "
        f"without a completion then {longest_gap_s:.1f} s; frozen peers found {summary['frozen_peers']}, "
        f"hedges {summary['hedges']} (won {summary['hedges_won']}), timeouts {summary['timeouts']}, "
        f"retries without accumulating {summary['retries_not_accumulated']}"
    )
    # the frozen replica was found by a ping and its micro-batches finished on the other one, long
    # before any deadline: no call waited for a timeout
    assert summary["frozen_peers"] >= 1 and summary["hedges_won"] >= 1, summary
    assert summary["timeouts"] == 0 and summary["microbatches_failed"] == 0, summary
    assert summary["microbatches_completed"] == summary["microbatches_started"], summary
    assert longest_gap_s < HEDGE_BOUND_S, longest_gap_s  # the swarm did not wait out the freeze

    completed = {e["mb"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"}
    for stage in (0, 1):
        ledgers = {n: read_ledger(swarm.ledger_path(n)) for n, s in servers.items() if s == stage}
        account = account_stage(stage, ledgers, dead=set(), completed=completed)
        print(f"stage {stage}: {account.summary()}")
        assert not account.double_applied, account.summary()
        assert account.balanced, account.summary()
    _assert_replicas_equal(probe, swarm)


def _wait_until_all_answer(probe, peers: list[str], deadline: float) -> None:
    """Every one of `peers` answers a ping by `deadline` (time.time()); AssertionError with the silent ones
    after it. Polled: a fixed wait of the whole allowance cost the test 5 s."""
    while True:
        silent = probe.silent(0, peers)
        if not silent or time.time() > deadline:
            break
        time.sleep(0.2)
    assert silent == [], silent


def _assert_replicas_equal(probe, swarm, timeout_s: float = 60.0) -> None:
    """The thawed replica caught up: both stage-0 replicas at the same step with the same parameters."""
    probe.wait_for_peers([2, 1])
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = (_params_of(probe, swarm, peer) for peer in probe.peers(0))
        if a.header["epoch"] == b.header["epoch"] or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    print(f"stage-0 replicas at steps {a.header['epoch']} and {b.header['epoch']}")
    assert a.header["epoch"] == b.header["epoch"], (a.header, b.header)
    for name in a.tensors:
        torch.testing.assert_close(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-6, msg=name)


def _params_of(probe, swarm, peer: str):
    """A replica's `info` with its parameters. Once in CI (2026-11-30, after the behaviour above had all
    passed) one such call went unanswered for the probe's 60 s; the replicas' log tails then say where each
    stood (what blocked that replica's compute thread, which answers `info`, is not known yet)."""
    try:
        return probe.info(peer, want="params")
    except TimeoutError:
        tails = "".join(f"\n--- {n}:\n{swarm.processes[n].log_text()[-2500:]}" for n in ("s0a", "s0b"))
        raise AssertionError(f"{peer[-8:]} did not answer info in {probe.timeout_s:.0f} s{tails}") from None
