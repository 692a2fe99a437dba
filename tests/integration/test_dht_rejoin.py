"""A DHT node that lost every neighbour joins again through its initial peers (net/dht_rejoin.py), on
real hivemind DHT nodes on 127.0.0.1.

The lost neighbours are made the way hivemind loses them: it deletes a node from its routing table when a
request to it goes unanswered (hivemind/dht/protocol.py `update_routing_table`), which a cut link does to
every request both ways; here the entries are deleted directly, on both sides, and the libp2p
connection between them closed. Netbed chaos, seed 0: a
stage-0 replica cut off for 26 s read no record of its stage peers for the rest of the run."""

import asyncio
import time
from functools import partial

import pytest

from swarmtrain.net.dht_rejoin import keep_joined, rejoin_if_alone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _node(initial_peers=None):
    from hivemind import DHT

    return DHT(initial_peers=initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


async def _forget(_dht, node, peer_ids: tuple[str, ...]) -> int:
    """(in the DHT's process) Delete these peers from the routing table, as unanswered requests do."""
    from hivemind.p2p import PeerID

    table, forgotten = node.protocol.routing_table, 0
    for peer in peer_ids:
        uid = table.get(peer_id=PeerID.from_base58(peer))
        if uid is not None:
            del table[uid]
            forgotten += 1
        await node.protocol.p2p._client.disconnect(PeerID.from_base58(peer))  # the cut drops the link
    return forgotten


async def _known(_dht, node) -> int:
    return sum(uid != node.node_id for uid in node.protocol.routing_table.uid_to_peer_id)


def _read(node, key: str):
    found = node.get(key, latest=True)
    return None if found is None else found.value


def test_a_node_that_knows_nobody_joins_again_and_reads_the_others_records():
    first = _node()
    initial = [str(a) for a in first.get_visible_maddrs()]
    second = _node(initial)
    try:
        assert rejoin_if_alone(second, initial) is None  # it knows the first: nothing to do
        assert first.store("record", "from the first", expiration_time=time.time() + 60)
        assert _read(second, "record") == "from the first"

        ids = (first.peer_id.to_base58(), second.peer_id.to_base58())
        assert first.run_coroutine(partial(_forget, peer_ids=ids[1:])) == 1
        assert second.run_coroutine(partial(_forget, peer_ids=ids[:1])) == 1
        assert second.run_coroutine(_known) == 0
        assert first.store("cut", "stored while cut off", expiration_time=time.time() + 60)
        assert _read(second, "cut") is None  # alone: its reads find only its own node

        assert rejoin_if_alone(second, initial) == 1
        assert second.run_coroutine(_known) >= 1 and first.run_coroutine(_known) >= 1
        assert _read(second, "cut") == "stored while cut off"
        assert rejoin_if_alone(second, initial) is None
    finally:
        second.shutdown()
        first.shutdown()


def test_a_node_with_no_initial_peers_is_left_alone():
    node = _node()
    try:
        assert rejoin_if_alone(node, []) is None
        assert rejoin_if_alone(node, None) is None
    finally:
        node.shutdown()


def test_a_trainers_loop_keeps_its_node_joined():
    """A trainer runs `keep_joined` beside its training (runtime/trainer/swarm_trainer.train_async)."""
    first = _node()
    initial = [str(a) for a in first.get_visible_maddrs()]
    second = _node(initial)
    try:
        ids = (first.peer_id.to_base58(), second.peer_id.to_base58())
        first.run_coroutine(partial(_forget, peer_ids=ids[1:]))
        second.run_coroutine(partial(_forget, peer_ids=ids[:1]))
        assert second.run_coroutine(_known) == 0

        async def scenario() -> int:
            loop = asyncio.get_running_loop()
            joining = asyncio.create_task(keep_joined(second, initial, period_s=0.2))
            deadline = time.monotonic() + 20.0
            while (known := await loop.run_in_executor(None, second.run_coroutine, _known)) == 0:
                assert time.monotonic() < deadline, "the loop never joined the node again"
                await asyncio.sleep(0.2)
            joining.cancel()
            return known

        assert asyncio.run(scenario()) >= 1
    finally:
        second.shutdown()
        first.shutdown()
