"""A direct TCP data plane for hand-offs between stage servers (`chain`, `forward_backward`, `bundle`).

Why not libp2p for these: there every call between two servers is a yamux stream on their one TCP
connection, and the small frames that gate a sender (the receiver's acknowledgement, yamux's window
updates) queue behind the receiver's own bulk reply in that connection's send buffer. At 10 Mbit/s
the two stages of a swarm took turns on their uplinks, and direct 8-bit stopped at ~23 samples/s with
a quarter of each link unused (docs/LOG.md, 2026-11-25).

A client reaches a peer over a link of two connections, kept for the next calls:
- on the requests connection the client sends REQUEST(id, kind, packed message) frames, one after the
  other, and the server answers each with ACK(id) as soon as it holds all of it, before the work (this
  releases the sender's upload lane, runtime/server/hop_uploads.py);
- on the replies connection the server sends REPLY(id, packed reply) frames as answers are ready.
So an acknowledgement never follows bulk data in a socket buffer, the kernel's TCP flow control
replaces yamux's 256 KiB stream window, and each connection's bulk goes one way, back to back, so its
TCP state stays warm (a connection per exchange, tried first, reused connections idle for a second:
docs/LOG.md). A frame is a header `!BBQQ` (frame type, length of the kind, length of the body,
exchange id), the kind, the body.

A connection opens with a handshake, in every run, public or private (threat model: anyone can reach
the port and anyone on the path can read, drop, replay or change bytes):
1. the client sends its peer id, the peer id of the server it means to reach (an address now used by
   another process is refused, not served), a link id and role, a random nonce, an ephemeral X25519
   public key and its libp2p public key;
2. the server answers with its own nonce, ephemeral key and libp2p public key, and its signature over
   the transcript (a hash of every field of both messages);
3. the client checks that the server's key is the one its peer id names (a peer id is the hash of its
   public key: net/identity.py) and the signature, then signs the transcript itself; the server checks
   the same of the client's claimed peer id.
So each side proves the libp2p identity it claims, as libp2p's own handshake does, and a caller's peer
id (what a stage bans, credits or answers) is authenticated. Every frame's body is then sealed with
AES-GCM, the header as associated data, under a key derived (HKDF-SHA256) from the X25519 secret and
the transcript: an eavesdropper reads nothing, and a changed, dropped, replayed or reordered frame fails
its authentication (each direction counts its nonces) and ends the link. A private run adds what a
public one cannot ask: both sides prove they hold the run key (an HMAC over the transcript), and the run
key salts the frames' key, so a stranger cannot even complete the handshake.

A dial that fails (refused, unreachable, a failed handshake) raises `DialFailed` before anything is
sent, and the address is not tried again for `DIAL_COOLDOWN_S`: the caller uses libp2p meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import secrets
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p import P2PContext, PeerID

from swarmtrain.net import identity
from swarmtrain.net.auth import RunKey
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.link_meter import DOWN, METERED_MIN_BYTES, UP, LinkMeter
from swarmtrain.net.protocol import DIRECT_KINDS, Message, ProtocolError, error_message, pack
from swarmtrain.net.reachability import ip_and_tcp_port
from swarmtrain.net.transport import MAX_DRAIN_S, MAX_REPLY_BYTES, TransportStats, checked_reply
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

REQUEST, ACK, REPLY = 1, 2, 3
HANDSHAKE_TIMEOUT_S = 5.0
# what one server holds for callers it cannot trust (every limit refused cleanly once reached: a
# connection over a limit gets a handshake error, a request over a limit an `unavailable` answer, so
# the caller takes another peer or libp2p). Sizes: a swarm's link carries a few micro-batches (or
# bundles) at a time, and a local swarm's peers all dial from 127.0.0.1
IDLE_LINK_S = 120.0  # a requests connection with no frame and no answer under way is closed after this
FRAME_STALL_S = 20.0  # a frame must keep arriving: each 64 KiB of it (or its end) within this
WRITE_STALL_S = 60.0  # a reply or acknowledgement the caller does not read within this closes the link
MAX_CONNECTIONS = 512  # open connections (both of each link, and handshakes under way)
MAX_CONNECTIONS_PER_ADDRESS = 64  # of those, from one remote IP address
MAX_REQUESTS_PER_LINK = 64  # requests received and not yet answered, per link
MIN_HELD_BYTES = 128 << 20  # request bodies held (arriving or awaiting their answer), all links together
_CHUNK_BYTES = 1 << 16
DIAL_COOLDOWN_S = 60.0  # after a failed dial, libp2p carries the hand-offs to that address meanwhile
# loss-based congestion control on the data plane's sockets, where the system permits it (else its
# default): with both directions of a link busy, as a swarm keeps them, acknowledgements wait behind
# the peer's own upload, and BBR (v1), which caps its window at twice the bandwidth x its minimum
# round trip, stalled; on the test bed at 10 Mbit/s direct 8-bit did 26.6 samples/s with BBR, 27.5 with
# cubic (docs/LOG.md). cubic is Linux's usual default anyway
DEFAULT_CONGESTION = "cubic"
_DELIVERY_POLL_S = 0.01  # how often an upload checks that the peer acknowledged all of it
# Linux's struct tcp_info: eight one-byte fields, then 32-bit ones; milliseconds since the last data
# segment came, and since the last acknowledgement came, are the 12th and 13th of those
_TCP_INFO_BYTES = 104
_LAST_DATA_RECV, _LAST_ACK_RECV = 8 + 11 * 4, 8 + 12 * 4
_HEADER = struct.Struct("!BBQQ")
_HELLO_LENGTH = struct.Struct("!I")
_MAX_HELLO_BYTES = 4096
_NONCE_BYTES = 16
_TAG_BYTES = 16  # AES-GCM's authentication tag, appended to a sealed body
_PROTOCOL = "swarmtrain-data/2"
_DH_BYTES = 32  # an X25519 public key
_MAX_KEY_BYTES = 1200  # a libp2p RSA public key (up to MAX_RSA_BITS) or a signature, serialized
REQUESTS, REPLIES = "requests", "replies"  # a link's two connections

Address = tuple[str, int]
# (kind, request bytes, the sender as a libp2p context) -> the packed reply
Answer = Callable[[str, bytes, P2PContext], Awaitable[bytes]]


class DialFailed(ConnectionError):
    """No usable connection to the peer's data plane; nothing of the request was sent."""


