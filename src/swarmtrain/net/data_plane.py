"""A direct TCP data plane for hand-offs between stage servers (`chain`, `forward_backward`, `bundle`).

Why not libp2p for these: there every call between two servers is a yamux stream on their one TCP
connection, and the small frames that gate a sender (the receiver's acknowledgement, yamux's window
updates) queue behind the receiver's own bulk reply in that connection's send buffer. At 10 Mbit/s
the two stages of a swarm took turns on their uplinks, and direct 8-bit stopped at ~23 samples/s with
a quarter of each link unused (docs/LOG.md, 2026-11-25). Here every hand-off in flight has a
connection of its own: an acknowledgement waits behind at most the link's queue, and the kernel's TCP
flow control replaces yamux's 256 KiB stream window.

A connection carries one exchange at a time, and the client keeps idle ones per peer for the next:
  client REQUEST(kind, packed message) -> server ACK (the request is here, before the work) ->
  server REPLY(packed reply message).
A frame is a header `!BBQ` (frame type, length of the kind, length of the body), the kind, the body.

A connection opens with a handshake: each side sends a random nonce and its peer id, and the client
names the server it means to reach, so an address now used by another process is refused, not served.
In a private run both sides prove they hold the run key (an HMAC over both nonces and ids) and every
frame's body is sealed with AES-GCM under a key derived the same way, the header as associated data:
a stranger can neither call nor read nor alter a frame unnoticed. In a public run, which anyone may
join anyway, frames are neither authenticated nor encrypted (libp2p's transport is encrypted; this one
is not: README "Private runs").

A dial that fails (refused, unreachable, a failed handshake) raises `DialFailed` before anything is
sent, and the address is not tried again for `DIAL_COOLDOWN_S`: the caller uses libp2p meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.p2p import P2PContext, PeerID

from swarmtrain.net.auth import RunKey
from swarmtrain.net.protocol import Message, ProtocolError, error_message, pack, unpack
from swarmtrain.net.reachability import ip_and_tcp_port
from swarmtrain.net.transport import MAX_DRAIN_S, MAX_REPLY_BYTES, RemoteError, TransportStats, TruncatedReply
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

HAND_OFF_KINDS = ("chain", "forward_backward", "bundle")
REQUEST, ACK, REPLY = 1, 2, 3
HANDSHAKE_TIMEOUT_S = 5.0
DIAL_COOLDOWN_S = 60.0  # after a failed dial, libp2p carries the hand-offs to that address meanwhile
MAX_IDLE_PER_PEER = 8
_HEADER = struct.Struct("!BBQ")
_HELLO_LENGTH = struct.Struct("!I")
_MAX_HELLO_BYTES = 4096
_NONCE_BYTES = 16
_TAG_BYTES = 16  # AES-GCM's authentication tag, appended to a sealed body
_PROTOCOL = "swarmtrain-data/1"

Address = tuple[str, int]
# (kind, request bytes, the sender as a libp2p context) -> the packed reply
Answer = Callable[[str, bytes, P2PContext], Awaitable[bytes]]


class DialFailed(ConnectionError):
    """No usable connection to the peer's data plane; nothing of the request was sent."""


def dial_address(addresses: list[str], port: int) -> Address | None:
    """Where to reach a peer's data plane: the first non-loopback IP among its announced (libp2p)
    addresses, or a loopback one if that is all it has (a swarm on one machine), with `port`; None when
    it announces no data plane (port 0) or no direct address."""
    if port <= 0:
        return None
    ips = [ip for ip, _ in map(ip_and_tcp_port, addresses) if ip]
    outside = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    chosen = (outside or ips or [None])[0]
    return (chosen, port) if chosen is not None else None


@dataclass(frozen=True)
class _Head:
    kind_type: int
    kind: str
    size: int
    raw: bytes  # the header and kind as sent: a sealed body's associated data


