"""One call to "some peer of stage s", with peer choice, timeouts, retries, bans and waiting.

Failure policy (docs/ARCHITECTURE.md; the table is net/failures.py; the loop that applies it is
runtime/trainer/call_policy.py's `run_call`, shared with the chain path):
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
  can help: it fails at once (it used to be retried with backoff until `max_retries`);
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
from swarmtrain.net.failures import FailureAction, flags_after, on_request_failure
from swarmtrain.net.protocol import ACCUMULATING_KINDS, Message, ping_message, request_message
from swarmtrain.net.transport import RemoteError, StageClient
from swarmtrain.planner.deadlines import (
    PING_TIMEOUT_FLOOR_S,
    CallTimes,
    check_after_s,
    deadline_s,
    ping_timeout_s,
    silent_deadline_s,
)
from swarmtrain.runtime.trainer.call_policy import (
    PERSISTENT_ATTEMPTS,
    Attempt,
    MicroBatchFailed,
    frozen_or,
    run_call,
)
from swarmtrain.runtime.trainer.hedging import (
    SilentPastDeadline,
    first_success,
    silent_while,
    within_deadline,
)
from swarmtrain.runtime.trainer.peer_table import PeerTable, RunMismatch
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

NO_PEER_LOG_PERIOD_S = 5.0


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


class CallTiming:
    """Running sums of one kind of call's timings (seconds), for means and standard deviations."""

    FIELDS = ("call_s", "server_s", "compute_s", "overhead_s")

    def __init__(self) -> None:
        self.calls = 0
        self.sums = dict.fromkeys(self.FIELDS, 0.0)
        self.squares = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, call_s: float, server_s: float, compute_s: float) -> None:
        self.calls += 1
        for name, value in zip(self.FIELDS, (call_s, server_s, compute_s, call_s - server_s), strict=True):
            self.sums[name] += value
            self.squares[name] += value * value

    def summary(self) -> dict:
        out: dict = {"calls": self.calls}
        for name in self.FIELDS:
            mean = self.sums[name] / self.calls
            out[f"mean_{name}"] = mean
            out[f"std_{name}"] = max(self.squares[name] / self.calls - mean * mean, 0.0) ** 0.5
        return out


