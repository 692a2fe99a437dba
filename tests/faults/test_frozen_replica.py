"""A frozen replica must not stall the swarm (issue 23). SIGSTOP one of two stage-0 replicas for 20 s
with the default request timeout (30 s): before, the whole swarm completed nothing for the 20 s. Now the
trainer waits for a peer only as long as its usual call time allows (planner/deadlines.py, 5 s at
least), bans it until it announces itself again, and routes the step's micro-batches to the other
replica, so micro-batches keep completing while the replica is frozen. What the frozen replica may
hold is retried without accumulating: every stage still applies each micro-batch at most once."""

import json
import os
import signal
import time

import pytest

from swarm_fixtures import TWO_REPLICAS_OF_STAGE_0, start_servers
from swarmtrain.runtime.harness.accounting import account_stage
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(400)]

MICRO_BATCHES = 400
FROZEN_S = 20.0


def _done_times(swarm) -> list[float]:
    return [e["t"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"]


def test_a_frozen_replica_is_given_up_on_and_the_swarm_keeps_completing_micro_batches(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"request_timeout_s": 30.0, "averaging_timeout_s": 5.0}})
    servers = TWO_REPLICAS_OF_STAGE_0
    start_servers(swarm, servers)
    samples = MICRO_BATCHES * cfg.training.micro_batch_size
    trainer = swarm.start_trainer("trainer", "--max-samples", str(samples), "--in-flight", "4")
    deadline = time.monotonic() + 120
    while len(_done_times(swarm)) < 60:  # both replicas' usual times measured (8 calls each at least)
        assert trainer.alive and time.monotonic() < deadline, trainer.log_text()[-3000:]
        time.sleep(0.2)

    frozen = swarm.processes["s0b"]
    frozen_at = time.time()
    os.kill(frozen.pid, signal.SIGSTOP)  # the server process only: its p2pd keeps accepting streams
    try:
        time.sleep(FROZEN_S)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    during = [t for t in _done_times(swarm) if frozen_at <= t <= frozen_at + FROZEN_S]
    per_step = cfg.training.global_batch_size // cfg.training.micro_batch_size

    assert swarm.wait_exit("trainer", 300) == 0, trainer.log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    edges = [frozen_at, *during, frozen_at + FROZEN_S]
    gaps = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    print(
        f"{len(during)} micro-batches completed while s0b was frozen for {FROZEN_S:.0f} s; longest gap "
        f"without a completion then {max(gaps):.1f} s; timeouts {summary['timeouts']}, "
        f"retries without accumulating {summary['retries_not_accumulated']}"
    )
    # the swarm made progress while a replica was frozen: at least 3 steps' worth of micro-batches
    assert len(during) >= 3 * per_step, (len(during), trainer.log_text()[-3000:])
    assert summary["timeouts"] >= 1 and summary["microbatches_failed"] == 0
    assert summary["microbatches_completed"] == MICRO_BATCHES
    completed = {e["mb"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"}
    for stage in (0, 1):
        ledgers = {n: read_ledger(swarm.ledger_path(n)) for n, s in servers.items() if s == stage}
        account = account_stage(stage, ledgers, dead=set(), completed=completed)
        print(f"stage {stage}: {account.summary()}")
        assert not account.double_applied, account.summary()
        assert account.balanced, account.summary()