class _Seal:
    """AES-GCM for one connection: a key from the handshake, a counted nonce per direction."""

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._aead = AESGCM(key)
        self._sending, self._receiving = sending, receiving  # 4-byte direction labels
        self._sent = self._received = 0

    def seal(self, head: bytes, body: bytes) -> bytes:
        self._sent += 1
        return self._aead.encrypt(self._sending + self._sent.to_bytes(8, "big"), body, head)

    def open(self, head: bytes, body: bytes) -> bytes:
        self._received += 1
        try:
            return self._aead.decrypt(self._receiving + self._received.to_bytes(8, "big"), body, head)
        except InvalidTag:
            raise ProtocolError("a data-plane frame failed its authentication", "unauthorized") from None


class _Channel:
    """One connection after its handshake: frames out and in."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seal: _Seal | None
    ) -> None:
        self.reader, self.writer, self._seal = reader, writer, seal

    async def send(self, kind_type: int, body: bytes, kind: str = "") -> None:
        kind_bytes = kind.encode()
        size = len(body) + (_TAG_BYTES if self._seal is not None else 0)
        head = _HEADER.pack(kind_type, len(kind_bytes), size) + kind_bytes
        if self._seal is not None:
            body = self._seal.seal(head, body)
        self.writer.write(head)
        self.writer.write(body)
        await self.writer.drain()

    async def head(self) -> _Head:
        raw = await self.reader.readexactly(_HEADER.size)
        kind_type, kind_len, size = _HEADER.unpack(raw)
        kind_bytes = await self.reader.readexactly(kind_len)
        try:
            kind = kind_bytes.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("a data-plane frame with a malformed kind") from None
        return _Head(kind_type, kind, size, raw + kind_bytes)

    async def body(self, head: _Head) -> bytes:
        data = await self.reader.readexactly(head.size)
        return self._seal.open(head.raw, data) if self._seal is not None else data

    async def skip(self, size: int) -> None:
        while size > 0:
            size -= len(await self.reader.readexactly(min(size, 1 << 16)))

    def overhead(self) -> int:
        return _TAG_BYTES if self._seal is not None else 0

    def close(self) -> None:
        self.writer.close()


# the handshake --------------------------------------------------------------------------------------
async def _say(writer: asyncio.StreamWriter, fields: dict) -> None:
    data = json.dumps(fields).encode()
    writer.write(_HELLO_LENGTH.pack(len(data)) + data)
    await writer.drain()


async def _hear(reader: asyncio.StreamReader) -> dict:
    (length,) = _HELLO_LENGTH.unpack(await reader.readexactly(_HELLO_LENGTH.size))
    if length > _MAX_HELLO_BYTES:
        raise ProtocolError(f"a data-plane handshake message of {length} bytes")
    try:
        fields = json.loads(await reader.readexactly(length))
    except ValueError:
        raise ProtocolError("a malformed data-plane handshake message") from None
    if not isinstance(fields, dict):
        raise ProtocolError("a malformed data-plane handshake message")
    return fields


def _nonce(fields: dict) -> bytes:
    try:
        nonce = bytes.fromhex(str(fields.get("nonce")))
    except ValueError:
        nonce = b""
    if len(nonce) != _NONCE_BYTES:
        raise ProtocolError("a data-plane handshake without a valid nonce")
    return nonce


@dataclass(frozen=True)
class _Session:
    """What both sides derive from the handshake: the proofs each must show and the frames' key."""

    run_key: RunKey
    parts: tuple[bytes, ...]  # client nonce, server nonce, client id, server id

    def proof(self, side: str) -> str:
        return self.run_key.mac(f"data-plane {side}", *self.parts).hex()

    def seal(self, side: str) -> _Seal:
        key = self.run_key.mac("data-plane session", *self.parts)
        client, server = b"c->s", b"s->c"
        return _Seal(key, client, server) if side == "client" else _Seal(key, server, client)


async def _client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: str, server: str, run_key: RunKey | None
) -> _Seal | None:
    ours = secrets.token_bytes(_NONCE_BYTES)
    await _say(writer, {"protocol": _PROTOCOL, "peer": me, "to": server, "nonce": ours.hex()})
    hello = await _hear(reader)
    if "error" in hello:
        raise ProtocolError(f"refused: {str(hello['error']):.200}")
    if hello.get("peer") != server:
        raise ProtocolError(f"reached {str(hello.get('peer')):.60}, not {server}")
    if run_key is None:
        if "proof" in hello:
            raise ProtocolError("the server's run is private and we hold no run key")
        return None
    session = _Session(run_key, (ours, _nonce(hello), me.encode(), server.encode()))
    if not secrets.compare_digest(str(hello.get("proof")), session.proof("server")):
        raise ProtocolError("the server holds no valid run key")
    await _say(writer, {"proof": session.proof("client")})
    if "error" in await _hear(reader):
        raise ProtocolError("the server refused our run key")
    return session.seal("client")


