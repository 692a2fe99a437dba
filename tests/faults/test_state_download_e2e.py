"""A joining stage server whose donors are one frozen and one trickling gives up on both at the deadline
its own download rule gives (`--state-download-min-mbit`, `--state-download-base-s`), serves from the
stage's checkpoint with one WARNING, and the swarm trains on through it (issue 55, item 4, end to end:
spawned `swarmtrain server` processes; the rule and its fallback alone are tested in
tests/integration/test_state_download.py and tests/unit/test_stage_sync.py).

Both donors are real:
- the *frozen* donor is a stage-1 server whose main process is SIGSTOPped. Its hivemind DHT and averager
  processes and its p2pd run on (a server hung in its own code, or swapped out), so it stays declared as
  a donor and opens the download stream, but the state, which its averager asks the main process for,
  never comes: only the deadline ends that download (the 15 s silence cut is later than a donor's deadline
  here);
- the *trickling* donor is a stage-1 server whose upload the WAN test bed limits to `TRICKLE_MBIT`
  (`tc tbf`, runtime/harness/netbed.py): it sends a 64 KiB part about every second, well inside the 15 s
  silence cut, but would need over 20 s for the 1.4 MB state. A test bed rather than a donor stopped and
  continued in turns: the bytes really flow, slowly, as on a slow link, and no test hook is involved.
  Not slower: at 0.2 Mbit/s the donor's own DHT traffic (~15 kB/s, as much as the frozen donor's link
  carries) filled its link, its declaration as a donor lapsed and the joiner met it only on a retry.

Every peer runs in its own namespace of the bed (root; skipped without it). The joiner's own rule:
`MIN_MBIT` and `BASE_S` give each donor 4.8 s for tiny's stage-1 state, 14.4 s for the whole download
(3 donors); the default rule would give 90 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from swarm_fixtures import FAST_SWARM, TEARDOWN_GRACE_S
from swarmtrain.config import load_run_config
from swarmtrain.config.sizes import params_per_stage
from swarmtrain.planner.download_deadline import (
    REPORT_SLACK_S,
    DownloadRule,
    describe,
    donor_deadline_s,
    download_deadline_s,
    state_bytes,
)
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.local_swarm import READY_MARKER, LocalSwarm, write_run_toml
from swarmtrain.runtime.harness.netbed import WanTestbed
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180), pytest.mark.timed]

# one namespace per peer; the two trainers run one after the other in the same one
PEERS = {"dht": 0, "s0": 1, "frozen": 2, "trickle": 3, "joiner": 4, "trainer": 5, "trainer2": 5}
DONORS = ("frozen", "trickle")
STAGE = 1
MIN_MBIT, BASE_S = 4.0, 2.0  # the joiner's flags
TRICKLE_MBIT = 0.5  # the trickling donor's upload: 62.5 kB/s, an eighth of the joiner's minimum rate
FIRST_STEPS, MORE_STEPS = 3, 3  # trained before the joiner comes, and through it afterwards
# What the joiner's time (its ledger's `start` to `restore`: the whole join) may take beyond the rule's
# deadline and the averager's report slack: the DHT reads before the download (stage progress records,
# a few hundred ms, up to a 3 s request timeout for a node that does not answer) and the checkpoint's
# load, on a 2-core machine that other tests share
SLACK_S = 5.0
# a part of the state hivemind streams (hivemind.utils.streaming.STREAMING_CHUNK_SIZE_BYTES)
PART_BYTES = 2**16


@pytest.fixture
def bed():
    ok, why = netbed.available()
    if not ok:
        pytest.skip(why)
    with WanTestbed(max(PEERS.values()) + 1) as started:
        yield started


@pytest.fixture
def swarm(tmp_path, bed):
    """A LocalSwarm on the test bed whose every process is stopped at teardown, failed test or not."""
    sections = {"swarm": dict(FAST_SWARM, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every_steps=1)}
    config = write_run_toml(tmp_path / "run.toml", "tiny", sections)
    local = LocalSwarm(tmp_path / "swarm", config, netbed=bed, netbed_peers=PEERS)
    try:
        yield local
    finally:
        for name in DONORS:  # a stopped process takes no SIGTERM: let it go down with the others
            proc = local.processes.get(name)
            if proc is not None and proc.alive:
                os.kill(proc.pid, signal.SIGCONT)
        local.stop_all(grace_s=TEARDOWN_GRACE_S)


def test_a_joiner_with_a_frozen_and_a_trickling_donor_serves_from_its_checkpoint_by_the_deadline(
    swarm, bed, tmp_path
):
    cfg = load_run_config(swarm.config_path)
    batch = cfg.training.global_batch_size
    swarm.start_dht()
    servers = {"s0": 0, "frozen": STAGE, "trickle": STAGE}
    for name, stage in servers.items():
        swarm.start_server(name, stage)
    swarm.wait_ready(list(servers))
    _train(swarm, "trainer", FIRST_STEPS * batch)
    checkpoint = tmp_path / "ckpt" / f"stage{STAGE}" / f"step{FIRST_STEPS:08d}.json"
    _wait_for(checkpoint.exists, 30, f"no checkpoint {checkpoint}")
    donor_ids = {name: swarm.ledger_events(name, "ready")[0]["peer"] for name in DONORS}

    os.kill(swarm.processes["frozen"].pid, signal.SIGSTOP)  # the main process only
    bed.set_rate(PEERS["trickle"], TRICKLE_MBIT, None)
    flags = ("--state-download-min-mbit", str(MIN_MBIT), "--state-download-base-s", str(BASE_S))
    swarm.start_server("joiner", STAGE, *flags)
    sent = _wait_ready_counting_bytes_to(swarm, bed, "joiner", DONORS)

    rule = DownloadRule.of(MIN_MBIT, BASE_S)
    state = state_bytes(params_per_stage(cfg.model, cfg.stages()[STAGE]))
    donor_s, deadline_s = donor_deadline_s(state, rule), download_deadline_s(state, rule)
    start = swarm.ledger_events("joiner", "start")[0]
    restore = swarm.ledger_events("joiner", "restore")[0]
    took_s = restore["t"] - start["t"]
    log = swarm.processes["joiner"].log_text()
    print(
        f"joiner: from its start to its restore {took_s:.2f} s; both donors cut at {donor_s:.2f} s each "
        f"(>= {2 * donor_s:.2f} s), the rule's deadline {deadline_s:.2f} s (+ {REPORT_SLACK_S} s report "
        f"slack + {SLACK_S} s); bytes delivered to the joiner: {sent}"
    )
    assert restore["source"] == "checkpoint" and restore["epoch"] == FIRST_STEPS, restore
    # the rule it waited by is the one its flags give, printed before the download
    assert f"stage {STAGE} state downloads: {describe(state, rule)}" in log, log[-3000:]
    # The frozen donor, always declared, is tried in the first download and held to its own deadline. The
    # trickling one is too when the joiner's first read of the donors lists it (every run so far); read
    # only on a retry, it ends with that retry's whole deadline, which the log does not attribute
    cut = {
        name
        for name, peer in donor_ids.items()
        if f"from {peer} cut at its deadline of {donor_s:.1f} s" in log
    }
    print(f"donors cut at their own deadline, as the joiner logged: {sorted(cut)}")
    # twice in CI (never alone, nor beside two busy cores) the joiner's first read listed the trickling
    # donor only (docs/LOG.md, 2026-11-29 and 2026-11-30): the donors' own logs say what they declared
    donor_logs = "".join(f"\n--- {n}:\n{swarm.processes[n].log_text()[-1500:]}" for n in DONORS)
    assert "frozen" in cut, log[-3000:] + donor_logs
    # The time: within the rule's deadline (plus the stated slack), and not before two donors' deadlines
    # (each donor is held up to its deadline, the first read or a retry alike): a joiner that gave up on a
    # donor sooner, or tried one only, fails the lower bound; one that waited by the default rule, or
    # without a deadline, the upper
    assert 2 * donor_s <= took_s <= deadline_s + REPORT_SLACK_S + SLACK_S, took_s
    warnings = [line for line in log.splitlines() if "no donor completed the state download" in line]
    assert len(warnings) == 1 and f"checkpoint at step {FIRST_STEPS}" in warnings[0], warnings
    assert " W " in warnings[0], warnings  # logged as a WARNING
    assert not [line for line in log.splitlines() if " E " in line], log[-3000:]  # and nothing as an error
    # the trickling donor was sending the joiner its state: a part at least beyond the DHT answers that the
    # frozen donor, which sends no state, delivered (all of it never came: the joiner fell back above)
    assert sent["trickle"] - sent["frozen"] >= PART_BYTES, sent

    # the donors die; the joiner alone serves its stage, and the swarm trains on through it
    for name in DONORS:
        swarm.kill(name)
    summary = _train(swarm, "trainer2", MORE_STEPS * batch)
    assert summary["microbatches_failed"] == 0, summary
    joiner_id = swarm.ledger_events("joiner", "ready")[0]["peer"]
    steps = [e for e in read_ledger(swarm.ledger_path("joiner")) if e["e"] == "step"]
    assert [e["step"] for e in steps] == list(range(FIRST_STEPS, FIRST_STEPS + MORE_STEPS)), steps
    assert all(e["group"].get(joiner_id, 0) > 0 for e in steps), steps


def _wait_ready_counting_bytes_to(swarm: LocalSwarm, bed: WanTestbed, name: str, senders) -> dict[str, int]:
    """Wait until `name` serves; meanwhile the bytes each of `senders` delivered to it over TCP (the
    kernel's count per connection, `ss` in the sender's namespace, sampled until the end so a closed
    connection still counts): the state stream and the few DHT answers a donor sends a joiner, none
    of the donor's other traffic."""
    proc, host = swarm.processes[name], bed.host(PEERS[name])
    delivered: dict[str, dict[tuple[str, str], int]] = {sender: {} for sender in senders}
    deadline = time.monotonic() + 120
    while READY_MARKER not in proc.log_text():
        assert proc.alive and time.monotonic() < deadline, proc.log_text()[-3000:]
        for sender in senders:
            for connection, acked in _bytes_acked(bed, PEERS[sender], host).items():
                delivered[sender][connection] = max(acked, delivered[sender].get(connection, 0))
        time.sleep(0.2)
    return {sender: sum(found.values()) for sender, found in delivered.items()}


def _bytes_acked(bed: WanTestbed, i: int, host: str) -> dict[tuple[str, str], int]:
    """Per TCP connection of peer i to `host`: the bytes `host` acknowledged."""
    argv = ["ip", "netns", "exec", bed.namespace(i), "ss", "-tinH", "dst", host]
    lines = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
    found, connection = {}, None
    for line in lines:  # a connection's line, then its indented details
        if not line[:1].isspace():
            words = line.split()
            connection = (words[3], words[4]) if len(words) >= 5 else None
        elif connection is not None and (acked := re.search(r"\bbytes_acked:(\d+)", line)):
            found[connection] = int(acked.group(1))
    return found


def _train(swarm: LocalSwarm, name: str, samples: int) -> dict:
    """A trainer to `samples` samples of the run, to its end; its summary."""
    swarm.start_trainer(name, "--max-samples", str(samples), "--in-flight", "4")
    assert swarm.wait_exit(name, 120) == 0, swarm.processes[name].log_text()[-3000:]
    return json.loads(swarm.summary_path(name).read_text())


def _wait_for(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)
