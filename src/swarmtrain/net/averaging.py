"""Stage state sharing and download on top of hivemind's `DecentralizedAverager`.

A step's gradients are exchanged directly between a stage's replicas (runtime/server/stage_steps.py says
why hivemind's matchmaking is too slow for that); hivemind's averager serves the stage state
(parameters + optimizer) to joining and lagging replicas, which download it with
`load_state_from_peers`. What this wrapper adds:
- the download is bounded (`load_state_from_peers` otherwise waits forever when the averager process
  is gone): a donor that goes silent is abandoned for the next within a chunk timeout (hivemind's own
  download waits without a bound for a cut-off donor to open its stream), one that keeps sending but
  too slowly at its deadline, which follows the state's size (planner/download_deadline.py), and at
  most the rule's number of donors is tried; failures come back as values, not exceptions;
- the state shared with joining peers comes from a callback of the owner (parameters + optimizer),
  and SIGINT is restored after start (hivemind sets it to ignored in the parent);
- in a private run (`members_keys`), hivemind's averaging RPCs answer only peers that have a record
  under one of those DHT keys: records are signed with the run key (net/auth.py), and hivemind's
  own messages carry no token of ours;
- its periodic declaration of the state for download awaits each DHT store's outcome: hivemind leaves
  a timed-out store's task unretrieved, and asyncio would print a "Task exception was never retrieved"
  traceback for each (dozens per server log while stage peers are frozen);
- while the owner's stage idles (`idle_slack_s`, set by the owner from its activity), a declaration lives
  and is renewed on the idle pace of the other records (planner/idle_pace.py), and never expires
  before the last one (the DHT would refuse a change of priority until the idle one lapsed); the first
  one, if refused, goes once more outlasting any a previous life of the peer can have made;
- a declaration is not stored again at every step, whose priority rises with each
  (planner/donor_declarations.py: at most once a second for a rise, at once for a fall).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import multiprocessing as mp
import random
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import AsyncIterator  # noqa: UP035 (hivemind's ServicerBase only recognizes typing's alias)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from swarmtrain.net.dht_records import live_subkeys
from swarmtrain.net.engine import restore_sigint
from swarmtrain.planner.donor_declarations import declaration_wait_s
from swarmtrain.planner.download_deadline import REPORT_SLACK_S
from swarmtrain.planner.idle_pace import outlasting_expiration, store_expiration, stored_ttl_s
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

StateProvider = Callable[[], tuple[dict, Sequence[torch.Tensor]]]
STATE_CHUNK_TIMEOUT_S = 15.0
# the DHT read of who shares the state: a few of hivemind's 3 s DHT request timeouts (nodes frozen or cut
# off hold a read that long)
DONORS_READ_TIMEOUT_S = 15.0
MEMBERS_REFRESH_S = 1.0  # at most one DHT read per second for unknown peers (a stranger's flood)


class StageAverager(DecentralizedAverager):
    """Shares one stage's state with its other replicas (its own tensors are never averaged)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        state_provider: StateProvider,
        min_matchmaking_time_s: float = 1.0,
        request_timeout_s: float = 0.5,
        allreduce_timeout_s: float = 30.0,
        declare_state_period_s: float = 5.0,
        members_keys: Sequence[str] = (),
        part_delay_s: float = 0.0,
        **averager_kwargs,
    ) -> None:
        """`part_delay_s`: a pause after each part of the state this peer sends, a trickling donor for
        tests (production code never passes it)."""
        self._state_provider = state_provider
        self._part_delay_s = part_delay_s
        self._members_keys = tuple(members_keys)
        self._members: set[str] = set()
        self._members_read_s = float("-inf")
        self._idle_slack_s = mp.Value(ctypes.c_double, 0.0)  # shared with the averager's process
        options = dict(
            target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=min_matchmaking_time_s,
            request_timeout=request_timeout_s,
            allreduce_timeout=allreduce_timeout_s,
            # a state download's chunks: a donor busy at a CPU quota takes over 2 s to send its first
            # one (it snapshots the state on its compute thread), and a shorter timeout gives up on a
            # live donor (bench/rebalance_live.py, a 7-layer stage at 0.25 CPU)
            next_chunk_timeout=STATE_CHUNK_TIMEOUT_S,
            declare_state_period=declare_state_period_s,
            shutdown_timeout=3,
        )
        options.update(averager_kwargs)
        sigint = signal.getsignal(signal.SIGINT)  # the owner's (a replica's stop handler), kept
        super().__init__(
            # host copies: the averager runs in its own process and shares host memory only
            [t.detach().to("cpu", copy=True) for t in tensors],
            dht,
            start=True,
            prefix=prefix.replace(".", "_"),
            **options,
        )
        restore_sigint(sigint)

    @property
    def idle_slack_s(self) -> float:
        return float(self._idle_slack_s.value)

    @idle_slack_s.setter
    def idle_slack_s(self, value: float) -> None:
        self._idle_slack_s.value = max(0.0, float(value))

    # private runs: hivemind's RPCs (served in the averager's process) answer members only ------------
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._is_member(context, "join our averaging group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._is_member(context, "send an averaging part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_aggregate_part(stream, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._is_member(context, "download our state"):
            return  # no data: the downloader moves on to the next peer
        async for response in super().rpc_download_state(request, context):
            yield response
            if self._part_delay_s > 0:
                await asyncio.sleep(self._part_delay_s)

    async def _is_member(self, context, action: str) -> bool:
        if not self._members_keys:
            return True
        peer = context.remote_id.to_base58()
        now_s = time.monotonic()
        if peer not in self._members and now_s - self._members_read_s >= MEMBERS_REFRESH_S:
            self._members_read_s = now_s
            self._members = await self._read_members()
        if peer not in self._members:
            logger.warning("refused %s a request to %s: not a peer of this private run", peer, action)
        return peer in self._members

    async def _read_members(self) -> set[str]:
        members: set[str] = set()
        for key in self._members_keys:
            try:
                found = await self.dht.get(key, latest=True, return_future=True)
            except Exception as exc:  # a slow or dead DHT: refuse for now, the caller retries
                logger.warning("reading %s for members failed: %r", key, exc)
                continue
            members.update(live_subkeys(found))
        return members

    async def _declare_for_download_periodically(self) -> None:
        """(in the averager's process) Announce under the group's key whether (with which priority) this
        peer serves its state, as hivemind does, but paced (planner/donor_declarations.py): not a store
        per step. Each store after the first runs on its own (a slow DHT does not delay the next
        declaration) and its failure is logged in one line instead of left unretrieved."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        was_sharing, declared = self.allow_state_sharing, None
        while True:
            self._state_updated.clear()  # a change from here on (even during an awaited store) is seen next
            sharing, priority = self.allow_state_sharing, self.state_sharing_priority
            wait = functools.partial(
                declaration_wait_s, sharing=sharing, priority=priority, period_s=self.declare_state_period
            )
            now_s = get_dht_time()
            if wait(now_s, was_sharing=was_sharing, declared=declared) <= 0:
                period_s = stored_ttl_s(self.declare_state_period, self.idle_slack_s)
                expiration_time = store_expiration(now_s, period_s, None if declared is None else declared[2])
                value = priority if sharing else None
                if declared is None:
                    expiration_time = await self._declare_first(key, value, expiration_time)
                else:
                    task = asyncio.create_task(self._declare(key, value, expiration_time))
                    task.add_done_callback(_report_declaration)
                was_sharing, declared = sharing, (priority, now_s, expiration_time)
            remaining_s = wait(get_dht_time(), was_sharing=was_sharing, declared=declared)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(remaining_s, 0.01))

    async def _declare(self, key: str, value: float | None, expiration_time: float) -> bool:
        store = self.dht.store(
            key,
            subkey=self.peer_id.to_bytes(),
            value=value,
            expiration_time=expiration_time,
            return_future=True,
        )
        return await asyncio.wait_for(store, timeout=self.declare_state_period)

    async def _declare_first(self, key: str, value: float | None, expiration_time: float) -> float:
        """This process's first declaration, awaited: when the DHT answers False (a previous life of this
        peer, restarted with its identity, declared until later on the idle pace, or no node answered),
        once more, outlasting any declaration that life can have made. Returns its expiration."""
        try:
            if not await self._declare(key, value, expiration_time):
                expiration_time = outlasting_expiration(get_dht_time(), self.declare_state_period)
                await self._declare(key, value, expiration_time)
        except Exception as exc:  # a slow or dead DHT: the next declaration comes in its period
            logger.info("declaring the stage state for download failed: %r", exc)
        return expiration_time

    # state download (in the averager's process) -------------------------------------------------------
    async def _load_state_from_peers(
        self, future: MPFuture, timeout: float | None = None, max_donors: int = 1
    ) -> None:
        """The stage state from at most `max_donors` donors, highest sharing priority first, each given
        up to `timeout` s (its deadline for the whole state), all within `max_donors * timeout`. hivemind's
        own version waits without a bound for a donor to open the download stream (a donor whose link is
        cut holds the joiner until libp2p gives up), bounds only the silence between parts (a donor that
        trickles holds a joiner for as long as it likes) and reads the donors with a blocking DHT call
        on this event loop. Here a donor that does not open the stream, or send its next part, within
        `next_chunk_timeout` is abandoned for the next one, and so is one that has not delivered the
        whole state by its deadline."""
        started_s = time.monotonic()
        total_s = None if timeout is None else max_donors * timeout
        try:
            await asyncio.wait_for(self._load_from_donors(future, timeout, max_donors), timeout=total_s)
        except Exception as exc:  # a dead DHT or daemon, or the whole deadline: no state, the caller retries
            logger.info("state download failed after %.1f s: %r", time.monotonic() - started_s, exc)
        finally:
            if not future.done():
                future.set_result(None)

    async def _load_from_donors(self, future: MPFuture, donor_s: float | None, max_donors: int) -> None:
        for peer in (await self._donors())[:max_donors]:
            try:
                loaded = await asyncio.wait_for(self._download_from(peer), timeout=donor_s)
            except TimeoutError:
                logger.info("state download from %s cut at its deadline of %.1f s", peer, donor_s)
                continue
            if loaded is not None:
                future.set_result(loaded)
                return

    async def _donors(self) -> list[PeerID]:
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = await asyncio.wait_for(
            self.dht.get(key, latest=True, return_future=True), timeout=DONORS_READ_TIMEOUT_S
        )
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        priority = {
            PeerID(subkey): (float(entry.value), random.random())  # random: ties in any order
            for subkey, entry in declared.items()
            if isinstance(subkey, bytes)
            and isinstance(entry, ValueWithExpiration)
            and isinstance(entry.value, int | float)
            and not isinstance(entry.value, bool)
        }
        donors = sorted((peer for peer in priority if peer != self.peer_id), key=priority.get, reverse=True)
        # which donors a download saw declared, in the order it tries them: a donor never tried is told
        # apart from one tried and cut (the state-download e2e test once saw only one of its two donors)
        log_repeated(  # a joiner that finds none asks again twice a second: one line every few seconds
            logger,
            logging.INFO,
            "state download: %d donor(s) declared: %s",
            len(donors),
            ", ".join(f"{p.to_base58()[-8:]} ({priority[p][0]:g})" for p in donors) or "none",
            key="donors",
        )
        return donors

    async def _download_from(self, peer: PeerID) -> tuple[dict, list[torch.Tensor]] | None:
        """The donor's (metadata, tensors), or None if it shares none or went silent."""
        silence_s, started_s = self.next_chunk_timeout, time.monotonic()
        metadata, tensors, parts = None, [], []
        try:
            stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await asyncio.wait_for(
                stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout=silence_s
            )
            async for message in aiter_with_timeout(stream, timeout=silence_s):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a part with a dtype starts the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        except Exception as exc:
            logger.info(
                "state download from %s abandoned after %.1f s: %r", peer, time.monotonic() - started_s, exc
            )
            return None
        return (metadata, tensors) if metadata else None

    # state sharing (called in this process by hivemind's background thread) ----------------------
    def get_current_state(self):
        metadata, tensors = self._state_provider()
        return metadata, list(tensors), None

    def download_state(
        self, donor_deadline_s: float, max_donors: int
    ) -> tuple[dict, list[torch.Tensor]] | None:
        """Parameters and optimizer state from the stage peer with the highest sharing priority that
        delivers them within `donor_deadline_s` (planner/download_deadline.py), trying at most
        `max_donors`; None when none did."""
        try:
            future = MPFuture()
            # hivemind's `load_state_from_peers` forwards only a timeout to the averager's process
            options = dict(timeout=donor_deadline_s, future=future, max_donors=max_donors)
            self._outer_pipe.send(("_load_state_from_peers", [], options))
            loaded = future.result(timeout=max_donors * donor_deadline_s + REPORT_SLACK_S)
        except Exception as exc:
            logger.warning("state download failed: %r", exc)
            return None
        if loaded is None:
            return None
        metadata, tensors = loaded
        return (metadata if isinstance(metadata, dict) else {}), list(tensors)


def _report_declaration(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()  # retrieved: asyncio prints no traceback for it
    if exc is not None:
        logger.info("declaring the stage state for download failed: %r", exc)