_refused_congestion: set[str] = set()  # algorithms the system would not give us (logged once each)


def _unacknowledged_bytes(writer: asyncio.StreamWriter) -> int:
    """Bytes written to `writer` that its peer has not acknowledged yet: asyncio's buffer plus the
    socket's send queue (Linux's TIOCOUTQ: unsent and unacknowledged). Where the system cannot tell,
    the send queue reads as empty, and an upload's time ends when the kernel took its last byte."""
    pending = writer.transport.get_write_buffer_size()
    sock = writer.get_extra_info("socket")
    if sock is None:
        return pending
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile, or not a TCP socket
        return pending
    return pending + struct.unpack("i", raw)[0]


def _kernel_time_s(writer: asyncio.StreamWriter, field_offset: int) -> float | None:
    """When (time.monotonic) the kernel last saw what a TCP_INFO field of `field_offset` counts the
    milliseconds since (`_LAST_DATA_RECV`, `_LAST_ACK_RECV`); None where the system cannot tell."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES)
    except (OSError, ValueError):
        return None
    if len(raw) < field_offset + 4:
        return None
    return time.monotonic() - struct.unpack_from("I", raw, field_offset)[0] / 1e3


def set_congestion_control(writer: asyncio.StreamWriter, name: str | None) -> None:
    """Use TCP congestion control `name` on the connection (None: the system's default); where the
    system does not permit it (not loaded, or not in net.ipv4.tcp_allowed_congestion_control for an
    unprivileged process), the default stays."""
    option = getattr(socket, "TCP_CONGESTION", None)
    sock = writer.get_extra_info("socket")
    if name is None or option is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode())
    except OSError as exc:
        if name not in _refused_congestion:
            _refused_congestion.add(name)
            logger.info(
                "data plane: the system's TCP congestion control stays (%s refused: %s)", name, exc.strerror
            )


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
    exchange: int
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

    def skip(self) -> None:
        """A frame the receiver dropped unread still used its nonce."""
        self._received += 1

    def open(self, head: bytes, body: bytes) -> bytes:
        self._received += 1
        try:
            return self._aead.decrypt(self._receiving + self._received.to_bytes(8, "big"), body, head)
        except InvalidTag:
            raise ProtocolError("a data-plane frame failed its authentication", "unauthorized") from None


class _Channel:
    """One connection after its handshake: frames out (whole, in order) and in. With a `meter`, its
    large frames are timed (net/link_meter.py): a download from its header to its last byte, an upload
    from its first write until the peer's TCP has acknowledged every byte sent (a busy spell of the
    connection may hold several frames), each counted for `remote` (the peer at the other end)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        seal: _Seal,
        meter: LinkMeter | None = None,
        remote: str = "",
    ) -> None:
        self.reader, self.writer, self._seal = reader, writer, seal
        self.meter, self.remote = meter, remote
        self._sending = asyncio.Lock()
        self.partner: _Channel | None = None  # the other connection of its link, closed with this one
        self._uploading = 0  # bytes of the busy spell under way (0: none), delivered when it ends
        self._delivery: asyncio.Task | None = None

    async def send(self, kind_type: int, exchange: int, body: bytes, kind: str = "") -> None:
        kind_bytes = kind.encode()
        size = len(body) + _TAG_BYTES
        head = _HEADER.pack(kind_type, len(kind_bytes), size, exchange) + kind_bytes
        async with self._sending:  # frames go whole and in nonce order
            if self.writer.is_closing():  # aborted or closed meanwhile: writing would only log warnings
                raise ConnectionResetError("the data-plane connection is closed")
            body = self._seal.seal(head, body)
            self._upload_begins(len(head) + len(body))
            self.writer.write(head)
            self.writer.write(body)
            try:  # a peer that stops reading must not hold our buffers (and this lock) for ever
                await asyncio.wait_for(self.writer.drain(), WRITE_STALL_S)
            except TimeoutError:
                self.writer.transport.abort()  # close() would wait for the unread bytes to go
                raise ConnectionResetError(f"the peer read nothing for {WRITE_STALL_S:.0f} s") from None

    def _upload_begins(self, size: int) -> None:
        if self.meter is None or size < METERED_MIN_BYTES:
            return
        if not self._uploading:
            self.meter.started(UP, self.remote)
            self._delivery = asyncio.ensure_future(self._until_delivered(self.meter))
        self._uploading += size

    async def _until_delivered(self, meter: LinkMeter) -> None:
        """Ends the upload's busy spell once nothing of ours is unsent or unacknowledged; polled, the
        first check after 1 ms, then at most every `_DELIVERY_POLL_S`."""
        delivered, ended_s, delay_s = 0, None, 0.001
        try:
            while self._sending.locked() or _unacknowledged_bytes(self.writer):
                if self.writer.is_closing():
                    return  # not delivered: counted as nothing
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, _DELIVERY_POLL_S)
            delivered, ended_s = self._uploading, _kernel_time_s(self.writer, _LAST_ACK_RECV)
        finally:
            meter.stopped(UP, self.remote, delivered, ended_s)
            self._uploading = 0

    async def head(self, idle_s: float | None = None) -> _Head:
        """The next frame's header; its first byte may take `idle_s` (None: for ever), the rest of it
        `FRAME_STALL_S`."""
        first = await asyncio.wait_for(self.reader.readexactly(1), idle_s)
        raw = first + await self._exactly(_HEADER.size - 1)
        kind_type, kind_len, size, exchange = _HEADER.unpack(raw)
        kind_bytes = await self._exactly(kind_len)
        try:
            kind = kind_bytes.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("a data-plane frame with a malformed kind") from None
        return _Head(kind_type, kind, size, exchange, raw + kind_bytes)

    async def body(self, head: _Head) -> bytes:
        parts = []
        async with self._download(head):
            size = head.size
            while size > 0:
                part = await self._exactly(min(size, _CHUNK_BYTES))
                parts.append(part)
                size -= len(part)
        data = b"".join(parts)
        return self._seal.open(head.raw, data)

    async def skip(self, head: _Head) -> None:
        async with self._download(head):
            size = head.size
            while size > 0:
                size -= len(await self._exactly(min(size, _CHUNK_BYTES)))
        self._seal.skip()

    @contextlib.asynccontextmanager
    async def _download(self, head: _Head):
        """Times a large frame's body for the meter (from its header, read just before)."""
        if self.meter is None or head.size < METERED_MIN_BYTES:
            yield
            return
        self.meter.started(DOWN, self.remote)
        delivered, ended_s = 0, None
        try:
            yield
            delivered, ended_s = len(head.raw) + head.size, _kernel_time_s(self.writer, _LAST_DATA_RECV)
        finally:
            self.meter.stopped(DOWN, self.remote, delivered, ended_s)

    async def _exactly(self, size: int) -> bytes:
        """`size` bytes of a frame under way: a sender that stalls mid-frame is cut off."""
        try:  # a timeout context, not wait_for: that made a task per 64 KiB, 1-2 ms of CPU per MB frame
            async with asyncio.timeout(FRAME_STALL_S):
                return await self.reader.readexactly(size)
        except TimeoutError:
            raise ProtocolError(f"a data-plane frame stalled for {FRAME_STALL_S:.0f} s") from None

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
    data = await reader.readexactly(length)
    try:
        fields = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        raise ProtocolError("a malformed data-plane handshake message") from None
    if not isinstance(fields, dict):
        raise ProtocolError("a malformed data-plane handshake message")
    return fields


