"""A server that moves keeps being reachable. Its process keeps the DHT node, and hivemind's averager for
the next stage is a forked process that calls `dht.replicate_p2p()` itself, sees another pid and drops the
P2P replica it inherited: the replica's finalizer deletes the unix socket through which the daemon
delivers the parent's incoming streams. Found live: a moved server's stage peers got "connection reset"
on every gradient exchange for the rest of the run (bench/rebalance_live.py). A moving server now
releases its replica before the next stage's averager forks (`net.engine.release_p2p_replica`)."""

import asyncio
import multiprocessing as mp
import os

import pytest

from swarmtrain.net.engine import PeerNetwork, release_p2p_replica, shutdown_quietly, start_dht

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_DHT = None  # the forked child reaches the parent's DHT object through this


def _drop_inherited_replica() -> None:
    """What hivemind's averager process does on start: a fresh replica replaces the inherited one, and the
    inherited one's finalizer runs (called here directly, as the garbage collector would at some point)."""
    inherited = _DHT._p2p_replica
    _DHT._p2p_replica = None
    if inherited is not None:
        inherited.__del__()
    os._exit(0)


def _fork_a_child_like_the_averager() -> None:
    child = mp.get_context("fork").Process(target=_drop_inherited_replica)
    child.start()
    child.join(30)
    assert child.exitcode == 0


async def _listening_replica(dht):
    async def handler(_info, _reader, writer):
        writer.close()

    p2p = await dht.replicate_p2p()
    await p2p.add_binary_stream_handler("swarmtrain-test", handler)
    return p2p


def test_a_released_replica_is_not_deleted_by_the_next_averager_process():
    global _DHT
    _DHT = dht = start_dht([], PeerNetwork(host="127.0.0.1"))
    loop = asyncio.new_event_loop()
    try:
        first = loop.run_until_complete(_listening_replica(dht))
        first_socket = first._client_listen_maddr["unix"]
        assert os.path.exists(first_socket)
        _fork_a_child_like_the_averager()  # the hazard: a child forked while we hold a replica
        assert not os.path.exists(first_socket)

        # what a moving server does: its handlers removed (as at any stop), then its replica released
        loop.run_until_complete(first.remove_binary_stream_handler("swarmtrain-test"))
        loop.run_until_complete(release_p2p_replica(dht, first))
        _fork_a_child_like_the_averager()  # the next stage's averager
        second = loop.run_until_complete(_listening_replica(dht))
        second_socket = second._client_listen_maddr["unix"]
        assert second is not first and second_socket != first_socket and os.path.exists(second_socket)
        loop.run_until_complete(second.shutdown())
    finally:
        loop.close()
        shutdown_quietly(dht)
        _DHT = None
