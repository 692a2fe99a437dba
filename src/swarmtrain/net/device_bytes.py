"""Wire bytes to and from a compute device: the only host work of a server's tensors is on bytes.

A server decodes what it receives and encodes what it sends on the device its stage computes on
(net/codec.py's arithmetic is device-generic torch), so the host copies payload bytes, not fp32 tensors:
an 8-bit boundary is a quarter of the fp32 bytes, and nothing per element runs on a host core.

On CUDA both directions go through page-locked staging buffers kept per thread and grown as needed
(pinning a new buffer per message cost a server 6-7% of its CPU), so a copy is a DMA:
- an upload copies the bytes into the staging buffer and starts the copy to the device without
  waiting; the buffer is reused only after an event recorded behind that copy has passed;
- a download copies into the staging buffer and waits for it (the bytes must exist before they are
  framed), then takes them as a Python `bytes`.
On CPU an upload is a zero-copy read-only view of the bytes and a download one copy.

`side_stream(device)`: on CUDA, a received message's copy and decoding run on a side stream of the
receiving thread, so they overlap the compute already queued on the device's current stream; that
stream then waits for them (work queued after, the request's own forward included, sees the decoded
values), and the decoded tensor is marked used there, so the caching allocator does not hand its memory
to the side stream while a kernel of the current stream may still read it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

_staging = threading.local()  # per thread: {(direction, device): (pinned uint8 buffer, its last event)}


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
    buffer, event = _buffer("up", device, host.numel())
    event.synchronize()  # the previous upload from this buffer has left it
    buffer[: host.numel()].copy_(host)
    out = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    out.copy_(buffer[: host.numel()], non_blocking=True)
    event.record()
    return out


def download(payload: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor on any device."""
    if payload.numel() == 0:
        return b""
    if payload.device.type == "cpu":
        return payload.contiguous().numpy().tobytes()
    if payload.device.type != "cuda":
        return payload.cpu().numpy().tobytes()
    buffer, event = _buffer("down", payload.device, payload.numel())
    staged = buffer[: payload.numel()]
    staged.copy_(payload, non_blocking=True)
    event.record()
    event.synchronize()
    return staged.numpy().tobytes()


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


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _side(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_staging, "streams", None)
    if streams is None:
        streams = _staging.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _buffer(direction: str, device: torch.device, size: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    """This thread's pinned staging buffer of at least `size` bytes for `direction` and `device`."""
    buffers = getattr(_staging, "buffers", None)
    if buffers is None:
        buffers = _staging.buffers = {}
    key = (direction, device)
    held = buffers.get(key)
    if held is None or held[0].numel() < size:
        if held is not None:
            held[1].synchronize()  # a copy may still read the old buffer
        capacity = max(size, 2 * held[0].numel() if held is not None else 0)
        with torch.cuda.device(device):
            held = (torch.empty(capacity, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
        buffers[key] = held
    return held