def _field(fields: dict, name: str, size: int | None = None, max_size: int = _MAX_KEY_BYTES) -> bytes:
    """A hex field of a handshake message: `size` bytes, or up to `max_size`."""
    try:
        value = bytes.fromhex(str(fields.get(name)))
    except ValueError:
        value = b""
    if not value or (size is not None and len(value) != size) or len(value) > max_size:
        raise ProtocolError(f"a data-plane handshake without a valid {name}")
    return value


def _transcript(hello: dict, reply: dict) -> bytes:
    """What both sides sign and derive their keys from: every field of both opening messages."""
    parts = [_PROTOCOL, hello["peer"], hello["to"], hello["link"], hello["role"]]
    parts += [hello["nonce"], reply["nonce"], hello["dh"], reply["dh"], hello["key"], reply["key"]]
    encoded = b"".join(struct.pack("!I", len(p)) + p for p in (str(x).encode() for x in parts))
    return hashlib.sha256(encoded).digest()


@dataclass(frozen=True)
class _Session:
    """What both sides derive from the handshake: the signed transcript, and in a private run the run
    key's proofs; the frames' key from the ephemeral X25519 secret (the run key mixed in when there)."""

    transcript: bytes
    shared: bytes  # the X25519 secret
    run_key: RunKey | None

    def signed(self, side: str) -> bytes:
        return f"{_PROTOCOL} {side}".encode() + self.transcript

    def proof(self, side: str) -> str:
        return self.run_key.mac(f"data-plane {side}", self.transcript).hex() if self.run_key else ""

    def seal(self, side: str) -> _Seal:
        salt = self.run_key.mac("data-plane session", self.transcript) if self.run_key else None
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=f"{_PROTOCOL} session".encode())
        key = hkdf.derive(self.shared + self.transcript)
        client, server = b"c->s", b"s->c"
        return _Seal(key, client, server) if side == "client" else _Seal(key, server, client)


