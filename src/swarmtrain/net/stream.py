"""One TCP connection of the data plane (net/data_plane.py) as an asyncio buffered protocol: what asyncio's
streams give (`readexactly`, `read`, `write`, `drain`, `close`) plus `readinto`, which lands a large
frame's body straight in the caller's buffer, so the kernel's copy is the only one. asyncio's
`StreamReader` copies each chunk the socket gives into its buffer and again out of it: 1.9 ms of one core
per 3.2 MB frame on 127.0.0.1 against 0.8 ms this way (docs/LOG.md, "The data plane's own stream").

Reads between frames (headers, handshakes) go through a buffer of at most `LIMIT_BYTES` beyond what a
reader asked for: above it the transport stops reading, as asyncio's streams do, so a peer that sends
without being read fills its own socket buffers, not this process's memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

import numpy

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

LIMIT_BYTES = 1 << 16  # bytes held unread before the transport pauses (asyncio's streams: 64 KiB)
_SCRATCH_BYTES = 1 << 16  # what one socket read may bring outside a `readinto`


class Stream(asyncio.BufferedProtocol):
    """Both directions of one connection. One reader at a time (as with asyncio's streams); any number of
    writers, each whole write in order."""

    def __init__(self, on_connect: Callable[[Stream], Awaitable[None]] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # protocol factories run in the loop
        self._on_connect = on_connect
        self.transport: asyncio.Transport | None = None
        self._held = bytearray()  # bytes read, not yet taken
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._target: memoryview | None = None  # `readinto`'s buffer while the socket fills it
        self._filled = 0  # bytes of `_target` filled
        self._chunk_bytes, self._next_due, self._progress_s = 0, 0, 0.0
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._error: BaseException | None = None  # why the connection was lost, if not a clean close
        self._lost = False
        self._paused_reading = self._paused_writing = False
        self._drain_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._handler: asyncio.Task | None = None

    # asyncio's protocol callbacks ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection's transport
        if self._on_connect is not None:
            self._handler = self._loop.create_task(self._on_connect(self))
            self._handler.add_done_callback(self._handler_done)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self._target is not None:
            return self._target[self._filled :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is None:
            self._held += memoryview(self._scratch)[:nbytes]
            if len(self._held) > LIMIT_BYTES and not self._paused_reading:
                self._paused_reading = True
                self.transport.pause_reading()
            self._wake()
            return
        self._filled += nbytes
        if self._filled >= self._next_due:  # another chunk in time: the next is due within the stall
            self._progress_s = self._loop.time()
            self._next_due = self._filled + self._chunk_bytes
        if self._filled == len(self._target):
            self._target = None
            self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the transport open: our side may still write (as asyncio's streams do)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost, self._eof = True, True
        self._error = exc
        self._wake()
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("Connection lost"))

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # reading ----------------------------------------------------------------------------------------
    async def readexactly(self, size: int) -> bytes:
        """`size` bytes; IncompleteReadError if the connection ends first."""
        while len(self._held) < size:
            self._raise_if_ended(size)
            await self._wait()
        return self._take(size)

    async def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes, as soon as any have come (-1: all until the connection ends); b"" once it
        has ended."""
        if size < 0:
            chunks = []
            while chunk := await self.read(LIMIT_BYTES):
                chunks.append(chunk)
            return b"".join(chunks)
        while not self._held:
            if self._eof:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait()
        return self._take(size)

    async def readinto(self, view: memoryview, stall_s: float, chunk_bytes: int) -> None:
        """Fill `view`: bytes already read first, then straight from the socket. Each `chunk_bytes` of it
        must come within `stall_s` of the one before (TimeoutError otherwise); IncompleteReadError if the
        connection ends first."""
        held = min(len(self._held), len(view))
        view[:held] = memoryview(self._held)[:held]
        self._drop(held)
        if held == len(view):
            return
        self._raise_if_ended(len(view), view[:held])
        self._target, self._filled, self._chunk_bytes = view, held, chunk_bytes
        self._progress_s, self._next_due = self._loop.time(), held + chunk_bytes
        try:
            while self._target is not None:
                try:
                    async with asyncio.timeout(self._progress_s + stall_s - self._loop.time()):
                        await self._wait()
                except TimeoutError:
                    if self._loop.time() - self._progress_s >= stall_s:
                        raise
                if self._target is not None:
                    self._raise_if_ended(len(view), view[: self._filled])
        finally:
            self._target = None

    def _raise_if_ended(self, wanted: int, partial: bytes | memoryview = b"") -> None:
        if self._error is not None:
            raise self._error
        if self._eof:
            raise asyncio.IncompleteReadError(bytes(self._held or partial), wanted)

    def _take(self, size: int) -> bytes:
        taken = bytes(memoryview(self._held)[:size])
        self._drop(size)
        return taken

    def _drop(self, size: int) -> None:
        del self._held[:size]
        if len(self._held) <= LIMIT_BYTES:
            self._resume_reading()

    def _resume_reading(self) -> None:
        if self._paused_reading and not self._lost:
            self._paused_reading = False
            self.transport.resume_reading()

    async def _wait(self) -> None:
        """Until something is read (or the connection ends): a reader waiting for more lets the
        transport read past the limit (as asyncio's streams do)."""
        if self._waiter is not None:
            raise RuntimeError("two coroutines read one data-plane connection")
        self._resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # writing ----------------------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.transport.write(data)

    def write_eof(self) -> None:
        self.transport.write_eof()

    async def drain(self) -> None:
        """Returns once the transport's buffer is below its high-water mark; ConnectionResetError if the
        connection was lost."""
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._paused_writing:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    # the connection ---------------------------------------------------------------------------------
    def get_extra_info(self, name: str, default=None):
        return self.transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        """Close without waiting for unsent bytes to go."""
        self.transport.abort()

    def _handler_done(self, task: asyncio.Task) -> None:
        """A connection's handler catches what a peer can cause; anything else is logged in one line (no
        traceback: every role's log stays readable) and the connection closed."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("data-plane connection handler failed: %r", task.exception())
        self.transport.close()


def unfilled(size: int) -> memoryview:
    """A writable buffer of `size` bytes, not zeroed first: for a frame that is written whole before it is
    read (`bytearray(size)` writes every byte, 0.17 ms of one core per 3 MB)."""
    return memoryview(numpy.empty(size, dtype=numpy.uint8))


async def open_stream(host: str, port: int) -> Stream:
    """A connection to `host`:`port`."""
    _, stream = await asyncio.get_running_loop().create_connection(Stream, host, port)
    return stream


async def serve_streams(handler: Callable[[Stream], Awaitable[None]], host: str, port: int) -> asyncio.Server:
    """Listen on `host`:`port` (0: any free port); `handler` runs in a task of its own per connection."""
    return await asyncio.get_running_loop().create_server(lambda: Stream(handler), host, port)
