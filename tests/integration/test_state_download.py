"""A state download abandons a donor that goes silent and takes the state from the next one (issue 40,
item 4), on real hivemind DHT nodes and `StageAverager`s on 127.0.0.1. The silent donor is a server
that froze (SIGSTOP of its libp2p daemon: a closed laptop lid, a host without power) after declaring
its state. Here the stream opens on the existing connection and its first part never comes; hivemind's
own download also moved on after its chunk timeout in this case (checked by hand: it logged a traceback
per failed donor). What `StageAverager._load_state_from_peers` adds, beyond one-line logs, is a bound
on opening the stream (a donor reached by a new dial through a cut link) and on the DHT read of the
donors; the resync that calls it is no longer capped at a fixed 60 s (stage_sync.SyncSettings)."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CHUNK_TIMEOUT_S = 2.0
DOWNLOAD_CAP_S = 40.0  # what the joiner allows the whole download: a hang on the frozen donor uses it up


def _node(initial_peers=None):
    from hivemind import DHT

    return DHT(initial_peers=initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def _averager(dht, donor: str, value: float, priority: float, declare_period_s: float):
    from swarmtrain.net.averaging import StageAverager

    averager = StageAverager(
        [torch.full((4,), value)],
        dht,
        prefix="download_test",
        state_provider=lambda: ({"donor": donor}, [torch.full((4,), value)]),
        declare_state_period_s=declare_period_s,
        next_chunk_timeout=CHUNK_TIMEOUT_S,
    )
    averager.state_sharing_priority = priority
    return averager


def _daemon_of(node) -> int:
    """The p2pd process a DHT node's process started."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, ppid = (
                stat[stat.find("(") + 1 : stat.rfind(")")],
                int(stat[stat.rfind(")") + 2 :].split()[1]),
            )
            if ppid == node.pid and name.startswith("p2pd"):
                return int(entry.name)
    raise AssertionError(f"no p2pd under the DHT process {node.pid}")


def test_a_frozen_donor_is_abandoned_for_the_next_one():
    awake_node = _node()
    frozen_node, joiner_node = (_node(awake_node.get_visible_maddrs()) for _ in range(2))
    nodes, averagers, frozen_daemon = [awake_node, frozen_node, joiner_node], [], None
    try:
        # the frozen donor ranks first and its declaration outlives the test (it cannot renew it frozen)
        averagers.append(_averager(frozen_node, "frozen", 1.0, priority=10.0, declare_period_s=120.0))
        averagers.append(_averager(awake_node, "awake", 7.0, priority=5.0, declare_period_s=5.0))
        joiner = _averager(joiner_node, "joiner", 0.0, priority=0.0, declare_period_s=1.0)
        averagers.append(joiner)
        joiner.allow_state_sharing = False
        deadline, loaded = time.monotonic() + 60, None
        while loaded is None or loaded[0].get("donor") != "frozen":  # both declared, the order known
            assert time.monotonic() < deadline, loaded
            time.sleep(1.0)
            loaded = joiner.download_state(timeout_s=DOWNLOAD_CAP_S)

        frozen_daemon = _daemon_of(frozen_node)
        os.kill(frozen_daemon, signal.SIGSTOP)
        started_s = time.monotonic()
        loaded = joiner.download_state(timeout_s=DOWNLOAD_CAP_S)
        took_s = time.monotonic() - started_s
        assert loaded is not None, "the download hung on the frozen donor until its overall cap"
        metadata, tensors = loaded
        assert metadata == {"donor": "awake"}
        torch.testing.assert_close(tensors[0], torch.full((4,), 7.0))
        print(
            f"state from the second donor {took_s:.1f} s after the first froze (chunk timeout {CHUNK_TIMEOUT_S} s)"
        )
    finally:
        if frozen_daemon is not None:
            os.kill(frozen_daemon, signal.SIGCONT)
        for averager in averagers:
            averager.shutdown()
        for node in nodes:
            node.shutdown()