def _ephemeral() -> tuple[X25519PrivateKey, str]:
    key = X25519PrivateKey.generate()
    return key, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def _shared(ours: X25519PrivateKey, fields: dict) -> bytes:
    try:
        return ours.exchange(X25519PublicKey.from_public_bytes(_field(fields, "dh", _DH_BYTES)))
    except ValueError:  # a low-order point: no shared secret
        raise ProtocolError("a data-plane handshake with an unusable key exchange") from None


@dataclass(frozen=True)
class _Hello:
    """Who calls (proven by its libp2p key), for which link and as which of its connections."""

    caller: str
    link: str
    role: str


async def _client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    me: PeerIdentity,
    server: str,
    run_key: RunKey | None,
    link: str,
    role: str,
) -> _Seal:
    ephemeral, dh = _ephemeral()
    hello = {"protocol": _PROTOCOL, "peer": me.peer_id, "to": server, "link": link, "role": role}
    hello |= {"nonce": secrets.token_hex(_NONCE_BYTES), "dh": dh, "key": me.public_key.hex()}
    await _say(writer, hello)
    reply = await _hear(reader)
    if "error" in reply:
        raise ProtocolError(f"refused: {str(reply['error']):.200}")
    if reply.get("peer") != server:
        raise ProtocolError(f"reached {str(reply.get('peer')):.60}, not {server}")
    _field(reply, "nonce", _NONCE_BYTES)
    their_key, shared = _field(reply, "key"), _shared(ephemeral, reply)  # checked before any use
    _check_key(server, their_key, f"the server could not prove it is {server}")
    session = _Session(_transcript(hello, reply), shared, run_key)
    if not identity.verify(server, their_key, session.signed("server"), _field(reply, "sig")):
        raise ProtocolError(f"the server could not prove it is {server}")
    if run_key is None and "proof" in reply:
        raise ProtocolError("the server's run is private and we hold no run key")
    if run_key is not None and not secrets.compare_digest(str(reply.get("proof")), session.proof("server")):
        raise ProtocolError("the server holds no valid run key")
    answer = {"sig": me.sign(session.signed("client")).hex()}
    await _say(writer, answer | ({"proof": session.proof("client")} if run_key is not None else {}))
    verdict = await _hear(reader)
    if "error" in verdict:
        raise ProtocolError(f"refused: {str(verdict['error']):.200}")
    return session.seal("client")


async def _server_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: PeerIdentity, run_key: RunKey | None
) -> tuple[_Hello, _Seal]:
    """Who calls, proven, and the frames' seal. A caller that fails any check (a malformed message, a
    key that is not its peer id's or no key at all, no proof) is told why in one error message and the
    refusal is logged in one line: what a stranger sends raises ProtocolError here, nothing else."""
    try:
        return await _proven_caller(reader, writer, me, run_key)
    except ProtocolError as exc:
        logger.info("data plane: refused a handshake from %s: %s", _remote_ip(writer), exc)
        with contextlib.suppress(OSError, RuntimeError):  # the caller may have gone already
            await _say(writer, {"error": str(exc)})
        raise


