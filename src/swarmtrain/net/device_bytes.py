"""Wire bytes to and from a compute device: the only host work of a server's tensors is on bytes.

A server decodes what it receives and encodes what it sends on the device its stage computes on
(net/codec.py's arithmetic is device-generic torch), so the host copies payload bytes, not fp32 tensors:
an 8-bit boundary is a quarter of the fp32 bytes, and nothing per element runs on a host core.

On CUDA both directions go through page-locked staging buffers (pinning a new buffer per message cost a
server 6-7% of its CPU), so a copy is a DMA:
- an upload copies the bytes into this thread's staging buffer and starts the copy to the device without
  waiting; the buffer is reused only after an event recorded behind that copy has passed;
- a download (`start_download`) starts the copy into a buffer lent by the device's `StagingPool` and
  records an event behind it, without waiting; `Download.result()` waits for that event (that copy
  alone, not the whole device), takes the bytes as a Python `bytes` and only then gives the buffer back,
  so no copy ever writes into a buffer whose bytes are still to be read. `download` is both at once.
On CPU an upload is a zero-copy read-only view of the bytes and a download one copy.

The two halves of the overlap with compute, on CUDA:
- receiving, `side_stream(device)`: a received message's copy and decoding run on a side stream of the
  receiving thread, so they overlap the compute already queued on the device's current stream; that
  stream then waits for them (work queued after, the request's own forward included, sees the decoded
  values), and the decoded tensor is marked used there, so the caching allocator does not hand its memory
  to the side stream while a kernel of the current stream may still read it;
- sending, `behind_current(tensor)`: a result is encoded and its payload copied to the host on a side
  stream of the computing thread, after an event recorded on its current stream (the result's own
  computation included); the current stream does not wait for them, so the next job's compute overlaps
  the encoding and the copy. The result is marked used on the side stream, so its memory is not handed to
  the next job's compute before the side stream has read it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

_staging = threading.local()  # per thread: {device: (pinned uint8 upload buffer, its last event)}, streams
_pools: dict[torch.device, StagingPool] = {}  # download buffers per device, shared by every thread
_pools_lock = threading.Lock()


def host_view(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """A read-only uint8 view of `payload` (no copy): callers must not write into it."""
    if len(payload) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; every caller copies or computes a new tensor
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def upload(payload: bytes | bytearray | memoryview, device: torch.device | None) -> torch.Tensor:
    """`payload` as a uint8 tensor on `device` (None or CPU: a read-only view of the host bytes)."""
    host = host_view(payload)
    if device is None or device.type == "cpu" or host.numel() == 0:
        return host
    if device.type != "cuda":
        return host.to(device)
    buffer, event = _upload_buffer(device, host.numel())
    event.synchronize()  # the previous upload from this buffer has left it
    buffer[: host.numel()].copy_(host)
    out = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    out.copy_(buffer[: host.numel()], non_blocking=True)
    event.record(copy_stream(out.device))
    return out


def download(payload: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor on any device (on CUDA: waits for the copy)."""
    if payload.numel() == 0:
        return b""
    if payload.device.type == "cpu":
        return payload.contiguous().numpy().tobytes()
    if payload.device.type != "cuda":
        return payload.cpu().numpy().tobytes()
    return start_download(payload).result()


class Download:
    """A payload's bytes on their way to the host: the copy into a pinned `buffer` lent by `pool`, and
    the `event` recorded behind it. `result()` waits for that event, reads the bytes and gives the buffer
    back (once: later calls return the same bytes). One thread calls `result()`. A download dropped
    unread (a batch that failed after making some of its replies, a reply never finished) gives its
    buffer back when it is collected (`StagingPool.drop`), so none stays counted as lent."""

    def __init__(self, pool: StagingPool, buffer: Any, event: Any, size: int) -> None:
        self._pool, self._buffer, self._event, self._size = pool, buffer, event, size
        self._bytes: bytes | None = None
        self._unread = weakref.finalize(self, pool.drop, buffer, event)
        self._unread.atexit = False  # at exit nothing is lent any more, and CUDA may be gone

    def done(self) -> bool:
        """Whether `result()` would return without waiting (the copy has run, or the bytes were read)."""
        return self._bytes is not None or bool(self._event.query())

    def result(self) -> bytes:
        if self._bytes is None:
            self._event.synchronize()  # this copy alone: the compute queued since goes on
            self._bytes = self._buffer[: self._size].numpy().tobytes()
            self._unread.detach()
            self._pool.give_back(self._buffer, self._event)  # read: a later copy may write into it
            self._buffer = self._event = None
        return self._bytes


def start_download(payload: torch.Tensor) -> Download:
    """Start copying a uint8 CUDA tensor's bytes to the host on the current stream, behind the work queued
    there (what computes `payload` included); nothing waits until `result()`."""
    size = payload.numel()
    pool = _pool(payload.device)
    buffer, event = pool.lend(size)
    buffer[:size].copy_(payload, non_blocking=True)
    event.record(copy_stream(payload.device))
    return Download(pool, buffer, event, size)


def copy_stream(device: torch.device):
    """The stream a copy to or from `device`'s memory was just queued on: that device's current stream,
    which an event must be recorded on to follow the copy (this thread's current device may be another:
    a server on cuda:1 sets none, and an event recorded there would not follow it)."""
    return torch.cuda.current_stream(device)


