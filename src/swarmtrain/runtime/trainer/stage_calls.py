"""One call to "some peer of stage s", with peer choice, timeouts, retries, bans and waiting.

Failure policy (docs/ARCHITECTURE.md; the table is net/failures.py; the loop that applies it is
runtime/trainer/call_policy.py's `run_call`, shared with the chains and the closes; peers are chosen and
their outcomes recorded through its `PeerChoice`):
- silent past its usual time and not answering a ping -> frozen: ban it until it announces itself
  again and hedge the call on another peer, first answer wins (runtime/trainer/hedging.py);
- timeout -> the peer is frozen (or far slower than its usual): retry on another peer and fold the
  timeout into its EMA. The timeout is the peer's own deadline (planner/deadlines.py: a multiple of its
  usual call time, 5 s at least, the request timeout at most); when that came before the request
  timeout, the peer is also banned until it announces itself again (`frozen_or`);
- connection error -> the peer is gone: ban it until its record expires or it re-announces;
- error answer -> `unavailable`/`timeout`/`internal`: try another peer; `digest_mismatch`: ban;
  `bad_request`/`too_large`/`version`: our request is wrong, retrying cannot help; `unauthorized`: a
  private run and we hold no (or another) run key;
- retries are bounded (`swarm.max_retries`) with exponential backoff; a backward whose micro-batch a
  later stage has already accumulated is `persistent`: it keeps trying (up to `PERSISTENT_ATTEMPTS`,
  waiting for live peers) because giving up would leave the stages disagreeing on the step's batch;
- `stale` (the peer already applied the step: it resynced past it) -> another peer; once every live
  peer of the stage answered `stale`, the stage applied the step without this micro-batch and no retry
  can help: it fails at once;
- a backward (or fused forward+backward) retried after a timeout, a cut-off reply or an internal error
  may already be accumulated by the silent peer, which may wake up and average it: the retry asks for
  the input gradient only (`accumulate=False`). A stage applies each micro-batch at most once; what the
  silent peer then drops is counted as lost, never doubled. A peer gone with a connection error took
  its accumulator with it: the retry still accumulates;
- any other exception is a bug, not a failure of the peer: it is raised;
- no live peer at all -> wait (not counted as a retry) with one clear log line every few seconds.
"""

from __future__ import annotations

import asyncio
import time

from swarmtrain.config import SwarmConfig
from swarmtrain.net.auth import RunKey
from swarmtrain.net.data_plane import DataPlaneClient
from swarmtrain.net.direct_first import DirectFirstClient
from swarmtrain.net.failures import FailureAction, flags_after, on_request_failure
from swarmtrain.net.identity import PeerIdentity
from swarmtrain.net.protocol import ACCUMULATING_KINDS, Message, ping_message, request_message
from swarmtrain.net.transport import StageClient
from swarmtrain.planner.deadlines import PING_TIMEOUT_FLOOR_S
from swarmtrain.runtime.trainer.call_policy import (
    PERSISTENT_ATTEMPTS,
    Attempt,
    CallStats,
    PeerChoice,
    frozen_or,
    run_call,
)
from swarmtrain.runtime.trainer.hedging import Copy, Hedger, Pair, SilentPastDeadline
from swarmtrain.runtime.trainer.peer_table import PeerTable
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)


def _accumulating_nothing(message: Message) -> Message:
    """A hedged copy of a micro-batch request: it must not accumulate what the silent original may."""
    if message.kind not in ACCUMULATING_KINDS:
        return message
    return Message(message.kind, {**message.header, "accumulate": False}, message.tensors)


def _service_s(elapsed_s: float, header: dict) -> float:
    """The call's round trip less the time the request waited on the peer for the previous step's
    parameters: a micro-batch sent early waits there whichever replica gets it, so that wait measures
    the step's pace, not the peer's speed (counted in, a forward's observed duration varied ~10x with
    when in the step it was sent)."""
    wait_s = header.get("step_wait_s")
    if isinstance(wait_s, (int, float)) and 0 <= wait_s < elapsed_s:
        return elapsed_s - float(wait_s)
    return elapsed_s