class StageCaller:
    def __init__(
        self,
        client: StageClient,
        table: PeerTable,
        swarm: SwarmConfig,
        digest: str,
        codec: str,
        stopping: asyncio.Event,
    ) -> None:
        self.client, self.table, self.swarm = client, table, swarm
        self.digest, self.codec, self.stopping = digest, codec, stopping
        self.retries = 0
        self.timeouts = 0
        self.connection_errors = 0
        self.not_accumulated = 0  # retries sent with accumulate=False
        self.frozen = 0  # peers found silent (no answer to a ping) while a call waited on them
        self.hedges = 0  # copies of a call sent to another peer because its peer was frozen
        self.hedges_won = 0  # ... that answered first
        self.timing: dict[tuple[int, str], CallTiming] = {}
        self.call_times: dict[tuple[int, str, str], CallTimes] = {}  # (stage, kind, peer): its deadline
        self._last_no_peer_log = [0.0] * table.num_stages
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
        return await run_call(
            self, _RelayPlan(self, stage, message, num_samples, weight, cost, prefer, persistent)
        )

    async def _hedged(
        self,
        stage: int,
        kind: str,
        peer: str,
        message: Message,
        attempt: Attempt,
        num_samples: int,
        charge: float,
    ) -> tuple[Message, str]:
        """The reply to `message` and the peer that gave it: `peer`, or, when `peer` went silent, another
        peer of the stage sent a copy that accumulates nothing (runtime/trainer/hedging.py). A peer
        that answers pings is waited for up to `attempt.cap_s`; a silent one until its deadline."""
        start_s = time.monotonic()
        call = asyncio.ensure_future(self.client.call(peer, message, attempt.cap_s))
        times = self.call_times.get((stage, kind, peer))

        async def probe() -> list[tuple[int, str]]:
            return await self.silent_peers([(stage, peer)], ping_timeout_s(times))

        if not await silent_while(call, check_after_s(times, attempt.wait_s), probe):
            return await call, peer
        call = asyncio.ensure_future(
            within_deadline(call, start_s + silent_deadline_s(times, attempt.wait_s))
        )
        other = self.table.choose(stage, num_samples, charge, exclude={peer})
        if other is None:  # nobody to hedge on: wait for the silent peer until its deadline
            return await call, peer
        self.treat_as_frozen([(stage, peer)])
        self.hedges += 1
        copy = asyncio.ensure_future(self.client.call(other, _accumulating_nothing(message), attempt.wait_s))
        hedge_won, reply = await first_success(call, copy)
        self.hedges_won += hedge_won
        logger.info(
            "stage %d %s of %s: %s was silent; hedged on %s, %s won",
            stage,
            kind,
            message.header.get("mb"),
            peer[-8:],
            other[-8:],
            other[-8:] if hedge_won else peer[-8:],
        )
        return reply, other if hedge_won else peer

    async def silent_peers(self, peers: list[tuple[int, str]], timeout_s: float) -> list[tuple[int, str]]:
        """Those of `peers` ((stage, peer) pairs) whose event loop does not answer a ping within
        `timeout_s`."""
        answered = await asyncio.gather(*(self._answers_ping(s, p, timeout_s) for s, p in peers))
        return [pair for pair, ok in zip(peers, answered, strict=True) if not ok]

    def treat_as_frozen(self, silent: list[tuple[int, str]]) -> None:
        """Silent peers that a call is hedged around are banned until they announce themselves again
        (a frozen peer cannot): no new work goes to them, and the step's close does not wait for them."""
        for stage, peer in silent:
            self.frozen += 1
            self.table.ban(stage, peer)
            logger.warning("stage %d peer %s does not answer a ping: treated as frozen", stage, peer[-8:])

    async def _answers_ping(self, stage: int, peer: str, timeout_s: float) -> bool:
        message = ping_message(stage, self.digest)
        return await self.client.answers_ping(peer, message, timeout_s)

    async def _choose(
        self, stage: int, num_samples: int, charge: float, excluded: set, prefer: str | None
    ) -> str:
        """`prefer` if it is usable now, charged nothing (its forward already paid for this call);
        else the router's pick, charged `charge` (waiting while the stage has no usable peer)."""
        if prefer is not None:
            others = set(self.table.routers[stage].peers) - {prefer}
            peer = self.table.choose(stage, num_samples, 0.0, exclude=others)
            if peer is not None:
                return peer
        return await self._pick(stage, num_samples, charge, excluded)

    def stale_everywhere(self, stage: int, peer: str, exc: BaseException, stale_from: set[str]) -> bool:
        """`peer` answered `stale` (it already applied the micro-batch's step): True once every live
        peer of the stage did, for this call (`stale_from` collects them)."""
        if isinstance(exc, RemoteError) and exc.code == "stale":
            stale_from.add(peer)
        return bool(stale_from) and set(self.table.available(stage)) <= stale_from

    def deadline_s(self, stage: int, kind: str, peer: str, cap_s: float) -> float:
        """How long to wait for `peer`'s answer to a call of `kind` (planner/deadlines.py)."""
        return deadline_s(self.call_times.get((stage, kind, peer)), cap_s)

    def observe(self, stage: int, kind: str, peer: str, call_s: float) -> None:
        key = (stage, kind, peer)
        self.call_times[key] = self.call_times.get(key, CallTimes()).observed(call_s)

    def _time(self, stage: int, kind: str, elapsed_s: float, header: dict) -> None:
        server_s, compute_s = header.get("server_s"), header.get("compute_s")
        if not isinstance(server_s, (int, float)) or not isinstance(compute_s, (int, float)):
            return  # an older server: no timing in its reply
        self.timing.setdefault((stage, kind), CallTiming()).add(elapsed_s, float(server_s), float(compute_s))

    def timing_summary(self) -> dict:
        """Per stage and call kind: round trip, server time (queue + compute), compute, and the
        overhead = round trip - server time (serialization, relaying and the network, which the
        simulator models as link latency), with standard deviations (the simulator's variability)."""
        return {f"stage{stage}_{kind}": t.summary() for (stage, kind), t in sorted(self.timing.items())}

    async def _pick(self, stage: int, num_samples: int, weight: float, excluded: set) -> str:
        """A peer for this call; waits (refreshing the DHT view) while the stage has no usable peer."""
        while True:
            if self.stopping.is_set() and not self.table.available(stage):
                raise MicroBatchFailed(f"stopping and stage {stage} has no live peer")
            peer = self.table.choose(stage, num_samples, weight, excluded)
            if peer is None and excluded and self.table.available(stage):
                excluded.clear()  # every live peer failed once for this call: allow them again
                peer = self.table.choose(stage, num_samples, weight, excluded)
            if peer is not None:
                return peer
            await self.wait_a_moment(stage)

    async def wait_for_peer(self, stage: int) -> None:
        """Until `stage` has a live peer in our view (or we are stopping)."""
        while not self.table.available(stage) and not self.stopping.is_set():
            await self.wait_a_moment(stage)

    async def wait_a_moment(self, stage: int) -> None:
        """`stage` has no usable peer: say so now and then, wait, refresh the DHT view. RunMismatch once
        a stage has shown peers of other config digests only for a grace (PeerTable.mismatch)."""
        now = time.monotonic()
        if now - self._last_no_peer_log[stage] >= NO_PEER_LOG_PERIOD_S:
            self._last_no_peer_log[stage] = now
            logger.warning("stage %d has no live peer; waiting for a server to announce itself", stage)
        await asyncio.sleep(min(1.0, self.swarm.announce_period_s / 2))
        await self.refresh()
        mismatch = self.table.mismatch(time.monotonic())
        if mismatch is not None:
            raise RunMismatch(mismatch)


