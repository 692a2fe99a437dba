"""RPC transport over hivemind's libp2p: streaming forward/backward handlers, a client that always
times out, and byte counting at the transport.

Messages (net/protocol.py) travel as a stream of `ExpertRequest`/`ExpertResponse` protobufs whose
`metadata` field carries consecutive chunks of the packed message: streams have no 4 MiB limit and
are faster than unary calls above ~100 KB (docs/DESIGN.md section 4). The server side reads at
most `max_message_bytes` and answers anything malformed with an error message instead of failing;
the client wraps the whole exchange in `asyncio.wait_for`, since hivemind's stubs cannot time out
streaming calls and a hung server would otherwise hang the trainer forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only recognizes typing's alias)

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarmtrain.net import codec
from swarmtrain.net.auth import RunKey
from swarmtrain.net.link_meter import DOWN, UP, LinkMeter
from swarmtrain.net.protocol import (
    HAND_OFF_KINDS,
    MICRO_BATCH_KINDS,
    STREAM_KINDS,
    UNARY_KINDS,
    Message,
    ProtocolError,
    error_message,
    pack,
    pack_parts,
    unpack,
)
from swarmtrain.net.server_bounds import ByteBounds, HeldBytes, Holding
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

CHUNK_BYTES = 512 * 1024
MAX_REPLY_BYTES = 1 << 30
MAX_DRAIN_S = 30.0  # how long an oversized upload is read (and dropped) so its sender gets the answer

Handler = Callable[[Message, P2PContext], Awaitable[Message]]


class RemoteError(RuntimeError):
    """The server answered with an error message (bad request, digest mismatch, overloaded...)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


class TruncatedReply(ConnectionError):
    """The reply stream ended before a complete message arrived."""


@dataclass
class ByteCount:
    messages: int = 0
    wire_bytes: int = 0
    fp32_bytes: int = 0


# a counter's direction: a caller's request (`out`) and the reply it got (`back`); a servicer's
# request received (`in`) and the reply it sent (`reply`)
SENT = ("out", "reply")
RECEIVED = ("in", "back")
DIRECTIONS = SENT + RECEIVED


