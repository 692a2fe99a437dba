"""The kernel's side of the data plane's TCP connections (Linux; elsewhere each reads as unknown or
leaves the system's default): which congestion control a socket uses, and what the link meter
(net/link_meter.py) asks of a socket, the bytes it sent that the peer has not acknowledged yet and
when the kernel last saw data or an acknowledgement arrive. Its users: net/data_plane.py (congestion
control) and net/framing.py (the timing of large frames).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time

from swarmtrain.net.stream import Stream
from swarmtrain.utils.logging import get_logger

# the data plane's lines: one logger name to read or filter a server's data-plane logs by
logger = get_logger("swarmtrain.net.data_plane")

# loss-based congestion control on the data plane's sockets, where the system permits it (else its
# default): with both directions of a link busy, as a swarm keeps them, acknowledgements wait behind
# the peer's own upload, and BBR (v1), which caps its window at twice the bandwidth x its minimum
# round trip, stalls for them; on the test bed at 10 Mbit/s direct 8-bit does 26.6 samples/s with BBR,
# 27.5 with cubic (docs/LOG.md). cubic is Linux's usual default anyway
DEFAULT_CONGESTION = "cubic"
# Linux's struct tcp_info: eight one-byte fields, then 32-bit ones; milliseconds since the last data
# segment came, and since the last acknowledgement came, are the 12th and 13th of those
_TCP_INFO_BYTES = 104
LAST_DATA_RECV, LAST_ACK_RECV = 8 + 11 * 4, 8 + 12 * 4

_refused_congestion: set[str] = set()  # algorithms the system would not give us (logged once each)


def unacknowledged_bytes(stream: Stream) -> int:
    """Bytes written to `stream` that its peer has not acknowledged yet: asyncio's buffer plus the
    socket's send queue (Linux's TIOCOUTQ: unsent and unacknowledged). Where the system cannot tell,
    the send queue reads as empty, and an upload's time ends when the kernel took its last byte."""
    pending = stream.transport.get_write_buffer_size()
    sock = stream.get_extra_info("socket")
    if sock is None:
        return pending
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile, or not a TCP socket
        return pending
    return pending + struct.unpack("i", raw)[0]


def kernel_time_s(stream: Stream, field_offset: int) -> float | None:
    """When (time.monotonic) the kernel last saw what a TCP_INFO field of `field_offset` counts the
    milliseconds since (`LAST_DATA_RECV`, `LAST_ACK_RECV`); None where the system cannot tell."""
    sock = stream.get_extra_info("socket")
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


def set_congestion_control(stream: Stream, name: str | None) -> None:
    """Use TCP congestion control `name` on the connection (None: the system's default); where the
    system does not permit it (not loaded, or not in net.ipv4.tcp_allowed_congestion_control for an
    unprivileged process), the default stays."""
    option = getattr(socket, "TCP_CONGESTION", None)
    sock = stream.get_extra_info("socket")
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