async def _proven_caller(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, me: PeerIdentity, run_key: RunKey | None
) -> tuple[_Hello, _Seal]:
    hello = await _hear(reader)
    caller, link, role = str(hello.get("peer", "")), str(hello.get("link", "")), hello.get("role")
    if hello.get("protocol") != _PROTOCOL:
        raise ProtocolError(f"protocol {str(hello.get('protocol')):.40} is not {_PROTOCOL}")
    if hello.get("to") != me.peer_id:
        raise ProtocolError(f"this is {me.peer_id}, not {str(hello.get('to')):.60}")
    if not _is_peer_id(caller):
        raise ProtocolError("a malformed peer id")
    if role not in (REQUESTS, REPLIES) or not 0 < len(link) <= 64:
        raise ProtocolError("a malformed link")
    _field(hello, "nonce", _NONCE_BYTES)
    ephemeral, dh = _ephemeral()
    their_key, shared = _field(hello, "key"), _shared(ephemeral, hello)  # checked before any use
    # the key is checked before we sign anything for it
    _check_key(caller, their_key, f"{caller[-8:]} could not prove it holds its peer id's key")
    reply = {
        "peer": me.peer_id,
        "nonce": secrets.token_hex(_NONCE_BYTES),
        "dh": dh,
        "key": me.public_key.hex(),
    }
    session = _Session(_transcript(hello, reply), shared, run_key)
    reply["sig"] = me.sign(session.signed("server")).hex()
    if run_key is not None:
        reply["proof"] = session.proof("server")
    await _say(writer, reply)
    answer = await _hear(reader)
    if not identity.verify(caller, their_key, session.signed("client"), _field(answer, "sig")):
        raise ProtocolError(f"{caller[-8:]} could not prove it holds its peer id's key", "unauthorized")
    if run_key is not None and not secrets.compare_digest(str(answer.get("proof")), session.proof("client")):
        raise ProtocolError(f"{caller[-8:]} holds no valid run key", "unauthorized")
    await _say(writer, {"ok": True})
    return _Hello(caller, link, role), session.seal("server")


def _check_key(peer_id: str, public_key: bytes, refusal: str) -> None:
    """ProtocolError(`refusal` and the reason) unless `public_key` is a usable libp2p key of `peer_id`
    (net/identity.py): bytes that hash to the claimed peer id can still be no key at all."""
    try:
        identity.public_key_of(peer_id, public_key)
    except identity.IdentityError as exc:
        raise ProtocolError(f"{refusal}: {exc}", "unauthorized") from None


def _remote_ip(writer: asyncio.StreamWriter) -> str:
    return str((writer.get_extra_info("peername") or ("?",))[0])


def _is_peer_id(text: str) -> bool:
    try:
        PeerID.from_base58(text)
    except Exception:  # base58 and multihash parsers raise several kinds
        return False
    return bool(text)


