"""Calls over a peer's direct data plane first (net/data_plane.py), over libp2p otherwise.

Who calls this way: a stage server handing a micro-batch to the next stage (runtime/server/hop_uploads.py)
and a trainer sending a micro-batch's chain to its first stage (runtime/trainer). Over libp2p each call
is a yamux stream through both peers' `p2pd` daemons (a Unix socket, the Go daemon, TCP, the other
daemon, another Unix socket), and each side's Python parses the stream's protobuf chunks; over the data
plane it is one sealed frame each way on a TCP connection the two processes hold themselves (docs/LOG.md,
"The trainer's chains over the data plane").

A trainer's call goes over libp2p when the message is not a chain (`CHAIN_KINDS`: pings, closes, `info`,
relayed forwards and backwards and the averaging messages stay on libp2p), when the peer announces no data plane (a
server behind a NAT, or started with `--no-data-plane`), when a dial to it failed (nothing was sent, and
the address rests for `DIAL_COOLDOWN_S`), and when this caller already has `MAX_DIRECT_PER_PEER` calls
under way on the peer's link (the server answers more than `MAX_REQUESTS_PER_LINK` with `unavailable`;
a cancelled call stops counting here before the server has answered it, so this keeps a trainer well
under that limit rather than at it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from swarmtrain.net.data_plane import MAX_REQUESTS_PER_LINK, Address, DataPlaneClient, DialFailed
from swarmtrain.net.protocol import DIRECT_KINDS, Message
from swarmtrain.net.transport import StageClient
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

MAX_DIRECT_PER_PEER = MAX_REQUESTS_PER_LINK // 2  # calls under way on one link; more go over libp2p
# what a trainer sends over the data plane: its chains (token ids, labels, a route). Its relayed calls
# (`--hand-off relay`, a boundary between NAT'd stages) stay on libp2p, as before
CHAIN_KINDS = frozenset({"chain", "evaluate_chain"})


async def direct_first(
    data: DataPlaneClient | None,
    address: Address | None,
    libp2p: StageClient,
    peer: str,
    message: Message,
    timeout_s: float,
    received: asyncio.Event | None = None,
) -> Message:
    """`message`'s reply from `peer`: over its data plane at `address` when there is one, else (or when
    the dial fails: nothing was sent) over libp2p within what is left of `timeout_s`. Raises what
    `StageClient.call` raises; `received` is set once the peer holds the whole request."""
    if data is not None and address is not None:
        deadline_s = time.monotonic() + timeout_s
        try:
            return await data.call(address, peer, message, timeout_s, received)
        except DialFailed as exc:
            log_repeated(  # every call to that peer tries its data plane first
                logger, logging.INFO, "calls to %s over libp2p for now: %s", peer[-8:], exc, key=peer
            )
        timeout_s = deadline_s - time.monotonic()
    return await libp2p.call(peer, message, timeout_s, received)


class DirectFirstClient:
    """A `StageClient` whose calls of `kinds` (some of the data plane's) go over the peer's data plane
    where `address_of(peer)` names one (`data` None: libp2p only). Pings and connections are libp2p's."""

    def __init__(
        self,
        libp2p: StageClient,
        data: DataPlaneClient | None,
        address_of: Callable[[str], Address | None],
        kinds: frozenset[str] = CHAIN_KINDS,
    ) -> None:
        unknown = kinds - set(DIRECT_KINDS)
        if unknown:
            raise ValueError(f"the data plane takes no {sorted(unknown)}")
        self.libp2p, self.data, self.address_of, self.kinds = libp2p, data, address_of, kinds
        self.stats = libp2p.stats  # `data` counts its calls there too
        self.direct_calls = 0  # calls tried on a data plane first (tests)
        self._under_way: dict[str, int] = {}  # per peer, calls under way on its data plane

    async def call(
        self, peer: str, message: Message, timeout_s: float, received: asyncio.Event | None = None
    ) -> Message:
        address = self._direct_address(peer, message.kind)
        if address is None:
            return await self.libp2p.call(peer, message, timeout_s, received)
        self._under_way[peer] = self._under_way.get(peer, 0) + 1
        self.direct_calls += 1
        try:
            return await direct_first(self.data, address, self.libp2p, peer, message, timeout_s, received)
        finally:
            self._under_way[peer] -= 1
            if not self._under_way[peer]:
                del self._under_way[peer]

    def _direct_address(self, peer: str, kind: str) -> Address | None:
        if self.data is None or kind not in self.kinds:
            return None
        if self._under_way.get(peer, 0) >= MAX_DIRECT_PER_PEER:
            return None
        return self.address_of(peer)

    async def connect(self, peer: str, addresses: list[str], timeout_s: float) -> bool:
        return await self.libp2p.connect(peer, addresses, timeout_s)

    async def answers_ping(self, peer: str, ping: Message, timeout_s: float) -> bool:
        return await self.libp2p.answers_ping(peer, ping, timeout_s)

    def close(self) -> None:
        if self.data is not None:
            self.data.close()