async def _server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: str, run_key: RunKey | None
) -> tuple[str, _Seal | None]:
    """The caller's (claimed, or in a private run proven) peer id, and the frames' seal."""
    hello = await _hear(reader)
    caller = str(hello.get("peer", ""))
    refusal = None
    if hello.get("protocol") != _PROTOCOL:
        refusal = f"protocol {str(hello.get('protocol')):.40} is not {_PROTOCOL}"
    elif hello.get("to") != me:
        refusal = f"this is {me}, not {str(hello.get('to')):.60}"
    elif not _is_peer_id(caller):
        refusal = "a malformed peer id"
    if refusal is not None:
        await _say(writer, {"error": refusal})
        raise ProtocolError(refusal)
    ours = secrets.token_bytes(_NONCE_BYTES)
    if run_key is None:
        await _say(writer, {"peer": me, "nonce": ours.hex()})
        return caller, None
    session = _Session(run_key, (_nonce(hello), ours, caller.encode(), me.encode()))
    await _say(writer, {"peer": me, "nonce": ours.hex(), "proof": session.proof("server")})
    if not secrets.compare_digest(str((await _hear(reader)).get("proof")), session.proof("client")):
        await _say(writer, {"error": "no valid run key"})
        raise ProtocolError(f"{caller[-8:]} holds no valid run key", "unauthorized")
    await _say(writer, {"ok": True})
    return caller, session.seal("server")


def _is_peer_id(text: str) -> bool:
    try:
        PeerID.from_base58(text)
    except Exception:  # base58 and multihash parsers raise several kinds
        return False
    return bool(text)


# the server -----------------------------------------------------------------------------------------
class DataPlaneServer:
    """Serves hand-offs on a TCP port: `answer(kind, data, context)` gives the packed reply (the same
    handlers as the libp2p servicer), `limit(kind)` the largest request accepted."""

    def __init__(
        self, answer: Answer, limit: Callable[[str], int], peer_id: str, run_key: RunKey | None
    ) -> None:
        self.answer, self.limit, self.peer_id, self.run_key = answer, limit, peer_id, run_key
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on `host`:`port` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            caller, seal = await asyncio.wait_for(
                _server_handshake(reader, writer, self.peer_id, self.run_key), HANDSHAKE_TIMEOUT_S
            )
            context = P2PContext("data-plane", PeerID.from_base58(self.peer_id), PeerID.from_base58(caller))
            channel = _Channel(reader, writer, seal)
            while await self._exchange(channel, context):
                pass
        except (ProtocolError, TimeoutError, OSError, EOFError) as exc:
            logger.debug("data-plane connection ended: %r", exc)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _exchange(self, channel: _Channel, context: P2PContext) -> bool:
        """One request answered; False when the connection should end (the caller closed it, or sent
        something no answer can follow)."""
        try:
            head = await channel.head()
        except asyncio.IncompleteReadError:
            return False  # the caller closed an idle connection
        if head.kind_type != REQUEST or head.kind not in HAND_OFF_KINDS:
            raise ProtocolError(f"frame type {head.kind_type} kind {head.kind!r} on the data plane")
        if head.size > self.limit(head.kind) + channel.overhead():
            text = f"message exceeds the limit of {self.limit(head.kind)} bytes"
            await channel.send(REPLY, pack(error_message(text, "too_large")))
            # read and drop the body: closing with it unread resets the connection, and the caller
            # would see a broken pipe instead of the answer
            await asyncio.wait_for(channel.skip(head.size), MAX_DRAIN_S)
            return True
        data = await channel.body(head)
        await channel.send(ACK, b"")
        await channel.send(REPLY, await self.answer(head.kind, data, context))
        return True


