"""The data plane's frames on one connection after its handshake (net/data_plane.py: the links, the
server and the client; net/secure_link.py: the handshake and the seal). A frame is a header `!BBQQ`
(frame type, length of the kind, length of the body, exchange id), the kind, the body sealed with the
header and kind as associated data. A frame goes whole and in order; one that stalls mid-way, or a
peer that stops reading, ends the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

from swarmtrain.net.codec import Buffer
from swarmtrain.net.link_meter import DOWN, METERED_MIN_BYTES, UP, LinkMeter
from swarmtrain.net.protocol import ProtocolError
from swarmtrain.net.secure_link import TAG_BYTES, Seal
from swarmtrain.net.stream import Stream, unfilled
from swarmtrain.net.tcp_tuning import LAST_ACK_RECV, LAST_DATA_RECV, kernel_time_s, unacknowledged_bytes

REQUEST, ACK, REPLY = 1, 2, 3
# two of the data plane's limits on callers it cannot trust (the others: net/data_plane.py)
FRAME_STALL_S = 20.0  # a frame must keep arriving: each 64 KiB of it (or its end) within this
WRITE_STALL_S = 60.0  # a reply or acknowledgement the caller does not read within this closes the link
_CHUNK_BYTES = 1 << 16
_DELIVERY_POLL_S = 0.01  # how often an upload checks that the peer acknowledged all of it
HEADER = struct.Struct("!BBQQ")


@dataclass(frozen=True)
class Head:
    kind_type: int
    kind: str
    size: int
    exchange: int
    raw: bytes  # the header and kind as sent: a sealed body's associated data


class Channel:
    """One connection after its handshake: frames out (whole, in order) and in. With a `meter`, its
    large frames are timed (net/link_meter.py): a download from its header to its last byte, an upload
    from its first write until the peer's TCP has acknowledged every byte sent (a busy spell of the
    connection may hold several frames), each counted for `remote` (the peer at the other end)."""

    def __init__(self, stream: Stream, seal: Seal, meter: LinkMeter | None = None, remote: str = "") -> None:
        self.stream, self._seal = stream, seal
        self.meter, self.remote = meter, remote
        self._sending = asyncio.Lock()
        self.partner: Channel | None = None  # the other connection of its link, closed with this one
        self._uploading = 0  # bytes of the busy spell under way (0: none), delivered when it ends
        self._delivery: asyncio.Task | None = None

    async def send(self, kind_type: int, exchange: int, body: Buffer | list[Buffer], kind: str = "") -> None:
        """Send a frame whose body is `body` or the concatenation of its parts (net/protocol.py
        `pack_parts`: sealed part by part, never joined)."""
        parts = body if isinstance(body, list) else [body]
        kind_bytes = kind.encode()
        size = sum(len(part) for part in parts) + TAG_BYTES
        head = HEADER.pack(kind_type, len(kind_bytes), size, exchange) + kind_bytes
        async with self._sending:  # frames go whole and in nonce order
            if self.stream.is_closing():  # aborted or closed meanwhile: writing would only log warnings
                raise ConnectionResetError("the data-plane connection is closed")
            # one buffer, one write: with TCP_NODELAY (asyncio's default) two would send the header as its
            # own segment, 66 bytes of TCP/IP for its 18 on every small frame (docs/LOG.md)
            frame = unfilled(len(head) + size)
            frame[: len(head)] = head
            self._seal.seal_into(head, parts, frame[len(head) :])
            self._upload_begins(len(frame))
            self.stream.write(frame)
            try:  # a peer that stops reading must not hold our buffers (and this lock) for ever
                async with asyncio.timeout(WRITE_STALL_S):  # not wait_for: no task per frame
                    await self.stream.drain()
            except TimeoutError:
                self.stream.abort()  # close() would wait for the unread bytes to go
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
            while self._sending.locked() or unacknowledged_bytes(self.stream):
                if self.stream.is_closing():
                    return  # not delivered: counted as nothing
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, _DELIVERY_POLL_S)
            delivered, ended_s = self._uploading, kernel_time_s(self.stream, LAST_ACK_RECV)
        finally:
            meter.stopped(UP, self.remote, delivered, ended_s)
            self._uploading = 0

    async def head(self, idle_s: float | None = None) -> Head:
        """The next frame's header; its first byte may take `idle_s` (None: for ever), the rest of it
        `FRAME_STALL_S`."""
        async with asyncio.timeout(idle_s):  # not wait_for: no task per frame
            first = await self.stream.readexactly(1)
        raw = first + await self._exactly(HEADER.size - 1)
        kind_type, kind_len, size, exchange = HEADER.unpack(raw)
        kind_bytes = await self._exactly(kind_len)
        try:
            kind = kind_bytes.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("a data-plane frame with a malformed kind") from None
        return Head(kind_type, kind, size, exchange, raw + kind_bytes)

    async def body(self, head: Head) -> memoryview:
        """The frame's body, opened: read straight into its own buffer and opened there (no copy but the
        kernel's), each 64 KiB of it within `FRAME_STALL_S`."""
        data = unfilled(head.size)
        async with self._download(head):
            try:
                await self.stream.readinto(data, FRAME_STALL_S, _CHUNK_BYTES)
            except TimeoutError:
                raise ProtocolError(f"a data-plane frame stalled for {FRAME_STALL_S:.0f} s") from None
        return self._seal.open_in_place(head.raw, data)

    async def skip(self, head: Head) -> None:
        async with self._download(head):
            size = head.size
            while size > 0:
                size -= len(await self._exactly(min(size, _CHUNK_BYTES)))
        self._seal.skip()

    @contextlib.asynccontextmanager
    async def _download(self, head: Head):
        """Times a large frame's body for the meter (from its header, read just before)."""
        if self.meter is None or head.size < METERED_MIN_BYTES:
            yield
            return
        self.meter.started(DOWN, self.remote)
        delivered, ended_s = 0, None
        try:
            yield
            delivered, ended_s = len(head.raw) + head.size, kernel_time_s(self.stream, LAST_DATA_RECV)
        finally:
            self.meter.stopped(DOWN, self.remote, delivered, ended_s)

    async def _exactly(self, size: int) -> bytes:
        """`size` bytes of a frame under way: a sender that stalls mid-frame is cut off."""
        try:  # a timeout context, not wait_for: that made a task per 64 KiB, 1-2 ms of CPU per MB frame
            async with asyncio.timeout(FRAME_STALL_S):
                return await self.stream.readexactly(size)
        except TimeoutError:
            raise ProtocolError(f"a data-plane frame stalled for {FRAME_STALL_S:.0f} s") from None

    def close(self) -> None:
        self.stream.close()
