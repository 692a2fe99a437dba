"""A direct TCP data plane for hand-offs between stage servers (`chain`, `forward_backward`, `bundle`)
and a trainer's chains to its first stage (net/direct_first.py).

Why not libp2p for these: there every call between two servers is a yamux stream on their one TCP
connection, and the small frames that gate a sender (the receiver's acknowledgement, yamux's window
updates) queue behind the receiver's own bulk reply in that connection's send buffer. At 10 Mbit/s
the two stages of a swarm then take turns on their uplinks, and direct 8-bit stops at ~23 samples/s
with a quarter of each link unused (docs/LOG.md).

A client reaches a peer over a link of two connections, kept for the next calls:
- on the requests connection the client sends REQUEST(id, kind, packed message) frames, one after the
  other, and the server answers each with ACK(id) as soon as it holds all of it, before the work (this
  releases the sender's upload lane, runtime/server/hop_uploads.py);
- on the replies connection the server sends REPLY(id, packed reply) frames as answers are ready.
So an acknowledgement never follows bulk data in a socket buffer, the kernel's TCP flow control
replaces yamux's 256 KiB stream window, and each connection's bulk goes one way, back to back, so its
TCP state stays warm (with a connection per exchange, each exchange takes a connection idle for about
a second, and uploads are slower: docs/LOG.md).

This file holds the links, their limits, the server and the client. A connection opens with a
handshake that proves both sides' libp2p identities and seals every frame after it (net/secure_link.py:
the handshake, the frames' AES-GCM, the threat model); net/framing.py reads and writes the frames of one
connection; net/tcp_tuning.py sets the sockets' congestion control and reads the kernel's counts that
time large frames.

A dial that fails (refused, unreachable, a failed handshake) raises `DialFailed` before anything is
sent, and the address is not tried again for `DIAL_COOLDOWN_S` (doubled after each failure in a row):
the caller uses libp2p meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from hivemind.p2p import P2PContext, PeerID

from swarmtrain.net.auth import RunKey
from swarmtrain.net.codec import Buffer
from swarmtrain.net.framing import ACK, REPLY, REQUEST, Channel, Head
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.link_meter import LinkMeter
from swarmtrain.net.protocol import DIRECT_KINDS, Message, ProtocolError, error_message, pack, pack_parts
from swarmtrain.net.reachability import ip_and_tcp_port
from swarmtrain.net.secure_link import (
    NONCE_BYTES,
    REPLIES,
    REQUESTS,
    TAG_BYTES,
    Hello,
    client_handshake,
    server_handshake,
)
from swarmtrain.net.server_bounds import ByteBounds, HeldBytes
from swarmtrain.net.stream import Stream, open_stream, serve_streams
from swarmtrain.net.tcp_tuning import DEFAULT_CONGESTION, set_congestion_control
from swarmtrain.net.transport import MAX_DRAIN_S, MAX_REPLY_BYTES, TransportStats, checked_reply
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
# what one server holds for callers it cannot trust (every limit refused cleanly once reached: a
# connection over a limit gets a handshake error, a request over a limit an `unavailable` answer, so
# the caller takes another peer or libp2p). Sizes: a swarm's link carries a few micro-batches (or
# bundles) at a time, and a local swarm's peers all dial from 127.0.0.1, so the limits per address stay
# loose and those per peer id (authenticated: a stranger's self-made identity is one) are the tight ones.
# Bytes: net/server_bounds.py sizes frames, bundles and the request bytes held, in all and per peer id,
# to the server's run and memory.
IDLE_LINK_S = 120.0  # a requests connection with no frame and no answer under way is closed after this
MAX_CONNECTIONS = 512  # open connections (both of each link, and handshakes under way)
MAX_CONNECTIONS_PER_ADDRESS = 64  # of those, from one remote IP address
MAX_CONNECTIONS_PER_PEER = 8  # of those, of one peer id once proven (a client keeps one link: two)
MAX_REQUESTS_PER_LINK = 64  # requests received and not yet answered, per link
# after a failed dial, libp2p carries the calls to that address for this long, doubled after each failure
# in a row up to MAX_DIAL_COOLDOWN_S (a data port a firewall closes: each dial holds that peer's calls up
# to HANDSHAKE_TIMEOUT_S)
DIAL_COOLDOWN_S = 60.0
MAX_DIAL_COOLDOWN_S = 960.0

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


def connection_limits() -> str:
    """The connection limits, for the start-up line of the bounds (`ByteBounds.line`)."""
    return (
        f", connections {MAX_CONNECTIONS_PER_PEER} per peer id, {MAX_CONNECTIONS_PER_ADDRESS} per "
        f"address and {MAX_CONNECTIONS} in all, {MAX_REQUESTS_PER_LINK} requests per link"
    )


# the server -----------------------------------------------------------------------------------------
class DataPlaneServer:
    """Serves hand-offs on a TCP port: `answer(kind, data, context)` gives the packed reply (the same
    handlers as the libp2p servicer), `limit(kind)` the largest request accepted. Everything a caller
    can make it hold is bounded (the limits above and net/framing.py's): connections, requests in
    flight, bytes held (`bounds`, counted in `held`, which the libp2p servicer may share; both default
    to bounds around `limit`), and the time a frame, an idle link or an unread reply may take."""

    def __init__(
        self,
        answer: Answer,
        limit: Callable[[str], int],
        me: PeerIdentity,
        run_key: RunKey | None,
        congestion: str | None = DEFAULT_CONGESTION,
        meter: LinkMeter | None = None,
        bounds: ByteBounds | None = None,
        held: HeldBytes | None = None,
    ) -> None:
        self.answer, self.limit, self.me, self.run_key = answer, limit, me, run_key
        self.meter = meter  # times this port's large frames (net/link_meter.py)
        self.peer_id = me.peer_id
        self.congestion = congestion
        self.port = 0
        self.bounds = bounds or ByteBounds.from_limits({kind: limit(kind) for kind in DIRECT_KINDS})
        self.held = held or HeldBytes(self.bounds.held_bytes, self.bounds.held_bytes_per_peer)
        self.refused = 0  # connections and requests refused by a limit other than bytes (tests, logs)
        self._server: asyncio.Server | None = None
        self._streams: set[Stream] = set()
        self._per_address: dict[str, int] = {}
        self._per_peer: dict[str, int] = {}  # connections of each proven peer id
        self._replies: dict[tuple[str, str], asyncio.Future[Channel]] = {}  # per (caller, link)
        self._answers: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on `host`:`port` (0: any free port); returns the port."""
        self._server = await serve_streams(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._answers):
            task.cancel()
        for stream in list(self._streams):
            stream.close()

    def track_answer(self, task: asyncio.Task) -> None:
        """A link's answer under way: counted in `status` and cancelled at `close`."""
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    def status(self) -> dict:
        """What callers hold here now, against the limits (a stage's `info` reply)."""
        return {
            "connections": len(self._streams),
            "peers_connected": len(self._per_peer),
            "answers_under_way": len(self._answers),
            **self.held.status(),
            "refused": self.refused + self.held.refused,
            "max_connections": MAX_CONNECTIONS,
            "max_connections_per_address": MAX_CONNECTIONS_PER_ADDRESS,
            "max_connections_per_peer": MAX_CONNECTIONS_PER_PEER,
            "max_requests_per_link": MAX_REQUESTS_PER_LINK,
            **self.bounds.as_dict(),
        }

    async def _serve(self, stream: Stream) -> None:
        address = str((stream.get_extra_info("peername") or ("?",))[0])
        if not self._admit_connection(address):
            self.refused += 1
            stream.close()
            return
        self._streams.add(stream)
        self._per_address[address] = self._per_address.get(address, 0) + 1
        set_congestion_control(stream, self.congestion)
        counted: list[str] = []  # the proven caller, once its connection counts against its limit
        try:
            hello, seal = await asyncio.wait_for(
                server_handshake(stream, self.me, self.run_key, partial(self._admit_peer, counted)),
                HANDSHAKE_TIMEOUT_S,
            )
            channel = Channel(stream, seal, self.meter, hello.caller)
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
            self._streams.discard(stream)
            _count_down(self._per_address, address)
            for caller in counted:
                _count_down(self._per_peer, caller)
            stream.close()

    def _admit_connection(self, address: str) -> bool:
        if len(self._streams) >= MAX_CONNECTIONS:
            logger.info("data plane: refused a connection from %s (%d open)", address, MAX_CONNECTIONS)
            return False
        if self._per_address.get(address, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
            logger.debug("data plane: refused a connection from %s (its limit)", address)
            return False
        return True

    def _admit_peer(self, counted: list[str], caller: str) -> str | None:
        """(at the end of a handshake, the caller proven) None once its connection counts against its peer
        id's limit, else why not: the handshake is refused with that reason."""
        if self._per_peer.get(caller, 0) >= MAX_CONNECTIONS_PER_PEER:
            self.refused += 1
            return f"{caller[-8:]} has {MAX_CONNECTIONS_PER_PEER} connections here, all a peer id may"
        self._per_peer[caller] = self._per_peer.get(caller, 0) + 1
        counted.append(caller)
        return None

    def _reply_slot(self, hello: Hello) -> asyncio.Future[Channel]:
        return self._replies.setdefault(
            (hello.caller, hello.link), asyncio.get_running_loop().create_future()
        )

    async def _hold_replies(self, hello: Hello, channel: Channel) -> None:
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
                        channel.stream.read(1), HANDSHAKE_TIMEOUT_S if waiting else None
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

    async def _take_requests(self, hello: Hello, channel: Channel) -> None:
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


def _count_down(counts: dict[str, int], key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


class _ServedLink:
    """The server's side of one link: requests in, acknowledgements and answers out, each request
    within the server's limits or refused."""

    def __init__(self, server: DataPlaneServer, requests: Channel, replies: Channel, context: P2PContext):
        self.server, self.requests, self.replies, self.context = server, requests, replies, context
        self.caller = context.remote_id.to_base58()  # proven by the handshake
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
                self.server.held.release(self.caller, head.size)
                raise
            self.in_flight += 1
            self.server.track_answer(asyncio.create_task(self._reply(head, data)))
            await self.requests.send(ACK, head.exchange, b"")

    async def _next_head(self) -> Head:
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

    def _refusal(self, head: Head) -> tuple[str, str] | None:
        """(text, code) of the answer that refuses this request unread, or None once its bytes are
        reserved."""
        limit = self.server.limit(head.kind)
        if head.size > limit + TAG_BYTES:
            return f"message exceeds the limit of {limit} bytes", "too_large"
        if self.in_flight >= MAX_REQUESTS_PER_LINK:
            self.server.refused += 1
            return f"{MAX_REQUESTS_PER_LINK} requests of this link are under way; try another", "unavailable"
        refusal = self.server.held.reserve(self.caller, head.size)
        return None if refusal is None else (refusal, "unavailable")

    async def _reply(self, head: Head, data: memoryview) -> None:
        try:
            reply = await self.server.answer(head.kind, data, self.context)
            del data
            await self.replies.send(REPLY, head.exchange, reply)
        except (OSError, RuntimeError) as exc:  # the caller went away meanwhile: its call failed already
            logger.debug("data-plane reply to %s lost: %r", self.context.remote_id, exc)
        finally:
            self.in_flight -= 1
            self.active_s = time.monotonic()
            self.server.held.release(self.caller, head.size)


# the client -----------------------------------------------------------------------------------------
@dataclass
class _Exchange:
    received: asyncio.Event | None
    reply: asyncio.Future[bytes]


class _Link:
    """A client's two connections to one peer and the exchanges under way on them. Any failure of either
    connection fails every exchange under way (as a reset connection: the peer may be gone) and the
    link; the next call dials a new one."""

    def __init__(self, requests: Channel, replies: Channel, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.requests, self.replies, self.max_reply_bytes = requests, replies, max_reply_bytes
        self.broken: str | None = None
        self.last_frame_s = time.monotonic()  # when a frame last came from the server
        self.active_s = self.last_frame_s  # when a request last went or a frame last came
        self._exchanges: dict[int, _Exchange] = {}
        self._last_id = 0
        self._readers = [asyncio.create_task(self._read(c)) for c in (requests, replies)]

    async def exchange(self, kind: str, data: list[Buffer], received: asyncio.Event | None) -> memoryview:
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

    async def _read(self, channel: Channel) -> None:
        try:
            while True:
                head = await channel.head()
                if head.kind_type not in (ACK, REPLY) or head.size > self.max_reply_bytes + TAG_BYTES:
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
    counted in `stats` as `StageClient` counts its own, and every reply by `max_reply_bytes` (a stage
    server's: the largest answer to what it hands off, net/server_bounds.py). It raises what
    `StageClient.call` raises, plus `DialFailed`."""

    def __init__(
        self,
        me: PeerIdentity,
        run_key: RunKey | None = None,
        stats: TransportStats | None = None,
        congestion: str | None = DEFAULT_CONGESTION,
        meter: LinkMeter | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.me, self.run_key, self.congestion = me, run_key, congestion
        self.max_reply_bytes = max_reply_bytes
        self.meter = meter  # times the links' large frames (net/link_meter.py)
        peer_id = self.peer_id = me.peer_id
        self.stats = stats or TransportStats()
        self.dials = 0  # links opened (tests: a link serves many calls)
        self._token = run_key.token(peer_id) if run_key is not None else None
        self._links: dict[tuple[Address, str], _Link] = {}
        self._dialing: dict[tuple[Address, str], asyncio.Lock] = {}
        self._failed_until_s: dict[Address, float] = {}
        self._failures: dict[Address, int] = {}  # failed dials in a row, per address

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
        data = pack_parts(message)  # sealed part by part: a payload is never copied to join them
        link = await self._link(address, peer, timeout_s)
        started_s = time.monotonic()
        try:
            reply_bytes = await asyncio.wait_for(link.exchange(kind, data, received), timeout_s)
        except TimeoutError:
            if link.last_frame_s < started_s:  # not a slow answer: a dead or wedged link, dial anew
                link.close(f"nothing came over the link in {timeout_s:.1f} s")
            raise
        sent_bytes = sum(len(part) for part in data)
        return checked_reply(self.stats, message, kind, sent_bytes, reply_bytes, peer, self.max_reply_bytes)

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
        rest_s = self._failed_until_s.get(address, 0.0) - time.monotonic()
        if rest_s > 0:
            raise DialFailed(f"{address[0]}:{address[1]} failed a dial; tried again in {rest_s:.0f} s")
        try:
            # at most half the call's time: the rest is libp2p's if the dial fails
            link = await asyncio.wait_for(self._dial(address, peer), min(timeout_s / 2, HANDSHAKE_TIMEOUT_S))
        except (OSError, EOFError, ProtocolError) as exc:  # a TimeoutError is an OSError
            failures = self._failures[address] = self._failures.get(address, 0) + 1
            cooldown_s = min(DIAL_COOLDOWN_S * 2 ** (failures - 1), MAX_DIAL_COOLDOWN_S)
            self._failed_until_s[address] = time.monotonic() + cooldown_s
            raise DialFailed(
                f"data plane of {peer[-8:]} at {address[0]}:{address[1]}: {exc!r:.200}"
            ) from None
        self._links[(address, peer)] = link
        self._failures.pop(address, None)
        self.dials += 1
        return link

    async def _dial(self, address: Address, peer: str) -> _Link:
        link_id = secrets.token_hex(NONCE_BYTES)
        replies = await self._connect(address, peer, link_id, REPLIES)  # first: requests need it
        try:
            requests = await self._connect(address, peer, link_id, REQUESTS)
        except BaseException:
            replies.close()
            raise
        return _Link(requests, replies, self.max_reply_bytes)

    async def _connect(self, address: Address, peer: str, link_id: str, role: str) -> Channel:
        stream = await open_stream(*address)
        set_congestion_control(stream, self.congestion)
        try:
            seal = await client_handshake(stream, self.me, peer, self.run_key, link_id, role)
        except BaseException:
            stream.close()
            raise
        return Channel(stream, seal, self.meter, peer)