class StagingPool:
    """Pinned host buffers for downloads, each with the event of its last copy, lent to one download at a
    time: a buffer comes back (`give_back`) only once its bytes were read, so two copies pending at once
    (a reply still being read while the next job's is started) never share one. Buffers are reused, grown
    as needed, never pinned anew per message; at most `keep` idle ones are held, a surplus one is let go
    (torch's pinned-memory cache takes it back, once the copies recorded on it have run). `new_buffer(size)`
    and `new_event()` make them (tests give fakes)."""

    def __init__(self, new_buffer: Callable[[int], Any], new_event: Callable[[], Any], keep: int = 4) -> None:
        self._new_buffer, self._new_event, self.keep = new_buffer, new_event, keep
        self._idle: list[tuple[Any, Any]] = []  # (buffer, event), every copy from or into them done
        self._lock = threading.Lock()
        self._lent = 0
        # buffers of downloads dropped unread; a queue, not the lock: `drop` runs in a finalizer, which
        # may interrupt this pool's own thread while it holds the lock (SimpleQueue.put is reentrant)
        self._dropped: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()

    @property
    def lent(self) -> int:
        """Buffers out now."""
        with self._lock:
            self._settle()
            return self._lent

    def lend(self, size: int) -> tuple[Any, Any]:
        """An idle buffer of at least `size` bytes (the smallest that fits) and its event, or a new one
        (twice the largest idle one when that one is too small: a growing message grows it a few times)."""
        with self._lock:
            self._settle()
            self._lent += 1
            by_size = sorted(range(len(self._idle)), key=lambda i: self._idle[i][0].numel())
            fitting = [i for i in by_size if self._idle[i][0].numel() >= size]
            if fitting:
                return self._idle.pop(fitting[0])
            # none fits: the largest is let go (its copies have all run) for one twice its size
            largest = self._idle.pop(by_size[-1])[0].numel() if by_size else 0
        return self._new_buffer(max(size, 2 * largest)), self._new_event()

    def give_back(self, buffer: Any, event: Any) -> None:
        """A lent buffer whose bytes were read (and whose copy therefore ran)."""
        with self._lock:
            self._settle()
            self._lent -= 1
            if len(self._idle) < self.keep:
                self._idle.append((buffer, event))

    def drop(self, buffer: Any, event: Any) -> None:
        """A lent buffer whose bytes will never be read (its download was dropped): no longer lent; idle
        again if its copy has run, else let go. Safe from a finalizer: settled by the pool's next call."""
        self._dropped.put((buffer, event))

    def _settle(self) -> None:
        """Take the dropped buffers back (the lock held)."""
        while not self._dropped.empty():
            buffer, event = self._dropped.get()
            self._lent -= 1
            if event.query() and len(self._idle) < self.keep:  # never one a pending copy still writes
                self._idle.append((buffer, event))


@contextlib.contextmanager
def side_stream(device: torch.device | None) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Run the enclosed copies and kernels on this thread's side stream of a CUDA `device` (elsewhere:
    in place); yields `hand_over(tensor)`, which makes a tensor made there safe to use on the current
    stream."""
    if device is None or device.type != "cuda":
        yield _as_is
        return
    current = torch.cuda.current_stream(device)
    side = _side(device)

    def hand_over(tensor: torch.Tensor) -> torch.Tensor:
        tensor.record_stream(current)
        return tensor

    with torch.cuda.stream(side):
        yield hand_over
    current.wait_stream(side)


@contextlib.contextmanager
def behind_current(tensor: torch.Tensor) -> Iterator[None]:
    """Run the enclosed work on this thread's side stream of `tensor`'s CUDA device, after everything
    queued on the current stream so far, without making the current stream wait for it (elsewhere: in
    place). `tensor` must not be written to afterwards; it is marked used on the side stream, so the
    caching allocator keeps its memory from the current stream's later work until the side stream has
    read it, whenever its last reference goes."""
    if tensor.device.type != "cuda":
        yield
        return
    side = _side(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))  # an event on the current stream
    tensor.record_stream(side)
    with torch.cuda.stream(side):
        yield


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def device_key(device: torch.device) -> torch.device:
    """`device` as the per-device maps here key it: a CUDA device without an index is the current one
    (`cuda` and `cuda:0` are one device, and its tensors say `cuda:0`); any other device as it is."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _side(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_staging, "streams", None)
    if streams is None:
        streams = _staging.streams = {}
    key = device_key(device)
    if key not in streams:
        streams[key] = torch.cuda.Stream(key)
    return streams[key]


def _pool(device: torch.device) -> StagingPool:
    key = device_key(device)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = StagingPool(lambda size: _pinned(key, size), torch.cuda.Event)
        return _pools[key]


def _pinned(device: torch.device, size: int) -> torch.Tensor:
    with torch.cuda.device(device):
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _upload_buffer(device: torch.device, size: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    """This thread's pinned upload staging buffer of at least `size` bytes for `device`."""
    buffers = getattr(_staging, "buffers", None)
    if buffers is None:
        buffers = _staging.buffers = {}
    device = device_key(device)
    held = buffers.get(device)
    if held is None or held[0].numel() < size:
        if held is not None:
            held[1].synchronize()  # a copy may still read the old buffer
        capacity = max(size, 2 * held[0].numel() if held is not None else 0)
        held = (_pinned(device, capacity), torch.cuda.Event())
        buffers[device] = held
    return held