# the server -----------------------------------------------------------------------------------------
class DataPlaneServer:
    """Serves hand-offs on a TCP port: `answer(kind, data, context)` gives the packed reply (the same
    handlers as the libp2p servicer), `limit(kind)` the largest request accepted. Everything a caller
    can make it hold is bounded (the limits above): connections, requests in flight, bytes held, and
    the time a frame, an idle link or an unread reply may take."""

    def __init__(
        self,
        answer: Answer,
        limit: Callable[[str], int],
        me: PeerIdentity,
        run_key: RunKey | None,
        congestion: str | None = DEFAULT_CONGESTION,
        meter: LinkMeter | None = None,
    ) -> None:
        self.answer, self.limit, self.me, self.run_key = answer, limit, me, run_key
        self.meter = meter  # times this port's large frames (net/link_meter.py)
        self.peer_id = me.peer_id
        self.congestion = congestion
        self.port = 0
        # request bodies held at once: at least two of the largest requests (a bundle)
        self.max_held_bytes = max(MIN_HELD_BYTES, 2 * max(limit(kind) for kind in DIRECT_KINDS))
        self.held_bytes = 0
        self.refused = 0  # connections and requests refused by a limit (tests, logs)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._per_address: dict[str, int] = {}
        self._replies: dict[tuple[str, str], asyncio.Future[_Channel]] = {}  # per (caller, link)
        self._answers: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on `host`:`port` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._answers):
            task.cancel()
        for writer in list(self._writers):
            writer.close()

    def track_answer(self, task: asyncio.Task) -> None:
        """A link's answer under way: counted in `status` and cancelled at `close`."""
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    def status(self) -> dict:
        """What callers hold here now, against the limits (a stage's `info` reply)."""
        return {
            "connections": len(self._writers),
            "held_bytes": self.held_bytes,
            "max_held_bytes": self.max_held_bytes,
            "answers_under_way": len(self._answers),
            "refused": self.refused,
        }

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = str((writer.get_extra_info("peername") or ("?",))[0])
        if not self._admit_connection(address):
            self.refused += 1
            writer.close()
            return
        self._writers.add(writer)
        self._per_address[address] = self._per_address.get(address, 0) + 1
        set_congestion_control(writer, self.congestion)
        try:
            hello, seal = await asyncio.wait_for(
                _server_handshake(reader, writer, self.me, self.run_key), HANDSHAKE_TIMEOUT_S
            )
            channel = _Channel(reader, writer, seal, self.meter, hello.caller)
            if hello.role == REPLIES:
                await self._hold_replies(hello, channel)
            else:
                await self._take_requests(hello, channel)
        except (ProtocolError, TimeoutError, OSError, EOFError) as exc:
            logger.debug("data-plane connection ended: %r", exc)
        except asyncio.CancelledError:
            # the process is stopping: end quietly (asyncio's stream server logs a traceback for a
            # connection task that ends cancelled)
            pass
        finally:
            self._writers.discard(writer)
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]
            writer.close()

    def _admit_connection(self, address: str) -> bool:
        if len(self._writers) >= MAX_CONNECTIONS:
            logger.info("data plane: refused a connection from %s (%d open)", address, MAX_CONNECTIONS)
            return False
        if self._per_address.get(address, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
            logger.debug("data plane: refused a connection from %s (its limit)", address)
            return False
        return True

    def _reply_slot(self, hello: _Hello) -> asyncio.Future[_Channel]:
        return self._replies.setdefault(
            (hello.caller, hello.link), asyncio.get_running_loop().create_future()
        )

    async def _hold_replies(self, hello: _Hello, channel: _Channel) -> None:
        """Keep a link's replies connection until its requests connection ends (which closes it) or
        none comes within the handshake timeout. Nothing may come this way."""
        key = (hello.caller, hello.link)
        slot = self._reply_slot(hello)
        if slot.done():
            raise ProtocolError(f"a second replies connection for link {hello.link[:16]}")
        slot.set_result(channel)
        try:
            while True:
                waiting = key in self._replies  # no requests connection has taken it yet
                try:
                    sent = await asyncio.wait_for(
                        channel.reader.read(1), HANDSHAKE_TIMEOUT_S if waiting else None
                    )
                except TimeoutError:
                    if key in self._replies:
                        raise ProtocolError(
                            f"no requests connection came for link {hello.link[:16]}"
                        ) from None
                    continue
                if sent:
                    raise ProtocolError("nothing may come on a replies connection")
                return  # closed, by the caller or by the end of its requests connection
        finally:
            if self._replies.get(key) is slot:
                del self._replies[key]
            if channel.partner is not None:
                channel.partner.close()

    async def _take_requests(self, hello: _Hello, channel: _Channel) -> None:
        key = (hello.caller, hello.link)
        slot = self._reply_slot(hello)
        try:
            replies = await asyncio.wait_for(asyncio.shield(slot), HANDSHAKE_TIMEOUT_S)
        except TimeoutError:
            self._replies.pop(key, None)
            raise
        self._replies.pop(key, None)  # taken: a second requests connection for the link waits in vain
        replies.partner = channel
        context = P2PContext("data-plane", PeerID.from_base58(self.peer_id), PeerID.from_base58(hello.caller))
        link = _ServedLink(self, channel, replies, context)
        try:
            await link.serve()
        finally:
            replies.close()  # the replies connection ends with its requests connection

    def reserve(self, size: int) -> bool:
        """Hold `size` more bytes of request bodies, if the budget allows."""
        if self.held_bytes + size > self.max_held_bytes:
            return False
        self.held_bytes += size
        return True

    def release(self, size: int) -> None:
        self.held_bytes -= size


class _ServedLink:
    """The server's side of one link: requests in, acknowledgements and answers out, each request
    within the server's limits or refused."""

    def __init__(self, server: DataPlaneServer, requests: _Channel, replies: _Channel, context: P2PContext):
        self.server, self.requests, self.replies, self.context = server, requests, replies, context
        self.in_flight = 0
        self.active_s = time.monotonic()  # when a request last came or an answer last went

    async def serve(self) -> None:
        while True:
            try:
                head = await self._next_head()
            except asyncio.IncompleteReadError:
                return  # the caller closed the link
            except TimeoutError:
                logger.debug("data plane: closed a link idle for %.0f s", IDLE_LINK_S)
                return
            self.active_s = time.monotonic()
            if head.kind_type != REQUEST or head.kind not in DIRECT_KINDS:
                raise ProtocolError(f"frame type {head.kind_type} kind {head.kind!r} on the data plane")
            refusal = self._refusal(head)
            if refusal is not None:
                # answered at once, then read and dropped: the requests after it on this connection
                # stay readable (a frame too large to drain in time ends the link)
                await self.replies.send(REPLY, head.exchange, pack(error_message(*refusal)))
                await asyncio.wait_for(self.requests.skip(head), MAX_DRAIN_S)
                continue
            try:
                data = await self.requests.body(head)
            except BaseException:
                self.server.release(head.size)
                raise
            self.in_flight += 1
            self.server.track_answer(asyncio.create_task(self._reply(head, data)))
            await self.requests.send(ACK, head.exchange, b"")

    async def _next_head(self) -> _Head:
        """The next request's header; TimeoutError once the link was idle (no request coming, none
        being answered) for IDLE_LINK_S."""
        while True:
            idle_s = IDLE_LINK_S - (time.monotonic() - self.active_s)
            try:
                return await self.requests.head(idle_s=max(idle_s, 0.0))
            except TimeoutError:  # nothing of a frame was read: waiting again loses nothing
                if self.in_flight:
                    self.active_s = time.monotonic()
                elif time.monotonic() - self.active_s >= IDLE_LINK_S:
                    raise

    def _refusal(self, head: _Head) -> tuple[str, str] | None:
        """(text, code) of the answer that refuses this request unread, or None once its bytes are
        reserved."""
        limit = self.server.limit(head.kind)
        if head.size > limit + _TAG_BYTES:
            return f"message exceeds the limit of {limit} bytes", "too_large"
        if self.in_flight >= MAX_REQUESTS_PER_LINK:
            self.server.refused += 1
            return f"{MAX_REQUESTS_PER_LINK} requests of this link are under way; try another", "unavailable"
        if not self.server.reserve(head.size):
            self.server.refused += 1
            return "this server holds as many requests as it may; try another", "unavailable"
        return None

    async def _reply(self, head: _Head, data: bytes) -> None:
        try:
            reply = await self.server.answer(head.kind, data, self.context)
            del data
            await self.replies.send(REPLY, head.exchange, reply)
        except (OSError, RuntimeError) as exc:  # the caller went away meanwhile: its call failed already
            logger.debug("data-plane reply to %s lost: %r", self.context.remote_id, exc)
        finally:
            self.in_flight -= 1
            self.active_s = time.monotonic()
            self.server.release(head.size)


# the client -----------------------------------------------------------------------------------------
@dataclass
class _Exchange:
    received: asyncio.Event | None
    reply: asyncio.Future[bytes]


class _Link:
    """A client's two connections to one peer and the exchanges under way on them. Any failure of either
    connection fails every exchange under way (as a reset connection: the peer may be gone) and the
    link; the next call dials a new one."""

    def __init__(self, requests: _Channel, replies: _Channel) -> None:
        self.requests, self.replies = requests, replies
        self.broken: str | None = None
        self.last_frame_s = time.monotonic()  # when a frame last came from the server
        self.active_s = self.last_frame_s  # when a request last went or a frame last came
        self._exchanges: dict[int, _Exchange] = {}
        self._last_id = 0
        self._readers = [asyncio.create_task(self._read(c)) for c in (requests, replies)]

    async def exchange(self, kind: str, data: bytes, received: asyncio.Event | None) -> bytes:
        if self.broken is not None:
            raise ConnectionResetError(self.broken)
        self._last_id += 1
        exchange_id = self._last_id
        pending = _Exchange(received, asyncio.get_running_loop().create_future())
        self._exchanges[exchange_id] = pending
        self.active_s = time.monotonic()
        try:
            await self.requests.send(REQUEST, exchange_id, data, kind)
            return await pending.reply
        finally:  # answered, failed, timed out or cancelled: a late reply is dropped
            self._exchanges.pop(exchange_id, None)

    @property
    def exchanges(self) -> int:
        """Exchanges under way."""
        return len(self._exchanges)

    async def _read(self, channel: _Channel) -> None:
        try:
            while True:
                head = await channel.head()
                if head.kind_type not in (ACK, REPLY) or head.size > MAX_REPLY_BYTES + _TAG_BYTES:
                    raise ProtocolError(f"frame type {head.kind_type} of {head.size} bytes from the server")
                body = await channel.body(head)
                self.last_frame_s = self.active_s = time.monotonic()
                pending = self._exchanges.get(head.exchange)
                if pending is None:
                    continue  # a call that gave up
                if head.kind_type == ACK and pending.received is not None:
                    pending.received.set()
                elif head.kind_type == REPLY and not pending.reply.done():
                    pending.reply.set_result(body)
        except Exception as exc:  # noqa: BLE001 (EOF, reset, a bad frame: the link is done either way)
            self.close(f"data-plane link lost: {exc!r:.200}")

    def close(self, reason: str = "closed") -> None:
        if self.broken is None:
            self.broken = reason
        for pending in self._exchanges.values():
            if not pending.reply.done():
                pending.reply.set_exception(ConnectionResetError(self.broken))
        for task in self._readers:
            if task is not asyncio.current_task():
                task.cancel()
        self.requests.close()
        self.replies.close()


class DataPlaneClient:
    """Calls peers' data planes as `peer_id`, one link per peer; every call bounded by its timeout and
    counted in `stats` as `StageClient` counts its own. It raises what `StageClient.call` raises, plus
    `DialFailed`."""

    def __init__(
        self,
        me: PeerIdentity,
        run_key: RunKey | None = None,
        stats: TransportStats | None = None,
        congestion: str | None = DEFAULT_CONGESTION,
        meter: LinkMeter | None = None,
    ) -> None:
        self.me, self.run_key, self.congestion = me, run_key, congestion
        self.meter = meter  # times the links' large frames (net/link_meter.py)
        peer_id = self.peer_id = me.peer_id
        self.stats = stats or TransportStats()
        self.dials = 0  # links opened (tests: a link serves many calls)
        self._token = run_key.token(peer_id) if run_key is not None else None
        self._links: dict[tuple[Address, str], _Link] = {}
        self._dialing: dict[tuple[Address, str], asyncio.Lock] = {}
        self._failed_until_s: dict[Address, float] = {}

    async def call(
        self,
        address: Address,
        peer: str,
        message: Message,
        timeout_s: float,
        received: asyncio.Event | None = None,
    ) -> Message:
        """`message`'s reply from `peer` at `address`; `received` is set once the peer has all of it."""
        kind = message.kind
        if self._token is not None:
            message = Message(kind, {**message.header, "auth": self._token}, message.tensors)
        data = pack(message)
        link = await self._link(address, peer, timeout_s)
        started_s = time.monotonic()
        try:
            reply_bytes = await asyncio.wait_for(link.exchange(kind, data, received), timeout_s)
        except TimeoutError:
            if link.last_frame_s < started_s:  # not a slow answer: a dead or wedged link, dial anew
                link.close(f"nothing came over the link in {timeout_s:.1f} s")
            raise
        return checked_reply(self.stats, message, kind, data, reply_bytes, peer)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    async def _link(self, address: Address, peer: str, timeout_s: float) -> _Link:
        """The link to `peer`, dialled once however many calls need it at the same time."""
        dialing = self._dialing.setdefault((address, peer), asyncio.Lock())
        async with dialing:
            return await self._usable_link(address, peer, timeout_s)

    async def _usable_link(self, address: Address, peer: str, timeout_s: float) -> _Link:
        link = self._links.get((address, peer))
        if link is not None and link.broken is None:
            # the server closes a link idle for IDLE_LINK_S: one idle half as long is closed here and
            # dialled anew, so a request never races that close (and its reset never bans the peer)
            if link.exchanges or time.monotonic() - link.active_s < IDLE_LINK_S / 2:
                return link
            link.close("idle")
        if time.monotonic() < self._failed_until_s.get(address, 0.0):
            raise DialFailed(f"{address[0]}:{address[1]} failed a dial less than {DIAL_COOLDOWN_S:.0f} s ago")
        try:
            link = await asyncio.wait_for(self._dial(address, peer), min(timeout_s, HANDSHAKE_TIMEOUT_S))
        except (OSError, EOFError, ProtocolError) as exc:  # a TimeoutError is an OSError
            self._failed_until_s[address] = time.monotonic() + DIAL_COOLDOWN_S
            raise DialFailed(
                f"data plane of {peer[-8:]} at {address[0]}:{address[1]}: {exc!r:.200}"
            ) from None
        self._links[(address, peer)] = link
        self.dials += 1
        return link

    async def _dial(self, address: Address, peer: str) -> _Link:
        link_id = secrets.token_hex(_NONCE_BYTES)
        replies = await self._connect(address, peer, link_id, REPLIES)  # first: requests need it
        try:
            requests = await self._connect(address, peer, link_id, REQUESTS)
        except BaseException:
            replies.close()
            raise
        return _Link(requests, replies)

    async def _connect(self, address: Address, peer: str, link_id: str, role: str) -> _Channel:
        reader, writer = await asyncio.open_connection(*address)
        set_congestion_control(writer, self.congestion)
        try:
            seal = await _client_handshake(reader, writer, self.me, peer, self.run_key, link_id, role)
        except BaseException:
            writer.close()
            raise
        return _Channel(reader, writer, seal, self.meter, peer)
