"""The data plane's stream (net/stream.py) on real TCP connections on 127.0.0.1, the seal's part-by-part
and in-place paths (net/secure_link.py) and messages parsed without copying their large payloads."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from swarmtrain.net import protocol
from swarmtrain.net.protocol import ProtocolError
from swarmtrain.net.secure_link import TAG_BYTES, Seal
from swarmtrain.net.stream import LIMIT_BYTES, Stream, open_stream, serve_streams, unfilled

TIMEOUT_S = 10.0
CHUNK_BYTES = 1 << 16


async def _pair(handler=None) -> tuple[Stream, Stream, asyncio.Server]:
    """(client, server side) of one connection; `handler` runs on the server's side if given."""
    accepted: asyncio.Queue[Stream] = asyncio.Queue()

    async def serve(stream: Stream) -> None:
        await accepted.put(stream)
        if handler is not None:
            await handler(stream)
        else:
            await asyncio.Event().wait()  # held open until the test closes it

    server = await serve_streams(serve, "127.0.0.1", 0)
    client = await open_stream("127.0.0.1", server.sockets[0].getsockname()[1])
    return client, await asyncio.wait_for(accepted.get(), TIMEOUT_S), server


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("size", [1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 << 20])
def test_frames_land_whole_in_the_readers_buffer_with_the_bytes_already_held(size):
    """Headers and bodies sent back to back in one write: a body's first bytes are already held when
    `readinto` starts, the rest comes straight from the socket; three frames in a row stay apart."""

    async def main():
        client, server_side, server = await _pair()
        bodies = [os.urandom(size) for _ in range(3)]
        client.write(b"".join(len(b).to_bytes(4, "big") + b for b in bodies))
        for body in bodies:
            length = int.from_bytes(await server_side.readexactly(4), "big")
            view = unfilled(length)
            await server_side.readinto(view, TIMEOUT_S, CHUNK_BYTES)
            assert bytes(view) == body
        client.close()
        assert await server_side.read() == b""
        server.close()

    _run(main())


def test_a_peer_that_sends_unread_fills_its_own_buffers_not_ours_and_loses_nothing():
    async def main():
        client, server_side, server = await _pair()
        data = os.urandom(4 << 20)
        client.write(data)
        drained = asyncio.ensure_future(client.drain())
        await asyncio.sleep(0.5)
        assert not drained.done()  # our side reads nothing: the sender waits
        assert server_side._paused_reading and len(server_side._held) <= LIMIT_BYTES + CHUNK_BYTES
        head = await server_side.readexactly(100)
        rest = unfilled(len(data) - 100)
        await server_side.readinto(rest, TIMEOUT_S, CHUNK_BYTES)
        assert head + bytes(rest) == data
        await asyncio.wait_for(drained, TIMEOUT_S)
        client.close()
        server.close()

    _run(main())


def test_the_end_of_a_connection_mid_read_is_an_incomplete_read():
    async def main():
        client, server_side, server = await _pair()
        client.write(b"abc")
        client.write_eof()
        with pytest.raises(asyncio.IncompleteReadError) as short:
            await server_side.readexactly(5)
        assert short.value.partial == b"abc"
        client2, server_side2, server2 = await _pair()
        client2.write(b"x" * 1000)
        client2.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await server_side2.readinto(unfilled(5000), TIMEOUT_S, CHUNK_BYTES)
        assert await server_side2.read(10) == b""
        for s in (server, server2):
            s.close()

    _run(main())


def test_a_body_that_stops_arriving_is_cut_off_after_the_stall():
    async def main():
        client, server_side, server = await _pair()
        client.write(b"x" * 1000)  # of a 200,000-byte body, then nothing
        with pytest.raises(TimeoutError):
            await server_side.readinto(unfilled(200_000), 0.3, CHUNK_BYTES)
        client.close()
        server.close()

    _run(main())


def test_drain_fails_once_the_connection_is_lost():
    async def main():
        client, server_side, server = await _pair()
        server_side.abort()  # a reset: the client's next writes find the connection gone
        with pytest.raises(ConnectionResetError):
            for _ in range(200):
                client.write(b"x" * (1 << 16))
                await client.drain()
                await asyncio.sleep(0.01)
        server.close()

    _run(main())


def test_a_handler_that_fails_is_one_log_line_and_a_closed_connection(caplog):
    async def fails(stream: Stream) -> None:
        await stream.readexactly(1)
        raise RuntimeError("a bug")

    async def main():
        client, _, server = await _pair(fails)
        client.write(b"!")
        assert await asyncio.wait_for(client.read(), TIMEOUT_S) == b""
        server.close()

    with caplog.at_level(logging.DEBUG):
        _run(main())
    failed = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None and "a bug" in failed[0].getMessage()


@pytest.mark.parametrize("sizes", [[5], [40, 0, 1000], [300, 2 << 20, 7, 1 << 20]])
def test_a_body_sealed_part_by_part_is_the_joined_body_sealed_and_opens_in_place(sizes):
    key = os.urandom(32)
    parts = [os.urandom(n) for n in sizes]
    body = b"".join(parts)
    out = unfilled(len(body) + TAG_BYTES)
    Seal(key, b"c->s", b"s->c").seal_into(b"head", parts, out)
    assert bytes(out) == Seal(key, b"c->s", b"s->c").seal(b"head", body)
    opened = Seal(key, b"s->c", b"c->s").open_in_place(b"head", out)
    assert bytes(opened) == body


def test_an_altered_or_short_body_fails_its_authentication_in_place():
    key = os.urandom(32)
    sealed = bytearray(Seal(key, b"c->s", b"s->c").seal(b"head", os.urandom(100)))
    sealed[3] ^= 1
    for bad in (sealed, bytearray(TAG_BYTES - 1)):
        with pytest.raises(ProtocolError, match="authentication"):
            Seal(key, b"s->c", b"c->s").open_in_place(b"head", bad)


def test_a_large_payload_is_parsed_as_a_view_and_a_small_one_as_a_copy():
    values = torch.randn(64, 1024)
    labels = torch.arange(16, dtype=torch.int64)
    message = protocol.make_message("result", {"mb": "m"}, {"outputs": values, "labels": labels})
    data = bytearray(protocol.pack(message))
    parsed = protocol.unpack(memoryview(data), len(data))
    assert isinstance(parsed.tensors["outputs"].payload, memoryview)
    assert isinstance(parsed.tensors["labels"].payload, bytes)
    assert torch.equal(parsed.tensor("outputs"), values) and torch.equal(parsed.tensor("labels"), labels)
    assert b"".join(protocol.pack_parts(parsed)) == bytes(data)
