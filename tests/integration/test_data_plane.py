"""The direct data plane (net/data_plane.py) on loopback TCP, without a swarm: an acknowledgement before
the work, idle connections reused and one per exchange in flight, failures of the kinds the retry
table knows (net/failures.py), dials that fail before sending anything, and private runs: only holders
of the run key get in, and what crosses the wire is sealed."""

import asyncio
import os

import pytest
import torch
from hivemind.p2p import PeerID

from swarmtrain.net.auth import RunKey
from swarmtrain.net.data_plane import DIAL_COOLDOWN_S, DataPlaneClient, DataPlaneServer, DialFailed, _Seal
from swarmtrain.net.failures import Outcome, classify_failure
from swarmtrain.net.protocol import Message, ProtocolError, error_message, make_message, pack, unpack
from swarmtrain.net.transport import RemoteError

pytestmark = pytest.mark.integration

SERVER = PeerID(b"stage-1-server").to_base58()
CALLER = PeerID(b"stage-0-server").to_base58()
LIMIT_BYTES = 1 << 20
TIMEOUT_S = 10.0


def _hand_off(mb: str, size: int = 64) -> Message:
    return make_message(
        "forward_backward", {"mb": mb, "stage": 1}, {"inputs": torch.ones(1, size, 8)}, "8bit"
    )


