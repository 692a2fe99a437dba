"""No log of any role (DHT, server, trainer, replica) shows a traceback across a frozen replica, a cut
link, a whole-swarm SIGKILL with a restart from the stage checkpoints, and stops by SIGTERM and SIGINT.
The swarm's peers run in namespaces of the WAN test bed so that a link can be cut (root;
runtime/harness/netbed.py), the replicas on loopback; skipped without the test bed."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarm_fixtures import FAST_SWARM
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, write_run_toml
from swarmtrain.runtime.harness.netbed import WanTestbed

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

PEERS = {"dht": 0, "s0a": 1, "s0b": 2, "s1": 3, "trainer": 4}
SERVERS = {"s0a": 0, "s0b": 0, "s1": 1}
MANY_SAMPLES = str(1 << 20)  # more than the test lasts: every run here ends by a signal
FROZEN_S = 10.0  # long enough for DHT requests to the frozen peer to time out (5 s)
CUT_S = 6.0
TRAIN_S = 6.0  # between events: the swarm trains
ROUNDS = 3  # outer rounds the replicas average before one is frozen
# where a traceback (or asyncio's report of one) would show
TRACEBACK_MARKS = ("Traceback", "never retrieved", "Exception in callback")


@pytest.fixture
def bed():
    ok, why = netbed.available()
    if not ok:
        pytest.skip(why)
    with WanTestbed(len(PEERS)) as started:
        yield started


def test_no_log_shows_a_traceback_through_faults_crashes_and_stops(tmp_path, bed):
    sections = {"swarm": dict(FAST_SWARM, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every_steps=5)}
    config = write_run_toml(tmp_path / "run.toml", "tiny", sections)
    logs = []

    # the replicas run on loopback, apart from the test bed's peers: their part (a freeze and two stops) starts
    # while the bed's swarm is stalled by the cut link, its cores idle, and runs beside the rest of the test
    # instead of after it
    with ThreadPoolExecutor(1) as pool:
        with LocalSwarm(tmp_path / "first", config, netbed=bed, netbed_peers=PEERS) as swarm:
            _start(swarm)
            time.sleep(TRAIN_S)
            _freeze(swarm, "s0b", FROZEN_S)
            bed.cut(PEERS["s1"])  # the only stage-1 server: the swarm stalls until the link is back
            replicas = pool.submit(_replicas, tmp_path)
            time.sleep(CUT_S)
            bed.reconnect(PEERS["s1"])
            time.sleep(TRAIN_S)
            for proc in swarm.processes.values():  # a power cut: everything at once, mid-step
                proc.kill()
            logs += _logs(swarm)

        with LocalSwarm(tmp_path / "second", config, netbed=bed, netbed_peers=PEERS) as swarm:
            _start(swarm)  # each stage restores from its checkpoints
            time.sleep(TRAIN_S)
            codes = _stop(swarm, {"trainer": signal.SIGINT})
            codes |= _stop(swarm, {"s0a": signal.SIGTERM, "s0b": signal.SIGINT, "s1": signal.SIGTERM})
            codes |= _stop(swarm, {"dht": signal.SIGINT})
            logs += _logs(swarm)
            assert "restored" in swarm.processes["s1"].log_text().lower(), swarm.processes["s1"].log_text()[
                -2000:
            ]
        replica_codes, replica_logs = replicas.result()
    codes |= replica_codes
    logs += replica_logs

    print("exit codes:", codes)
    assert all(code is not None and code >= 0 for code in codes.values()), codes  # none died of a signal
    for name, text in logs:
        assert text.strip(), f"{name} wrote nothing"
        marks = [mark for mark in TRACEBACK_MARKS if mark in text]
        assert not marks, f"{name}: {marks}\n{_around(text, marks[0])}"


def _replicas(tmp_path) -> tuple[dict[str, int | None], list[tuple[str, str]]]:
    """Two DiLoCo replicas average a few outer rounds, one is frozen, then both are stopped (SIGINT,
    SIGTERM): their exit codes and every log of their swarm."""
    replica_config = write_run_toml(tmp_path / "replicas.toml", "tiny", {"swarm": dict(FAST_SWARM)})
    with LocalSwarm(tmp_path / "replicas", replica_config) as swarm:
        swarm.start_dht()
        common = ("--max-samples", MANY_SAMPLES, "--wait-for-replicas", "2", "--threads", "1")
        common += ("--log-period-s", "1")  # a progress line (rounds averaged so far) every second
        swarm.start_replica("replica0", "0/2", *common)
        swarm.start_replica("replica1", "1/2", *common)
        # a few outer rounds averaged before the freeze: waited for, not slept (beside the bed's swarm the
        # replicas start and train slower than alone)
        names = ("replica0", "replica1")
        deadline = time.monotonic() + 120
        while min(_rounds_averaged(swarm.processes[n].log_text()) for n in names) < ROUNDS:
            assert time.monotonic() < deadline, {n: swarm.processes[n].log_text()[-2000:] for n in names}
            time.sleep(0.5)
        _freeze(swarm, "replica1", FROZEN_S)
        time.sleep(TRAIN_S / 2)
        codes = _stop(swarm, {"replica0": signal.SIGINT, "replica1": signal.SIGTERM})
        codes |= _stop(swarm, {"dht": signal.SIGTERM})
        return codes, _logs(swarm)


def _rounds_averaged(log_text: str) -> int:
    """The outer rounds a replica's progress lines say it averaged, so far."""
    return max((int(n) for n in re.findall(r"rounds averaged (\d+)", log_text)), default=0)


def _start(swarm: LocalSwarm) -> None:
    swarm.start_dht()
    for name, stage in SERVERS.items():
        swarm.start_server(name, stage)
    swarm.wait_ready(list(SERVERS))
    swarm.start_trainer("trainer", "--max-samples", MANY_SAMPLES)


def _freeze(swarm: LocalSwarm, name: str, frozen_s: float) -> None:
    pid = swarm.processes[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(frozen_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def _stop(swarm: LocalSwarm, signals: dict[str, int], timeout_s: float = 60.0) -> dict[str, int | None]:
    """Send each process its signal at once, then wait for all of them: name -> exit code (None: still
    running after `timeout_s`)."""
    for name, sig in signals.items():
        os.kill(swarm.processes[name].pid, sig)
    return {
        f"{name} ({signal.Signals(sig).name})": swarm.wait_exit(name, timeout_s)
        for name, sig in signals.items()
    }


def _logs(swarm: LocalSwarm) -> list[tuple[str, str]]:
    return [(f"{swarm.workdir.name}/{name}", proc.log_text()) for name, proc in swarm.processes.items()]


def _around(text: str, mark: str, chars: int = 3000) -> str:
    at = text.index(mark)
    return text[max(0, at - chars // 3) : at + chars]