class TransportStats:
    """Thread-safe byte counters keyed by (stage, message kind, direction), and the CPU seconds a
    servicer spent parsing requests and packing replies, by kind (the thread time of the event loop's
    synchronous parts: exact, whatever else the process does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str, str], ByteCount] = defaultdict(ByteCount)
        self._cpu_s: dict[str, float] = defaultdict(float)
        self.direct_in = 0  # requests answered over the direct data plane (net/data_plane.py)

    def add_cpu(self, kind: str, cpu_s: float) -> None:
        with self._lock:
            self._cpu_s[kind] += cpu_s

    def cpu_s(self, kinds: tuple[str, ...]) -> float:
        with self._lock:
            return sum(self._cpu_s.get(kind, 0.0) for kind in kinds)

    def record(self, stage: int, kind: str, direction: str, wire_bytes: int, fp32_bytes: int) -> None:
        with self._lock:
            count = self._counts[(stage, kind, direction)]
            count.messages += 1
            count.wire_bytes += wire_bytes
            count.fp32_bytes += fp32_bytes

    def snapshot(self) -> dict[tuple[int, str, str], ByteCount]:
        with self._lock:
            return {key: ByteCount(c.messages, c.wire_bytes, c.fp32_bytes) for key, c in self._counts.items()}

    def totals(self, directions: tuple[str, ...] = DIRECTIONS) -> ByteCount:
        """Summed over stages and kinds, of the given directions (all by default)."""
        total = ByteCount()
        for (_, _, direction), count in self.snapshot().items():
            if direction in directions:
                total.messages += count.messages
                total.wire_bytes += count.wire_bytes
                total.fp32_bytes += count.fp32_bytes
        return total

    def sent(self) -> ByteCount:
        """What this process put on the wire: its requests and its replies."""
        return self.totals(SENT)

    def received(self) -> ByteCount:
        """What it took off the wire: requests to it and replies to its requests."""
        return self.totals(RECEIVED)


def _chunks(data: bytes) -> list[bytes]:
    view = memoryview(data)
    return [bytes(view[i : i + CHUNK_BYTES]) for i in range(0, len(data), CHUNK_BYTES)] or [b""]


async def _collect(
    stream: AsyncIterator,
    max_bytes: int,
    drain_s: float = 0.0,
    timing: list[float] | None = None,
    holding: Holding | None = None,
) -> bytes:
    """Join a stream's chunks, each held in `holding` (the server's request bytes) if given. Past
    `max_bytes`, or once `holding` refuses a chunk, read and discard the rest for up to `drain_s`
    seconds before refusing (`too_large`, `unavailable`): a server that stops reading mid-upload closes
    the stream under the sender, which then sees a broken pipe instead of the answer (seen here at 2x
    and 3x the limit; p2pd resets the stream and the answer is lost). `timing` gets the last chunk's
    arrival (time.monotonic). A refused stream holds nothing."""
    parts, size, refusal = [], 0, None
    deadline_s = time.monotonic() + drain_s
    async for item in stream:
        if timing is not None:
            timing[:] = [time.monotonic()]
        size += len(item.metadata)
        if size <= max_bytes and refusal is None:
            refusal = holding.take(len(item.metadata)) if holding is not None else None
            if refusal is None:
                parts.append(item.metadata)
                continue
        parts.clear()
        if holding is not None:
            holding.release()
        if time.monotonic() > deadline_s:
            break
    if size > max_bytes:
        raise ProtocolError(f"message exceeds the limit of {max_bytes} bytes", "too_large")
    if refusal is not None:
        raise ProtocolError(refusal, "unavailable")
    return b"".join(parts)


async def _collect_reply(
    stream: AsyncIterator,
    received: asyncio.Event | None = None,
    arrived: list[float] | None = None,
    max_bytes: int = MAX_REPLY_BYTES,
) -> bytes:
    """A reply stream. A server that refuses a request before reading all of it (too large) answers
    and closes the stream; our upload then fails with a broken pipe after the answer arrived, and
    hivemind raises that at the stream's end: the complete answer is what counts. The first chunk
    (empty when the server acknowledges the request before working on it) sets `received`, and its
    arrival (time.monotonic) goes to `arrived`."""
    parts: list[bytes] = []
    size = 0
    try:
        async for item in stream:
            if received is not None:
                received.set()
            if arrived is not None and not arrived:
                arrived.append(time.monotonic())
            parts.append(item.metadata)
            size += len(item.metadata)
            if size > max_bytes:
                raise ProtocolError(f"reply exceeds {max_bytes} bytes", "too_large")
    except (OSError, EOFError, asyncio.IncompleteReadError):
        data = b"".join(parts)
        if not _is_complete(data, max_bytes):
            raise
        return data
    return b"".join(parts)


def _is_complete(data: bytes, max_bytes: int) -> bool:
    try:
        unpack(data, max_bytes)
    except ProtocolError:
        return False
    return True


class StageServicer(ServicerBase):
    """Registers `rpc_forward`, `rpc_backward`, `rpc_forward_backward`, `rpc_evaluate`, `rpc_chain`,
    `rpc_grads`, `rpc_step_means`, `rpc_round_mean` (streams) and `rpc_info`, `rpc_ping`, `rpc_close`
    (unary: small messages) under a namespace; one RPC per message kind, and a message of another kind
    sent to it is refused."""

    def __init__(
        self,
        handler: Handler,
        max_message_bytes: int,
        stats: TransportStats | None = None,
        run_key: RunKey | None = None,
        max_bundle_bytes: int = 0,
        max_micro_batch_bytes: int = 0,
        bounds: ByteBounds | None = None,
        held: HeldBytes | None = None,
    ) -> None:
        """`max_micro_batch_bytes`: the largest micro-batch request (`forward` ... `chain`) accepted,
        `max_bundle_bytes` the largest `bundle` (several micro-batches); 0: `max_message_bytes`, the limit
        of any other message (a replica's gradient sums may be much larger than a micro-batch). `bounds`
        (net/server_bounds.py), where given, sets the limit of each kind it bounds instead, and the
        requests of those kinds are held in `held` (shared with the server's data plane) as they come."""
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.max_bundle_bytes = max_bundle_bytes or max_message_bytes
        self.max_micro_batch_bytes = max_micro_batch_bytes or max_message_bytes
        self.bounds, self.held = bounds, held
        self.stats = stats or TransportStats()
        self.run_key = run_key  # a private run: only peers holding it are answered
        self.meter: LinkMeter | None = None  # times the requests that come in (net/link_meter.py)

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("forward", requests, context):
            yield response

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("backward", requests, context):
            yield response

    async def rpc_forward_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("forward_backward", requests, context):
            yield response

    async def rpc_evaluate(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("evaluate", requests, context):
            yield response

    async def rpc_chain(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("chain", requests, context):
            yield response

    async def rpc_evaluate_chain(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("evaluate_chain", requests, context):
            yield response

    async def rpc_bundle(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("bundle", requests, context):
            yield response

    async def rpc_grads(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("grads", requests, context):
            yield response

    async def rpc_step_means(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("step_means", requests, context):
            yield response

    async def rpc_round_mean(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve("round_mean", requests, context):
            yield response

    async def rpc_info(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self.answer_bytes("info", request.metadata, context))

    async def rpc_ping(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self.answer_bytes("ping", request.metadata, context))

    async def rpc_close(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(
            metadata=await self.answer_bytes("close", request.metadata, context)
        )

    async def _serve(self, kind: str, requests, context: P2PContext):
        # from the stream's opening (a request of one chunk, as a replica's gradient sums often are,
        # has no earlier chunk to time from) to its last chunk: evidence of our downlink's rate
        opened_s, timing = time.monotonic(), []
        holding = self._holding(kind, context)
        try:
            try:
                data = await _collect(requests, self.limit(kind), MAX_DRAIN_S, timing, holding)
            except ProtocolError as exc:
                packed = pack(error_message(str(exc), exc.code))
            else:
                # an empty first chunk says "your request is here" before the work starts: a sender that
                # hands off several micro-batches to us sends them one after the other
                # (`StageClient.call`'s `received`) instead of all at once at a fair share of its link,
                # which delivered them together and left this stage idle meanwhile (bench/wan.py)
                yield runtime_pb2.ExpertResponse(metadata=b"")
                if self.meter is not None and timing:
                    self.meter.call(DOWN, context.remote_id.to_base58(), len(data), timing[0] - opened_s)
                packed = await self.answer_bytes(kind, data, context)
                del data
            if holding is not None:  # answered: the request is let go, its reply goes as the caller reads
                holding.release()
            for chunk in _chunks(packed):
                yield runtime_pb2.ExpertResponse(metadata=chunk)
        finally:  # cancelled, or the caller went away: nothing stays held
            if holding is not None:
                holding.release()

    def _holding(self, kind: str, context: P2PContext) -> Holding | None:
        """Where a request of `kind` is held as it comes: the kinds `bounds` sizes, with `held`."""
        if self.held is None or self.bounds is None or kind not in self.bounds.limits:
            return None
        return Holding(self.held, context.remote_id.to_base58())

    def limit(self, kind: str) -> int:
        """The largest request of `kind` accepted."""
        if self.bounds is not None and kind in self.bounds.limits:
            return self.bounds.limits[kind]
        if kind == "bundle":
            return self.max_bundle_bytes
        if kind in MICRO_BATCH_KINDS or kind in HAND_OFF_KINDS:
            return self.max_micro_batch_bytes
        return self.max_message_bytes

    async def answer_direct(self, kind: str, data: codec.Buffer, context: P2PContext) -> list[codec.Buffer]:
        """The packed reply, in its parts (`pack_parts`: the data plane seals them without joining them),
        to a request that came over the data plane (net/data_plane.py)."""
        return await self._answer_parts(kind, data, context, direct=True)

    async def answer_bytes(self, kind: str, data: bytes, context: P2PContext) -> bytes:
        """The packed reply to a request that came over libp2p."""
        return b"".join(await self._answer_parts(kind, data, context))

    async def _answer_parts(
        self, kind: str, data: codec.Buffer, context: P2PContext, direct: bool = False
    ) -> list[codec.Buffer]:
        """The packed reply's parts, counted in `stats` as sent (`reply`) under the request's stage.
        `direct`: it came over the data plane, not libp2p."""
        stage, reply = await self._answer(kind, data, context)
        start_cpu_s = time.thread_time()
        packed = pack_parts(reply)
        if direct:
            self.stats.direct_in += 1  # on the event loop only: no lock
        self.stats.add_cpu(kind, time.thread_time() - start_cpu_s)
        self.stats.record(
            stage, kind, "reply", sum(len(part) for part in packed), reply.fp32_equivalent_bytes()
        )
        return packed

    async def _answer(self, kind: str, data: codec.Buffer, context: P2PContext) -> tuple[int, Message]:
        """(the request's stage, -1 if it names none; the reply message)."""
        start_cpu_s = time.thread_time()
        stage = -1
        try:
            message = unpack(data, self.limit(kind))
            if self.run_key is not None and not self.run_key.verify(
                context.remote_id.to_base58(), message.header.get("auth")
            ):
                raise ProtocolError(
                    "this run is private and the sender holds no valid run key", "unauthorized"
                )
            if message.kind != kind:
                raise ProtocolError(f"a {message.kind!r} message sent to the {kind} handler")
            named = message.header.get("stage")
            stage = named if isinstance(named, int) and not isinstance(named, bool) else -1
            self.stats.record(stage, kind, "in", len(data), message.fp32_equivalent_bytes())
            self.stats.add_cpu(kind, time.thread_time() - start_cpu_s)
            return stage, await self.handler(message, context)
        except ProtocolError as exc:
            logger.info("refused %s from %s: %s", kind, context.remote_id, exc)
            return stage, error_message(str(exc), exc.code)
        except Exception as exc:  # a bug in a handler must not kill the server; the caller gets the reason
            # one line in the log (no traceback in any log: README); the traceback at debug level
            logger.error("handler for %s failed: %r", kind, exc)
            logger.debug("handler for %s failed", kind, exc_info=exc)
            return stage, error_message(f"internal error: {exc!r}", "internal")


def is_peer_id(peer: str) -> bool:
    """Whether `peer` parses as a base58 libp2p peer id."""
    try:
        PeerID.from_base58(peer)
    except ValueError:
        return False
    return True


class StageClient:
    """Calls stage servers; every call is bounded by `timeout_s` and counted in `stats`, every reply by
    `max_reply_bytes` (a stage server's: the largest answer to its hand-offs or to its stage peers' step
    means, net/server_bounds.py)."""

    def __init__(
        self,
        p2p: P2P,
        namespace: str,
        stats: TransportStats | None = None,
        run_key: RunKey | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.p2p = p2p
        self.namespace = namespace
        self.max_reply_bytes = max_reply_bytes
        self.stats = stats or TransportStats()
        # a private run: every request carries our membership token (a keyed hash of our peer id)
        self._token = run_key.token(p2p.peer_id.to_base58()) if run_key is not None else None
        self.meter: LinkMeter | None = None  # times the requests that go out (net/link_meter.py)

    async def call(
        self, peer: str, message: Message, timeout_s: float, received: asyncio.Event | None = None
    ) -> Message:
        """Send `message` to the handler of its kind at `peer` (a base58 peer id, as the runtime holds
        them; hivemind's PeerID stays inside net/); raise RemoteError on an error answer,
        asyncio.TimeoutError on timeout and hivemind's P2P errors on connection failures. `received`
        is set once the server has the whole request (a stream's first reply chunk), before it works."""
        kind = message.kind
        if self._token is not None:
            message = Message(kind, {**message.header, "auth": self._token}, message.tensors)
        data = pack(message)
        exchange = self._exchange(peer, kind, data, received)
        reply_bytes = await asyncio.wait_for(exchange, timeout=timeout_s)
        return checked_reply(self.stats, message, kind, len(data), reply_bytes, peer, self.max_reply_bytes)

    async def ping_reply(self, peer: str, ping: Message, timeout_s: float) -> Message | None:
        """The peer's answer to `ping` within `timeout_s` (an error answer too, as an error message: the
        peer is alive), or None on a timeout, a connection failure or a `peer` that is no peer id (a
        stranger's record may name anything); anything else is a bug."""
        if not is_peer_id(peer):
            return None
        try:
            return await self.call(peer, ping, timeout_s)
        except RemoteError as exc:
            return error_message(exc.text, exc.code)
        except Exception as exc:
            if isinstance(exc, TimeoutError) or is_connection_error(exc):
                return None
            raise

    async def answers_ping(self, peer: str, ping: Message, timeout_s: float) -> bool:
        """Does the peer's event loop answer `ping` within `timeout_s`? Any answer counts."""
        return await self.ping_reply(peer, ping, timeout_s) is not None

    async def call_raw(self, peer: str, kind: str, data: bytes, timeout_s: float) -> Message:
        """Send arbitrary bytes to a handler (tests of a server's input validation)."""
        reply_bytes = await asyncio.wait_for(self._exchange(peer, kind, data), timeout=timeout_s)
        try:
            return unpack(reply_bytes, self.max_reply_bytes)
        except ProtocolError as exc:
            raise TruncatedReply(f"{len(reply_bytes)}-byte reply from {peer}: {exc}") from None

    async def _exchange(
        self, peer: str, kind: str, data: bytes, received: asyncio.Event | None = None
    ) -> bytes:
        stub = StageServicer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.namespace)
        if kind in UNARY_KINDS:
            response = await getattr(stub, f"rpc_{kind}")(runtime_pb2.ExpertRequest(metadata=data))
            return response.metadata

        async def requests():
            for chunk in _chunks(data):
                yield runtime_pb2.ExpertRequest(metadata=chunk)

        if kind not in STREAM_KINDS:
            raise ValueError(f"no handler for message kind {kind!r}")
        start_s = time.monotonic()
        stream = await getattr(stub, f"rpc_{kind}")(requests())
        arrived: list[float] = []
        reply = await _collect_reply(stream, received, arrived, self.max_reply_bytes)
        if self.meter is not None and arrived:  # the server acknowledges once it has all of the request
            self.meter.call(UP, peer, len(data), arrived[0] - start_s)
        return reply

    async def connect(self, peer: str, addresses: list[str], timeout_s: float) -> bool:
        """Best effort: tell our p2pd where a peer listens (its DHT may not know it yet), through the
        daemon's control socket (hivemind's P2P offers no public connect)."""
        from hivemind.p2p.p2p_daemon_bindings.control import ControlClient, DaemonConnector
        from hivemind.utils.multiaddr import Multiaddr

        try:
            # p2pd's connect takes transport addresses: with the /p2p/ID suffix that announcements
            # carry, it fails to parse them ("length greater than remaining number of bytes")
            maddrs = [Multiaddr(a.split("/p2p/")[0]) for a in addresses]
            connector = DaemonConnector(control_maddr=self.p2p.daemon_listen_maddr)
            # one control connection per request (no persistent one: it would need a listener)
            control = await ControlClient.create(daemon_connector=connector, use_persistent_conn=False)
            await asyncio.wait_for(control.connect(PeerID.from_base58(peer), maddrs), timeout=timeout_s)
            return True
        except Exception as exc:  # unreachable addresses are normal (NAT, stale record)
            logger.debug("connect to %s failed: %r", peer, exc)
            return False


def checked_reply(
    stats: TransportStats,
    message: Message,
    kind: str,
    sent_bytes: int,
    reply_bytes: codec.Buffer,
    peer: str,
    max_bytes: int = MAX_REPLY_BYTES,
) -> Message:
    """A call's reply (at most `max_bytes`), counted with its request in `stats`; RemoteError for an
    error answer. A truncated (or empty) reply is a transport failure, not a bad message: hivemind ends a
    reply stream silently when the connection closes early."""
    try:
        reply = unpack(reply_bytes, max_bytes)
    except ProtocolError as exc:
        raise TruncatedReply(f"{len(reply_bytes)}-byte reply from {peer}: {exc}") from None
    stage = message.header.get("stage", -1)
    stats.record(stage, kind, "out", sent_bytes, message.fp32_equivalent_bytes())
    stats.record(stage, kind, "back", len(reply_bytes), reply.fp32_equivalent_bytes())
    if reply.kind == "error":
        raise RemoteError(str(reply.header.get("code", "error")), str(reply.header.get("error", "")))
    return reply


def is_connection_error(exc: BaseException) -> bool:
    """Errors that mean the peer is gone or unreachable (ban it), as opposed to slow or refusing."""
    from hivemind.p2p import P2PDaemonError, P2PHandlerError

    if isinstance(exc, P2PHandlerError):
        return False  # the peer answered (with an error): it is alive
    return isinstance(exc, (P2PDaemonError, ConnectionError, EOFError, asyncio.IncompleteReadError, OSError))