class Handlers:
    """Answers with the request's `mb` and the caller's id; `gate` (when set) holds answers back."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.failing = False

    async def answer(self, kind: str, data: bytes, context) -> bytes:
        message = unpack(data, LIMIT_BYTES)
        self.calls.append((kind, context.remote_id.to_base58()))
        if self.gate is not None:
            await self.gate.wait()
        if self.failing:
            return pack(error_message("busy", "unavailable"))
        header = {
            "mb": message.header["mb"],
            "caller": context.remote_id.to_base58(),
            "auth": "auth" in message.header,
        }
        return pack(Message("result", header))


async def _serve(handlers: Handlers, run_key: RunKey | None = None) -> DataPlaneServer:
    server = DataPlaneServer(handlers.answer, lambda kind: LIMIT_BYTES, SERVER, run_key)
    await server.start("127.0.0.1")
    return server


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_call_is_acknowledged_before_the_work_and_answered_with_the_callers_id():
    async def main():
        handlers, received = Handlers(), asyncio.Event()
        handlers.gate = asyncio.Event()
        server = await _serve(handlers)
        client = DataPlaneClient(CALLER)
        try:
            call = asyncio.create_task(
                client.call(
                    ("127.0.0.1", server.port),
                    SERVER,
                    "forward_backward",
                    _hand_off("a"),
                    TIMEOUT_S,
                    received,
                )
            )
            await asyncio.wait_for(received.wait(), TIMEOUT_S)
            assert not call.done()  # the server has the request and has not answered yet
            handlers.gate.set()
            reply = await call
        finally:
            client.close()
            await server.close()
        assert reply.kind == "result" and reply.header["mb"] == "a" and reply.header["caller"] == CALLER
        assert handlers.calls == [("forward_backward", CALLER)]
        counted = client.stats.snapshot()
        assert counted[(1, "forward_backward", "out")].messages == 1
        assert counted[(1, "forward_backward", "back")].messages == 1

    _run(main())


def test_idle_connections_are_reused_and_every_exchange_in_flight_has_its_own():
    async def main():
        handlers = Handlers()
        server = await _serve(handlers)
        client = DataPlaneClient(CALLER)
        address = ("127.0.0.1", server.port)
        try:
            for mb in ("a", "b", "c"):
                await client.call(address, SERVER, "forward_backward", _hand_off(mb), TIMEOUT_S)
            assert client.dials == 1
            handlers.gate = asyncio.Event()
            calls = [
                asyncio.create_task(client.call(address, SERVER, "chain", _hand_off(mb), TIMEOUT_S))
                for mb in ("d", "e", "f")
            ]
            while len(handlers.calls) < 6:
                await asyncio.sleep(0.01)
            handlers.gate.set()
            replies = await asyncio.gather(*calls)
        finally:
            client.close()
            await server.close()
        assert [r.header["mb"] for r in replies] == ["d", "e", "f"]
        assert client.dials == 3  # the idle one and two new ones

    _run(main())


def test_failures_are_the_kinds_the_retry_table_knows():
    async def main():
        handlers = Handlers()
        server = await _serve(handlers)
        client = DataPlaneClient(CALLER)
        address = ("127.0.0.1", server.port)
        try:
            handlers.failing = True
            with pytest.raises(RemoteError) as refused:
                await client.call(address, SERVER, "chain", _hand_off("a"), TIMEOUT_S)
            assert classify_failure(refused.value) is Outcome.NEVER_RAN
            with pytest.raises(RemoteError) as too_large:
                await client.call(address, SERVER, "chain", _hand_off("big", size=LIMIT_BYTES), TIMEOUT_S)
            assert too_large.value.code == "too_large" and classify_failure(too_large.value) is Outcome.FATAL
            handlers.failing, handlers.gate = False, asyncio.Event()
            with pytest.raises(TimeoutError) as silent:
                await client.call(address, SERVER, "chain", _hand_off("b"), 0.5)
            assert classify_failure(silent.value) is Outcome.MAYBE_APPLIED
            cut = asyncio.create_task(client.call(address, SERVER, "chain", _hand_off("c"), TIMEOUT_S))
            while len(handlers.calls) < 3:
                await asyncio.sleep(0.01)
            await server.close()  # the server goes away mid-call
            with pytest.raises(Exception) as gone:
                await cut
            assert classify_failure(gone.value) is Outcome.GONE
        finally:
            client.close()
            await server.close()

    _run(main())


def test_a_dial_that_fails_sends_nothing_and_the_address_rests():
    async def main():
        handlers = Handlers()
        server = await _serve(handlers)
        client = DataPlaneClient(CALLER)
        address = ("127.0.0.1", server.port)
        try:
            with pytest.raises(DialFailed, match="not"):  # a process that is not the peer we mean
                await client.call(
                    address, PeerID(b"someone-else").to_base58(), "chain", _hand_off("a"), TIMEOUT_S
                )
            with pytest.raises(DialFailed, match=f"{DIAL_COOLDOWN_S:.0f} s ago"):
                await client.call(address, SERVER, "chain", _hand_off("b"), TIMEOUT_S)
        finally:
            client.close()
            await server.close()
        assert handlers.calls == []
        port = server.port
        with pytest.raises(DialFailed):  # nobody listens there any more
            await DataPlaneClient(CALLER).call(
                ("127.0.0.1", port), SERVER, "chain", _hand_off("c"), TIMEOUT_S
            )

    _run(main())


def test_in_a_private_run_only_key_holders_get_in():
    async def main():
        key, other = RunKey(os.urandom(32)), RunKey(os.urandom(32))
        handlers = Handlers()
        server = await _serve(handlers, key)
        address = ("127.0.0.1", server.port)
        member, stranger, keyless = (
            DataPlaneClient(CALLER, key),
            DataPlaneClient(CALLER, other),
            DataPlaneClient(CALLER),
        )
        try:
            reply = await member.call(address, SERVER, "chain", _hand_off("a"), TIMEOUT_S)
            assert reply.header["caller"] == CALLER and reply.header["auth"] is True  # with its token
            for outsider in (stranger, keyless):
                with pytest.raises(DialFailed):
                    await outsider.call(address, SERVER, "chain", _hand_off("b"), TIMEOUT_S)
        finally:
            for client in (member, stranger, keyless):
                client.close()
            await server.close()
        assert len(handlers.calls) == 1

    _run(main())


def test_a_sealed_frame_hides_its_body_and_fails_if_altered():
    key = os.urandom(32)
    sender, receiver = _Seal(key, b"c->s", b"s->c"), _Seal(key, b"s->c", b"c->s")
    body = pack(_hand_off("a"))
    sealed = sender.seal(b"head", body)
    assert body[:64] not in sealed and len(sealed) == len(body) + 16
    assert receiver.open(b"head", sealed) == body
    altered = sender.seal(b"head", body)
    with pytest.raises(ProtocolError):
        receiver.open(b"head", altered[:-1] + bytes([altered[-1] ^ 1]))