def direct_first_client(
    libp2p: StageClient, identity: PeerIdentity | None, run_key: RunKey | None, table: PeerTable
) -> DirectFirstClient:
    """The trainer's client: chains and evaluations go over their first peer's data plane where it
    announces one (net/direct_first.py), the other calls over libp2p; `identity` None (no key of ours to
    prove: a probe, or `--no-data-plane`): everything over libp2p."""
    data = DataPlaneClient(identity, run_key, libp2p.stats) if identity is not None else None
    return DirectFirstClient(libp2p, data, table.data_address)


class StageCaller:
    """The trainer's relayed calls, and what every call of the trainer shares: its counters (`stats`),
    its peer choice (`peers`), its hedging (`hedger`) and the DHT view they refresh."""

    def __init__(
        self,
        client: DirectFirstClient,
        table: PeerTable,
        swarm: SwarmConfig,
        digest: str,
        codec: str,
        stopping: asyncio.Event,
    ) -> None:
        self.client, self.table, self.swarm = client, table, swarm
        self.digest, self.codec, self.stopping = digest, codec, stopping
        self.stats = CallStats()
        self.peers = PeerChoice(table, swarm, stopping, self.refresh)
        self.hedger = Hedger(self.peers, self.stats, self.silent_peers)
        self._refresh_lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._refresh_lock:
            fetched = await asyncio.get_running_loop().run_in_executor(None, self.table.fetch)
            for peer in self.table.apply(fetched):
                stage = next(s for s, anns in enumerate(self.table.announcements) if peer in anns)
                addresses = self.table.announcements[stage][peer].addresses
                await self.client.connect(peer, addresses, timeout_s=2.0)
        await self.recheck_banned()

    async def recheck_banned(self) -> None:
        """A banned peer that answers a ping again is usable again at once: a frozen server that woke
        up, or a cut link that came back, without waiting for its next announcement to reach us through
        the DHT, whose nodes (the servers) may be the ones cut off or frozen."""
        banned = [(stage, p) for stage in range(self.table.num_stages) for p in self.table.banned(stage)]
        if not banned:
            return
        silent = set(await self.silent_peers(banned, PING_TIMEOUT_FLOOR_S))
        for stage, peer in banned:
            if (stage, peer) not in silent and self.table.is_banned(peer):
                self.table.unban(stage, peer)
                logger.info("stage %d peer %s answers again: usable", stage, peer[-8:])

    async def call(
        self, stage: int, kind: str, mb: str, num_samples: int, tensors: dict, weight: float, **header
    ) -> Message:
        reply, _peer = await self.call_peer(stage, kind, mb, num_samples, tensors, weight, **header)
        return reply

    async def call_peer(
        self,
        stage: int,
        kind: str,
        mb: str,
        num_samples: int,
        tensors: dict,
        weight: float,
        prefer: str | None = None,
        persistent: bool = False,
        charge: float | None = None,
        **header,
    ) -> tuple[Message, str]:
        """Like `call`, also returning the peer that answered. `weight` normalizes the observed
        duration into the peer's throughput; `charge` (default `weight`) is what choosing a peer costs
        in the router. `prefer`: try this peer first if it is usable (the replica that ran the forward
        holds the activations for the backward); its forward already paid for this call, so it is
        charged nothing."""
        timeout_s = self.swarm.request_timeout_s
        message = request_message(
            kind, mb, stage, self.digest, self.codec, tensors, timeout_s=timeout_s, **header
        )
        cost = weight if charge is None else charge
        plan = _RelayPlan(self, stage, message, num_samples, weight, cost, prefer, persistent)
        return await run_call(self.peers, self.stats, plan)

    async def hedged(
        self, stage: int, message: Message, attempt: Attempt, num_samples: int, charge: float
    ) -> tuple[Message, str]:
        """The reply to `message` and the peer that gave it: `attempt.peer`, or, when that one went
        silent, another peer of the stage sent a copy that accumulates nothing (`Hedger`)."""
        peer, kind = attempt.peer, message.kind

        def copy_around(silent: list[Pair]) -> Copy[Message] | None:
            other = self.peers.spare(stage, num_samples, charge, {peer})
            if other is None:
                return None
            return Copy(other, self.client.call(other, _accumulating_nothing(message), attempt.wait_s))

        copy, reply = await self.hedger.call(
            self.client.call(peer, message, attempt.cap_s),
            attempt,
            self.peers.times(stage, kind, peer),
            [(stage, peer)],
            copy_around,
            f"stage {stage} {kind} of {message.header.get('mb')}",
        )
        return reply, peer if copy is None else copy.peer

    async def silent_peers(self, peers: list[Pair], timeout_s: float) -> list[Pair]:
        """Those of `peers` ((stage, peer) pairs) whose event loop does not answer a ping within
        `timeout_s`."""
        answered = await asyncio.gather(*(self._answers_ping(s, p, timeout_s) for s, p in peers))
        return [pair for pair, ok in zip(peers, answered, strict=True) if not ok]

    async def _answers_ping(self, stage: int, peer: str, timeout_s: float) -> bool:
        message = ping_message(stage, self.digest)
        return await self.client.answers_ping(peer, message, timeout_s)


