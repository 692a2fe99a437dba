"""A DHT node that lost every neighbour joins the DHT again through its initial peers.

hivemind drops a node from its routing table when a request to it goes unanswered, and adds one only when
a request comes from it or is answered by it; it bootstraps from the initial peers once, at start. So a
peer whose link is cut for longer than a few of its DHT calls ends up knowing nobody, and nobody knowing
it: once the link is back, its reads find only its own records and its stores stay on its own node, for
good. Netbed chaos, seed 0: a stage-0 replica cut off for 26 s saw no stage peer for the last 40 s of the
run ("no records", no DHT error) and ended it 65 steps behind its peers.

`rejoin_if_alone` does what the bootstrap does, when the routing table holds no other node: it dials and
pings the initial peers (a ping answered adds each side to the other's table), clears their bans, and
looks up its own neighbours. Servers and trainers check every announce period; it costs one call into the
DHT's process while the node knows anybody, and pings only while it knows nobody. (An empty table is the
one state that never heals by itself: a live entry left after a cut adds us back on our next request to
it, a dead one is deleted on the first.)
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from functools import partial

from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

REJOIN_TIMEOUT_S = 10.0  # the pings and the neighbour lookup, each


def rejoin_if_alone(dht, initial_peers: list[str] | None, timeout_s: float = REJOIN_TIMEOUT_S) -> int | None:
    """None while the node knows another node (or has no initial peers); otherwise how many initial
    peers answered the ping that joins it again (0: none did; the next call tries again)."""
    if not initial_peers:
        return None
    rejoin = partial(_rejoin, initial_peers=tuple(initial_peers), timeout_s=timeout_s)
    try:
        answered = dht.run_coroutine(rejoin, return_future=True).result(timeout=3 * timeout_s)
    except Exception as exc:  # a dead or stuck DHT process: the caller's next period tries again
        log_repeated(logger, logging.INFO, "checking the DHT's routing table failed: %r", exc)
        return None
    if answered is not None:  # while nobody answers, once per repeat period (utils/logging.py)
        log_repeated(
            logger,
            logging.WARNING,
            "this peer's DHT node knew no other node (its link was cut?): %d of %d initial peers answered "
            "a ping to join again",
            answered,
            len(initial_peers),
            key=answered > 0,  # the line that says it joined again is never swallowed by the others
        )
    return answered


async def keep_joined(dht, initial_peers: list[str] | None, period_s: float) -> None:
    """`rejoin_if_alone` every `period_s`, off the event loop, until cancelled (servers' and trainers' loops)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period_s)
        await loop.run_in_executor(None, rejoin_if_alone, dht, initial_peers)


async def _rejoin(_dht, node, initial_peers: tuple[str, ...], timeout_s: float) -> int | None:
    """(in the DHT's process) The bootstrap again, if the routing table holds no node but this one."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    if any(uid != node.node_id for uid in node.protocol.routing_table.uid_to_peer_id):
        return None
    addresses: dict[PeerID, list[Multiaddr]] = {}
    for address in initial_peers:
        with suppress(Exception):  # an address with no peer id cannot be pinged
            maddr = Multiaddr(address)
            addresses.setdefault(PeerID.from_base58(maddr["p2p"]), []).append(maddr)
    addresses.pop(node.peer_id, None)
    answers = await asyncio.gather(
        *(_ping(node, peer, maddrs, timeout_s) for peer, maddrs in addresses.items())
    )
    answered = 0
    for peer, answer in zip(addresses, answers, strict=True):
        if answer is not None:
            answered += 1
            with suppress(Exception):  # banned during the cut, the lookup below would skip it
                node.blacklist.register_success(peer)
    if answered:
        with suppress(Exception):  # its neighbours are found by later calls too
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout_s)
    return answered


async def _ping(node, peer, maddrs, timeout_s: float):
    """Dial `peer` at its initial addresses (the daemon may have forgotten them), then ping it."""
    from hivemind.utils.multiaddr import Multiaddr

    try:  # hivemind's P2P offers no public dial; its daemon client does, to addresses without /p2p/
        bare = [m.decapsulate(Multiaddr(f"/p2p/{peer.to_base58()}")) for m in maddrs]
        await asyncio.wait_for(node.protocol.p2p._client.connect(peer, bare), timeout_s)
    except Exception as exc:  # the ping below still tries the addresses the daemon knows
        logger.debug("dialing initial peer %s failed: %r", peer, exc)
    with suppress(Exception):
        return await asyncio.wait_for(node.protocol.call_ping(peer), timeout_s)
    return None
