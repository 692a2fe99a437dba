"""Direct hand-off under a real SIGKILL of the *next hop*: two replicas of stage 1, one killed while
stage-0 servers are handing it micro-batches. The stage-0 server retries on the other replica of the
route (it still holds its graph), the trainer completes every micro-batch, no server applies one
twice, and every stage's accounting balances (applied + pending + lost with the dead + not accumulated
after a cut-off call = completed)."""

import json
import time

import pytest

from swarm_fixtures import start_servers
from swarmtrain.runtime.harness.accounting import account_stage
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

MICRO_BATCHES = 160
SERVERS = {"s0": 0, "s1a": 1, "s1b": 1}


def _done(ledger_path) -> int:
    return sum(1 for e in read_ledger(ledger_path) if e["e"] == "done")


def test_sigkill_of_the_next_hop_mid_chain(make_swarm):
    swarm, cfg = make_swarm("tiny", {"training": {"max_samples": 8192}})
    start_servers(swarm, SERVERS)
    samples = MICRO_BATCHES * cfg.training.micro_batch_size
    swarm.start_trainer("trainer", "--max-samples", str(samples), "--in-flight", "4", "--hand-off", "direct")
    deadline = time.monotonic() + 120
    while _done(swarm.ledger_path("trainer")) < MICRO_BATCHES // 3:
        assert time.monotonic() < deadline, swarm.processes["trainer"].log_text()[-3000:]
        assert swarm.processes["trainer"].alive, swarm.processes["trainer"].log_text()[-3000:]
        time.sleep(0.05)
    swarm.kill("s1b")
    assert not swarm.processes["s1b"].alive  # the fault fired

    assert swarm.wait_exit("trainer", 240) == 0, swarm.processes["trainer"].log_text()[-3000:]
    summary = json.loads((swarm.workdir / "trainer.summary.json").read_text())
    assert summary["microbatches_completed"] == MICRO_BATCHES and summary["microbatches_failed"] == 0
    assert set(summary["transport"]["per_stage"]) == {"0", "1"}
    # the trainer's link carried no activation: only chains to stage 0, closes, and the pings with
    # which it probes the hops of a chain slowed by the kill (runtime/trainer/hedging.py)
    kinds = {k.split("_")[0] for stage in summary["transport"]["per_stage"].values() for k in stage}
    assert kinds <= {"chain", "close", "ping"}, kinds
    completed = {e["mb"] for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"}
    hop_retries = swarm.processes["s0"].log_text().count("stage 1 peer")
    print(f"stage-0 hop retries after the kill: {hop_retries}; trainer retries {summary['retries']}")

    time.sleep(1.0)  # the survivors' last step records
    for stage in (0, 1):
        ledgers = {n: read_ledger(swarm.ledger_path(n)) for n, s in SERVERS.items() if s == stage}
        account = account_stage(stage, ledgers, dead={"s1b"}, completed=completed)
        print(f"stage {stage}: {account.summary()}")
        assert not account.double_applied, account.double_applied
        assert not account.unaccounted, sorted(account.unaccounted)[:10]
        assert account.balanced
        accounted = (
            len(account.applied)
            + len(account.pending)
            + len(account.lost_with_dead)
            + len(account.lost_to_resync)
            + len(account.not_accumulated)
        )
        assert accounted == len(completed) == MICRO_BATCHES