class _RelayPlan:
    """A relayed call (`StageCaller.call_peer`) for `run_call`: one message to one stage's peer, hedged
    on another when it goes silent; a gradient a failed peer may still apply is asked for again
    without accumulating, so the stage applies it at most once."""

    log_every_retry = True

    def __init__(
        self,
        caller: StageCaller,
        stage: int,
        message: Message,
        num_samples: int,
        weight: float,
        cost: float,
        prefer: str | None,
        persistent: bool,
    ) -> None:
        """The parameters of `StageCaller.call_peer`, the request built (`cost`: its `charge`)."""
        self.caller, self.peers, self.stage = caller, caller.peers, stage
        self.message, self.kind = message, message.kind
        self.mb = str(message.header.get("mb"))
        self.what = f"{self.kind} of {self.mb}"
        self.num_samples, self.weight, self.cost = num_samples, weight, cost
        self.prefer, self.persistent = prefer, persistent
        self.timeout_s = caller.swarm.request_timeout_s
        self._start_s = 0.0

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        prefer = self.prefer if attempt == 0 else None
        peer = await self.peers.pick(self.stage, self.num_samples, self.cost, excluded, prefer)
        self._start_s = time.monotonic()
        return Attempt(
            peer, self.peers.deadline_s(self.stage, self.kind, peer, self.timeout_s), self.timeout_s
        )

    async def send(self, attempt: Attempt) -> tuple[Message, str]:
        peers, stage, peer = self.peers, self.stage, attempt.peer
        reply, answered_by = await self.caller.hedged(
            stage, self.message, attempt, self.num_samples, self.cost
        )
        if answered_by == peer:  # a hedge's time (started late) measures nobody's usual time
            elapsed_s = time.monotonic() - self._start_s
            peers.report(stage, peer, self.num_samples, _service_s(elapsed_s, reply.header), self.weight)
            peers.record_timing(stage, self.kind, elapsed_s, reply.header)
            peers.observe(stage, self.kind, peer, elapsed_s)
        return reply, answered_by

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction:
        return frozen_or(on_request_failure(exc), isinstance(exc, SilentPastDeadline))  # raises bugs

    def retry_with(self, failure: FailureAction) -> None:
        message = self.message
        accumulate = message.header.get("accumulate", True)
        if (
            message.kind in ACCUMULATING_KINDS
            and accumulate
            and not flags_after([accumulate], failure.outcome)[0]
        ):
            self.caller.stats.not_accumulated += 1
            self.message = Message(message.kind, {**message.header, "accumulate": False}, message.tensors)

    def excludes(self, failure: FailureAction) -> bool:
        return True

    def out_of_retries(self, attempt: int, delay_s: float) -> bool:
        return attempt > (PERSISTENT_ATTEMPTS if self.persistent else self.caller.swarm.max_retries)
