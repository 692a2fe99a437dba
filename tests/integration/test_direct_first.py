"""Calls over a peer's data plane first (net/direct_first.py), against a real data-plane server on
loopback TCP: a trainer's chains go there when the peer announces one, everything else (relayed calls, a
peer without one, a failed dial, a link already carrying its share of calls) goes over libp2p, here a
recording stand-in for `StageClient` (the libp2p path itself is every swarm test's)."""

import asyncio

import pytest
import torch

from swarmtrain.net import direct_first
from swarmtrain.net.data_plane import DataPlaneClient, DataPlaneServer
from swarmtrain.net.direct_first import MAX_DIRECT_PER_PEER, DirectFirstClient
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.protocol import Message, make_message, pack, ping_message, unpack
from swarmtrain.net.transport import TransportStats

pytestmark = [pytest.mark.integration, pytest.mark.timed]

SERVER_IDENTITY, CALLER_IDENTITY = PeerIdentity.generate(), PeerIdentity.generate()
SERVER = SERVER_IDENTITY.peer_id
LIMIT_BYTES = 1 << 20


class Libp2pStandIn:
    """Records what would have gone over libp2p and answers it."""

    def __init__(self) -> None:
        self.stats = TransportStats()
        self.calls: list[tuple[str, str, float]] = []

    async def call(self, peer: str, message: Message, timeout_s: float, received=None) -> Message:
        self.calls.append((peer, message.kind, timeout_s))
        return Message("result", {"mb": message.header.get("mb"), "via": "libp2p"})


def _chain(mb: str) -> Message:
    return make_message(
        "chain", {"mb": mb, "stage": 0}, {"inputs": torch.ones(1, 8, dtype=torch.long)}, "none"
    )


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _served(gate: asyncio.Event | None = None):
    """A data-plane server that answers with the request's `mb` (once `gate` is set, if given)."""
    seen: list[str] = []

    async def answer(kind: str, data: bytes, context) -> bytes:
        mb = unpack(data, LIMIT_BYTES).header["mb"]
        seen.append(mb)
        if gate is not None:
            await gate.wait()
        return pack(Message("result", {"mb": mb, "via": "data plane"}))

    server = DataPlaneServer(answer, lambda kind: LIMIT_BYTES, SERVER_IDENTITY, None)
    await server.start("127.0.0.1")
    return server, seen


def test_chains_take_the_data_plane_and_other_kinds_or_peers_without_one_take_libp2p():
    async def main():
        server, seen = await _served()
        libp2p = Libp2pStandIn()
        addresses = {SERVER: ("127.0.0.1", server.port)}
        client = DirectFirstClient(libp2p, DataPlaneClient(CALLER_IDENTITY), addresses.get)
        try:
            assert (await client.call(SERVER, _chain("a"), 10.0)).header["via"] == "data plane"
            await client.call(SERVER, ping_message(0, "d"), 10.0)  # not a data-plane kind
            relayed = make_message(
                "forward_backward", {"mb": "r", "stage": 0}, {"inputs": torch.ones(1, 8)}, "none"
            )
            await client.call(SERVER, relayed, 10.0)  # a data-plane kind, but not a trainer's chain
            await client.call("elsewhere", _chain("b"), 10.0)  # announces no data plane
            without = DirectFirstClient(libp2p, None, addresses.get)  # a caller with no identity to prove
            await without.call(SERVER, _chain("c"), 10.0)
        finally:
            client.close()
            await server.close()
        assert seen == ["a"] and client.direct_calls == 1
        assert [(peer, kind) for peer, kind, _ in libp2p.calls] == [
            (SERVER, "ping"),
            (SERVER, "forward_backward"),
            ("elsewhere", "chain"),
            (SERVER, "chain"),
        ]
        assert client.stats is libp2p.stats  # one count of the trainer's bytes, whichever way they went
        with pytest.raises(ValueError, match="ping"):  # a kind the data plane does not take
            DirectFirstClient(libp2p, None, addresses.get, kinds=frozenset({"chain", "ping"}))

    _run(main())


def test_a_failed_dial_falls_back_to_libp2p_within_the_calls_time(monkeypatch):
    async def main():
        server, seen = await _served()
        port = server.port
        await server.close()  # nobody listens there now
        libp2p = Libp2pStandIn()
        client = DirectFirstClient(libp2p, DataPlaneClient(CALLER_IDENTITY), lambda peer: ("127.0.0.1", port))
        lines: list[str] = []
        monkeypatch.setattr(
            direct_first, "log_repeated", lambda logger, level, text, *args, **kw: lines.append(text % args)
        )
        try:
            for mb in ("a", "b"):  # the second: the address rests, no new dial
                assert (await client.call(SERVER, _chain(mb), 10.0)).header["via"] == "libp2p"
        finally:
            client.close()
        assert seen == [] and [kind for _, kind, _ in libp2p.calls] == ["chain", "chain"]
        assert all(0 < timeout_s <= 10.0 for _, _, timeout_s in libp2p.calls)
        assert "over libp2p for now" in lines[0] and "failed a dial; tried again in" in lines[1]

    _run(main())


def test_calls_past_a_links_share_go_over_libp2p():
    """The server refuses more than MAX_REQUESTS_PER_LINK unanswered requests on a link: a caller keeps
    MAX_DIRECT_PER_PEER under way on it and sends the rest over libp2p."""

    async def main():
        gate = asyncio.Event()
        server, seen = await _served(gate)
        libp2p = Libp2pStandIn()
        address = ("127.0.0.1", server.port)
        client = DirectFirstClient(libp2p, DataPlaneClient(CALLER_IDENTITY), lambda peer: address)
        try:
            held = [
                asyncio.create_task(client.call(SERVER, _chain(f"m{i}"), 10.0))
                for i in range(MAX_DIRECT_PER_PEER)
            ]
            while len(seen) < MAX_DIRECT_PER_PEER:
                await asyncio.sleep(0.01)
            assert (await client.call(SERVER, _chain("extra"), 10.0)).header["via"] == "libp2p"
            gate.set()
            answers = await asyncio.gather(*held)
            assert {a.header["via"] for a in answers} == {"data plane"}
            assert (await client.call(SERVER, _chain("after"), 10.0)).header["via"] == "data plane"
        finally:
            client.close()
            await server.close()
        assert [kind for _, kind, _ in libp2p.calls] == ["chain"]

    _run(main())