# the client -----------------------------------------------------------------------------------------
class DataPlaneClient:
    """Calls peers' data planes as `peer_id`; every call bounded by its timeout and counted in `stats`
    as `StageClient` counts its own. It raises what `StageClient.call` raises, plus `DialFailed`."""

    def __init__(
        self, peer_id: str, run_key: RunKey | None = None, stats: TransportStats | None = None
    ) -> None:
        self.peer_id, self.run_key = peer_id, run_key
        self.stats = stats or TransportStats()
        self.dials = 0  # connections opened (tests: idle ones are reused)
        self._token = run_key.token(peer_id) if run_key is not None else None
        self._idle: dict[tuple[Address, str], list[_Channel]] = {}
        self._failed_until_s: dict[Address, float] = {}

    async def call(
        self,
        address: Address,
        peer: str,
        kind: str,
        message: Message,
        timeout_s: float,
        received: asyncio.Event | None = None,
    ) -> Message:
        """`message`'s reply from `peer` at `address`; `received` is set once the peer has all of it."""
        if self._token is not None:
            message = Message(message.kind, {**message.header, "auth": self._token}, message.tensors)
        data = pack(message)
        channel = await self._checkout(address, peer, timeout_s)
        reply_bytes = await asyncio.wait_for(
            self._exchange(channel, (address, peer), kind, data, received), timeout_s
        )
        try:
            reply = unpack(reply_bytes, MAX_REPLY_BYTES)
        except ProtocolError as exc:
            raise TruncatedReply(f"{len(reply_bytes)}-byte reply from {peer}: {exc}") from None
        stage = message.header.get("stage", -1)
        self.stats.record(stage, kind, "out", len(data), message.fp32_equivalent_bytes())
        self.stats.record(stage, kind, "back", len(reply_bytes), reply.fp32_equivalent_bytes())
        if reply.kind == "error":
            raise RemoteError(str(reply.header.get("code", "error")), str(reply.header.get("error", "")))
        return reply

    def close(self) -> None:
        for channels in self._idle.values():
            for channel in channels:
                channel.close()
        self._idle.clear()

    async def _checkout(self, address: Address, peer: str, timeout_s: float) -> _Channel:
        idle = self._idle.get((address, peer), [])
        while idle:
            channel = idle.pop()
            if not channel.reader.at_eof() and not channel.writer.is_closing():
                return channel
            channel.close()
        if time.monotonic() < self._failed_until_s.get(address, 0.0):
            raise DialFailed(f"{address[0]}:{address[1]} failed a dial less than {DIAL_COOLDOWN_S:.0f} s ago")
        try:
            return await asyncio.wait_for(self._dial(address, peer), min(timeout_s, HANDSHAKE_TIMEOUT_S))
        except (OSError, EOFError, ProtocolError) as exc:  # a TimeoutError is an OSError
            self._failed_until_s[address] = time.monotonic() + DIAL_COOLDOWN_S
            raise DialFailed(
                f"data plane of {peer[-8:]} at {address[0]}:{address[1]}: {exc!r:.200}"
            ) from None

    async def _dial(self, address: Address, peer: str) -> _Channel:
        reader, writer = await asyncio.open_connection(*address)
        try:
            seal = await _client_handshake(reader, writer, self.peer_id, peer, self.run_key)
        except BaseException:
            writer.close()
            raise
        self.dials += 1
        return _Channel(reader, writer, seal)

    async def _exchange(
        self,
        channel: _Channel,
        key: tuple[Address, str],
        kind: str,
        data: bytes,
        received: asyncio.Event | None,
    ) -> bytes:
        done = False
        try:
            await channel.send(REQUEST, data, kind)
            head = await channel.head()
            if head.kind_type == ACK:
                await channel.body(head)
                if received is not None:
                    received.set()
                head = await channel.head()
            if head.kind_type != REPLY or head.size > MAX_REPLY_BYTES + channel.overhead():
                raise TruncatedReply(f"frame type {head.kind_type} of {head.size} bytes instead of a reply")
            reply = await channel.body(head)
            done = True
            return reply
        finally:  # cut off, timed out or cancelled: the connection's state is unknown, so it goes
            if done and len(self._idle.setdefault(key, [])) < MAX_IDLE_PER_PEER:
                self._idle[key].append(channel)
            else:
                channel.close()
