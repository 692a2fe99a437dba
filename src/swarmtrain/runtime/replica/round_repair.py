"""Repairing a partial outer round from a group member's mean, instead of a state download.

hivemind's all-reduce keeps a part of a member's vector local, silently, when the results of that
part's reducer never arrive (a stream broken or timed out under load): that member ends the round
unlike the others. Downloading the whole replica state (anchor, outer momentum, AdamW moments: 5x the
model in fp32, 3.8 MB on `tiny`, about 16 rounds' 8-bit payload) would be the only repair, and a few of
them cut the replicas' saving over every-step averaging by a factor of 3 (docs/LOG.md).

Here every replica keeps the means of its last rounds and serves them (message kind `round_mean`), and a
member whose round came back partial asks the group's other members for that round's mean and fills
only the values that stayed local. The reducer of a part holds its mean, so in a group of two the other
member fills every gap; the member then applies the same round as the others, at the cost of one mean
in the run's codec (one round's payload) and a bit per value saying where the answering member's mean
is only its own value (a reducer that gave up on a late sender; `fill_unaveraged`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from swarmtrain.config import RunConfig
from swarmtrain.net.auth import RunKey
from swarmtrain.net.engine import release_p2p_replica
from swarmtrain.net.outer_averaging import PARTIAL_FRACTION, fill_unaveraged, unaveraged_fraction
from swarmtrain.net.protocol import Message, error_message, make_message, namespace
from swarmtrain.net.transport import RemoteError, StageClient, StageServicer
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

KEPT_ROUNDS = 2  # a member may ask for round k while this replica is already in round k + 1
# the members of one all-reduce finish it within moments of each other; a longer wait lets the other
# replica take a whole round alone meanwhile, and the asker ends a round behind
REPAIR_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 5.0
RETRY_S = 0.2
MAX_REQUEST_BYTES = 64 * 1024


def replicas_namespace(cfg: RunConfig) -> str:
    return f"{namespace(cfg)}_replicas"


class RoundRepair:
    """Serves this replica's recent round means and fetches other members' to fill a partial round.
    Its RPC runs on an event loop thread of its own (the replica's main thread trains)."""

    def __init__(self, cfg: RunConfig, dht, codec: str, run_key: RunKey | None = None) -> None:
        self.codec = codec
        self.bytes_received = 0
        # round -> (its mean here, where that mean is this replica's own value: packed bits per tensor)
        self._means: OrderedDict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self._done_round = -1  # rounds up to this one are over here: a mean not kept now never will be
        self._lock = threading.Lock()
        self._dht = dht
        self._p2p = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="round-repair", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(self._setup(cfg, dht, run_key), CALL_TIMEOUT_S * 6)
        except BaseException:
            self.close()
            raise

    async def _setup(self, cfg: RunConfig, dht, run_key: RunKey | None) -> StageClient:
        p2p = self._p2p = await dht.replicate_p2p()
        servicer = StageServicer(self._handle, MAX_REQUEST_BYTES, run_key=run_key)
        await servicer.add_p2p_handlers(p2p, namespace=replicas_namespace(cfg))
        return StageClient(p2p, replicas_namespace(cfg), run_key=run_key)

    async def _release(self) -> None:
        if self._p2p is not None:
            await release_p2p_replica(self._dht, self._p2p)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def _run(self, coro, timeout_s: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:  # a P2P replica left open logged "Task was destroyed but it is pending!" at every exit
            self._run(self._release(), CALL_TIMEOUT_S)
        except Exception as exc:  # exit path: report, never raise
            logger.info("round repair: closing its p2p client failed: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    # serving ----------------------------------------------------------------------------------
    def offer(self, round_index: int, mean: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> None:
        """This replica's mean of `round_index` (the raw all-reduce result, later the repaired one) and
        what it `sent` to that round's all-reduce."""
        local = [_pack_bits(m == s) for m, s in zip(mean, sent, strict=True)]
        with self._lock:
            self._means[round_index] = ([t.detach().clone() for t in mean], local)
            self._means.move_to_end(round_index)
            while len(self._means) > KEPT_ROUNDS:
                self._means.popitem(last=False)

    def round_done(self, round_index: int) -> None:
        """This replica has left `round_index` (averaged, alone or resynced)."""
        self._done_round = max(self._done_round, round_index)

    async def _handle(self, message: Message, _context) -> Message:
        if message.kind != "round_mean":
            return error_message(f"a replica answers only round_mean, not {message.kind!r}", "bad_request")
        round_index = message.header.get("round")
        with self._lock:
            mean = self._means.get(round_index) if isinstance(round_index, int) else None
        if mean is None and isinstance(round_index, int) and round_index <= self._done_round:
            # its all-reduce failed here (it went on alone) or it resynced: asking again cannot help
            return error_message(f"no mean of outer round {round_index} here", "no_mean")
        if mean is None:
            return error_message(f"no mean of outer round {round_index!r} here yet", "unavailable")
        means, local = mean
        tensors = {str(i): t for i, t in enumerate(means)}
        tensors.update((f"local{i}", bits) for i, bits in enumerate(local))  # integers go uncompressed
        return make_message("result", {"round": round_index}, tensors, self.codec)

    # repairing --------------------------------------------------------------------------------
    def repair(
        self,
        round_index: int,
        sent: Sequence[torch.Tensor],
        averaged: Sequence[torch.Tensor],
        weights: dict[str, float],
        me: str,
    ) -> list[torch.Tensor] | None:
        """`averaged` with the values that stayed local (equal to what this member `sent`) filled from
        the other members' means of the round; None when they could not fill it within the timeout.
        `weights`: each member's weight in the round (the samples it contributed), `me` included."""
        deadline = time.monotonic() + REPAIR_TIMEOUT_S
        merged = list(averaged)
        for peer in (p for p in weights if p != me):
            fetched = self._fetch(peer, round_index, [t.shape for t in sent], deadline)
            if fetched is None:
                continue
            mean, local = fetched
            try:
                merged = fill_unaveraged(sent, merged, mean, local, (weights[me], weights[peer]))
            except ValueError as exc:
                logger.warning("outer round %d: mean from %s refused: %s", round_index, peer, exc)
                continue
            if unaveraged_fraction(sent, merged) < PARTIAL_FRACTION:
                return merged
        return None

    def _fetch(self, peer: str, round_index: int, shapes, deadline: float) -> list[torch.Tensor] | None:
        request = Message("round_mean", {"round": round_index})
        while (left_s := deadline - time.monotonic()) > 0:
            timeout_s = min(CALL_TIMEOUT_S, left_s)
            try:
                call = self._client.call(peer, request, timeout_s)
                reply = self._run(call, timeout_s + 1)
            except RemoteError as exc:
                if exc.code != "unavailable":
                    logger.info("round mean from %s refused: %s", peer, exc)
                    return None
                time.sleep(RETRY_S)  # the member is still finishing the round
                continue
            except Exception as exc:  # unreachable, timed out, cut short: try the next member
                logger.info("round mean from %s failed: %r", peer, exc)
                return None
            self.bytes_received += sum(len(t.payload) for t in reply.tensors.values())
            return _decoded(reply, shapes)
        return None


def _decoded(reply: Message, shapes) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The mean and where it is the answering member's own value (bool, per tensor); None when the reply
    does not fit our tensors."""
    try:
        tensors = [reply.tensor(str(i)) for i in range(len(shapes))]
        local = [_unpack_bits(reply.tensor(f"local{i}"), shape) for i, shape in enumerate(shapes)]
    except (KeyError, ValueError) as exc:
        logger.info("malformed round mean: %r", exc)
        return None
    if [t.shape for t in tensors] != list(shapes):
        logger.info("round mean of other shapes than ours")
        return None
    return [t.float() for t in tensors], local


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(mask.reshape(-1).numpy()))


def _unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of `_pack_bits` for a tensor of `shape`; ValueError for bits that do not fit it."""
    numel = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != -(-numel // 8):
        raise ValueError(f"{packed.numel()} packed bytes of {packed.dtype} for {numel} values")
    bits = np.unpackbits(packed.numpy(), count=numel)
    return torch.from_numpy(bits.astype(bool)).reshape(shape)