class _RelayPlan:
    """A relayed call (`StageCaller.call_peer`) for `run_call`: one message to one stage's peer, hedged
    on another when it goes silent; a gradient a failed peer may still apply is asked for again
    without accumulating, so the stage applies it at most once."""

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
        self.caller, self.stage, self.message, self.kind = caller, stage, message, message.kind
        self.mb = str(message.header.get("mb"))
        self.what = f"{self.kind} of {self.mb}"
        self.num_samples, self.weight, self.cost = num_samples, weight, cost
        self.prefer, self.persistent = prefer, persistent
        self.timeout_s = caller.swarm.request_timeout_s
        self._start_s = 0.0

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        prefer = self.prefer if attempt == 0 else None
        peer = await self.caller._choose(self.stage, self.num_samples, self.cost, excluded, prefer)
        self._start_s = time.monotonic()
        return Attempt(
            peer, self.caller.deadline_s(self.stage, self.kind, peer, self.timeout_s), self.timeout_s
        )

    async def send(self, attempt: Attempt) -> tuple[Message, str]:
        caller, stage, peer = self.caller, self.stage, attempt.peer
        reply, answered_by = await caller._hedged(
            stage, self.kind, peer, self.message, attempt, self.num_samples, self.cost
        )
        if answered_by == peer:  # a hedge's time (started late) measures nobody's usual time
            elapsed_s = time.monotonic() - self._start_s
            caller.table.report(
                stage, peer, self.num_samples, _service_s(elapsed_s, reply.header), self.weight
            )
            caller._time(stage, self.kind, elapsed_s, reply.header)
            caller.observe(stage, self.kind, peer, elapsed_s)
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
            self.caller.not_accumulated += 1
            self.message = Message(message.kind, {**message.header, "accumulate": False}, message.tensors)

    def excludes(self, failure: FailureAction) -> bool:
        return True

    def max_attempts(self) -> int:
        return PERSISTENT_ATTEMPTS if self.persistent else self.caller.swarm.max_retries
