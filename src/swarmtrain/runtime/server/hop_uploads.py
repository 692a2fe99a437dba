"""A stage server's uploads to one peer of the next stage: one at a time, and with request batching on,
what queued meanwhile goes as one `bundle` (net/bundle.py).

Each upload goes over the peer's direct data plane when it announces one (net/data_plane.py: requests
and their acknowledgements on one TCP connection, replies on another, so acknowledgements do not wait
behind bulk data), and over libp2p when it announces none or a dial to it failed (nothing was sent
then, so the fallback repeats nothing).

One at a time: the upload lane is held until the peer has the whole request (its ACK frame on the
data plane, the stream's first reply chunk over libp2p). Uploads sent together share the link fairly
and all arrive at the end, so the next stage computed nothing while the link was busy and the link idled while it computed; one at a time, it
computes one micro-batch while the next arrives.

Bundles: a batched call on this stage finishes several micro-batches at once, and their hand-offs to
the same peer go as one message after a short gathering pause (`GATHER_S`), then the ones that queued
during an upload go together as the next. Every caller still gets its own reply or exception, as if it
had called alone: a failed bundle fails each of its items with the same error, and each caller retries
(or not) by its own rules.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarmtrain.net.bundle import MAX_BUNDLE_ITEMS, bundle_message, split_bundle
from swarmtrain.net.data_plane import Address, DataPlaneClient
from swarmtrain.net.direct_first import direct_first
from swarmtrain.net.protocol import REPLY_KINDS, Message, ProtocolError
from swarmtrain.net.transport import RemoteError, StageClient
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# the outputs of one batched call reach the event loop within a few callbacks of each other; waiting
# this long for them costs far less than an RPC per micro-batch
GATHER_S = 0.002


@dataclass(frozen=True)
class DirectRoute:
    """The data plane, and where the peer's is now (None: it announces none)."""

    client: DataPlaneClient
    address: Callable[[], Address | None]


@dataclass(eq=False)
class _Upload:
    message: Message
    tokens: int
    deadline_s: float
    reply: asyncio.Future


class PeerUploads:
    """Hand-offs to `peer`, a server of stage `stage`. `max_tokens` > 0 bundles uploads up to that many
    tokens (the sender's `--max-batch-tokens`); 0 sends each alone."""

    def __init__(
        self, client: StageClient, peer: str, stage: int, max_tokens: int, direct: DirectRoute | None = None
    ) -> None:
        self.client, self.peer, self.stage, self.max_tokens = client, peer, stage, max_tokens
        self.direct = direct
        self.bundles = 0  # uploads that carried more than one message
        self._queue: list[_Upload] = []
        self._sender: asyncio.Task | None = None

    async def call(self, message: Message, tokens: int, timeout_s: float) -> Message:
        """`message`'s reply from the peer; raises what `StageClient.call` raises for it."""
        upload = _Upload(
            message, tokens, time.monotonic() + timeout_s, asyncio.get_running_loop().create_future()
        )
        self._queue.append(upload)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_queued())
        try:
            return await asyncio.wait_for(asyncio.shield(upload.reply), timeout_s)
        finally:
            if not upload.reply.done():
                upload.reply.cancel()  # timed out or cancelled: dropped if still queued

    async def _send_queued(self) -> None:
        while self._queue:
            if self.max_tokens > 0:
                await asyncio.sleep(GATHER_S)
            batch = self._take()
            if not batch:
                continue
            received = asyncio.Event()
            call = asyncio.ensure_future(self._exchange(batch, received))
            arrived = asyncio.ensure_future(received.wait())
            await asyncio.wait({call, arrived}, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()

    def _take(self) -> list[_Upload]:
        """The queued uploads for the next message, oldest first, within the token budget (one at least)."""
        waiting = [u for u in self._queue if not u.reply.done()]
        taken, tokens = [], 0
        for upload in waiting:
            if taken and (tokens + upload.tokens > self.max_tokens or len(taken) == MAX_BUNDLE_ITEMS):
                break
            taken.append(upload)
            tokens += upload.tokens
        self._queue = waiting[len(taken) :]
        return taken

    async def _exchange(self, batch: list[_Upload], received: asyncio.Event) -> None:
        timeout_s = max(u.deadline_s for u in batch) - time.monotonic()
        try:
            if len(batch) == 1:
                only = batch[0].message
                outcomes: list = [await self._call(only, timeout_s, received)]
            else:
                self.bundles += 1
                bundle = bundle_message([u.message for u in batch], self.stage)
                reply = await self._call(bundle, timeout_s, received)
                outcomes = _outcomes(reply, len(batch))
        except Exception as exc:  # each caller classifies the failure of its own micro-batch
            outcomes = [exc] * len(batch)
        finally:
            received.set()
        for upload, outcome in zip(batch, outcomes, strict=True):
            if upload.reply.done():
                continue
            if isinstance(outcome, BaseException):
                upload.reply.set_exception(outcome)
            else:
                upload.reply.set_result(outcome)

    async def _call(self, message: Message, timeout_s: float, received: asyncio.Event) -> Message:
        direct = self.direct
        data, address = (direct.client, direct.address()) if direct is not None else (None, None)
        return await direct_first(data, address, self.client, self.peer, message, timeout_s, received)


def _outcomes(reply: Message, count: int) -> list:
    """A bundle reply's answers in order: a message, or the RemoteError its error answer means."""
    items = split_bundle(reply, REPLY_KINDS)
    if len(items) != count:
        raise ProtocolError(f"a bundle of {count} was answered with {len(items)} replies")
    return [
        RemoteError(str(i.header.get("code", "error")), str(i.header.get("error", "")))
        if i.kind == "error"
        else i
        for i in items
    ]
