"""Who a stage replica believes is a replica of its stage: who may be named in a close, or send it
gradient sums, and be counted (runtime/server/stage_steps.py).

`LiveReplicas` is the stage's live replicas as the DHT last showed them (the server refreshes it off
the event loop). `StageMembers` adds the peers the view lacks that answer a stage ping as a replica
of this stage (`verify`): a replica that joined, or a view that expired while this replica was
frozen, is then believed without waiting for a DHT refresh. A peer that did not answer is not pinged
again for `REFUTED_KEEP_S`, and only a few per close are pinged, so forged names cost little.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from collections.abc import Set as AbstractSet

from swarmtrain.net.dht_records import RunRecords
from swarmtrain.utils.awake_clock import awake_clock
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

Verify = Callable[[str], Awaitable[bool]]  # does this peer answer a ping as a replica of this stage?
MAX_VERIFIED_PER_CLOSE = 4  # unknown members of one close pinged (an honest close names a new one or two)
REFUTED_KEEP_S = 10.0  # a peer that failed a stage ping is not pinged again for this long
MAX_REFUTED = 1024


class LiveReplicas:
    """The stage's live replicas (this run's config digest) as the DHT last showed them, and peers that
    answered a stage ping since; the server refreshes it off the event loop (`update`), the step
    coordinator reads it per message. A peer stays `keep_s` after it was last seen, so one failed or
    partial DHT read drops nobody. `clock`: what those seconds are counted on, by default one that stands
    still while the process is stopped (utils/awake_clock.py), so a replica that wakes from a freeze
    still has the peers it saw just before it, and asks them."""

    def __init__(self, keep_s: float, clock: Callable[[], float] | None = None) -> None:
        self.keep_s, self._clock = keep_s, clock or awake_clock()
        self._seen: dict[str, float] = {}

    def update(self, peers: Iterable[str], now_s: float | None = None) -> None:
        now_s = self._clock() if now_s is None else now_s
        for peer in peers:
            self._seen[peer] = now_s
        self._seen = {p: t for p, t in self._seen.items() if now_s - t <= self.keep_s}

    def current(self, now_s: float | None = None) -> frozenset[str]:
        now_s = self._clock() if now_s is None else now_s
        return frozenset(p for p, t in self._seen.items() if now_s - t <= self.keep_s)


def read_live_replicas(records: RunRecords, stage: int, digest: str) -> set[str]:
    """(blocking: DHT reads) The stage's replicas with our digest: announced (joining or online) or
    publishing progress (a draining replica still exchanges the steps it holds samples of)."""
    peers = {p for p, a in records.stage_peers(stage).items() if a.config_digest == digest}
    peers |= {p for p, v in records.stage_progress(stage).items() if v.get("digest") == digest}
    return peers


async def keep_live_replicas_fresh(view: LiveReplicas, read: Callable[[], set[str]], period_s: float) -> None:
    """Every `period_s`, `read()` (blocking) off the event loop into `view`; a failed read keeps the view."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period_s)
        try:
            view.update(await loop.run_in_executor(None, read))
        except Exception:  # keep the last view; a bug here must not stop the refreshes
            logger.exception("reading the stage's live replicas failed")


class StageMembers:
    def __init__(
        self, live_replicas: LiveReplicas | None, verify: Verify | None, on_change: Callable[[], None]
    ) -> None:
        """`live_replicas`: None when not checked (tests); `verify`: None when only the view counts;
        `on_change()`: after a check, whatever it found (waiting steps look again)."""
        self.live_replicas, self.verify, self.on_change = live_replicas, verify, on_change
        self._verifying: dict[str, asyncio.Task] = {}
        self._refuted: OrderedDict[str, float] = OrderedDict()  # peer -> when its stage ping failed

    def current(self) -> AbstractSet[str] | None:
        """The live replicas now (None: not checked)."""
        return None if self.live_replicas is None else self.live_replicas.current()

    def check_unknown(self, peers: list[str]) -> None:
        """Ping (`verify`) a few of `peers`, which the view lacks; one that answers as a replica of this
        stage joins the view at once."""
        if self.verify is None or self.live_replicas is None:
            return
        now_s = time.monotonic()
        for peer in peers[:MAX_VERIFIED_PER_CLOSE]:
            if peer in self._verifying or now_s - self._refuted.get(peer, -REFUTED_KEEP_S) < REFUTED_KEEP_S:
                continue
            self._verifying[peer] = asyncio.create_task(self._verify_one(peer))

    async def _verify_one(self, peer: str) -> None:
        assert self.verify is not None and self.live_replicas is not None  # checked by check_unknown
        try:
            replica = await self.verify(peer)
        except Exception as exc:  # a bug in the check must not stop the stage; the peer stays unknown
            logger.warning("checking whether %s is a replica of this stage failed: %r", peer[-8:], exc)
            replica = False
        finally:
            self._verifying.pop(peer, None)
        if replica:
            self.live_replicas.update([peer])
            self._refuted.pop(peer, None)
        else:
            logger.warning(
                "%s, named in a close, is not a live replica of this stage: closes naming it are "
                "not acted on",
                peer[-8:],
            )
            self._refuted[peer] = time.monotonic()
            self._refuted.move_to_end(peer)
            while len(self._refuted) > MAX_REFUTED:
                self._refuted.popitem(last=False)
        self.on_change()
