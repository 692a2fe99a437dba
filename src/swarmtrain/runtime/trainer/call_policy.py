"""One failure policy for every trainer call: choose a peer, give it a deadline, send (hedged when it
goes silent), classify a failure (net/failures.py), ban or charge the peer, back off and retry.

A relayed call (`StageCaller.call_peer`: one message to one stage), a chain (`ChainCaller.run`: a route
from one stage to the last), a validation chain and a step's close (runtime/trainer/close_calls.py) are
`CallPlan`s run by `run_call`. What differs between them is only how an attempt is chosen and sent,
what a failure means for the next attempt (a gradient the failed peer may still apply is asked for
again without accumulating) and when retrying stops; the loop, its backoff, its counters (`CallStats`)
and its messages are this module's, and so is the one way every call chooses a peer and records what
the peer did (`PeerChoice`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from swarmtrain.config import SwarmConfig
from swarmtrain.net.failures import FailureAction, Outcome, resend_once
from swarmtrain.net.transport import RemoteError
from swarmtrain.planner.deadlines import CallTimes, deadline_s
from swarmtrain.runtime.trainer.peer_table import PeerTable, RunMismatch
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
PERSISTENT_ATTEMPTS = 60  # while a stage may hold the micro-batch, stopping would leave stages disagreeing


class MicroBatchFailed(RuntimeError):
    """A stage call failed after all retries (or with an error retrying cannot fix)."""


@dataclass
class CallStats:
    """What the calls of a trainer did, for its summary and metrics (`summary()` names them)."""

    retries: int = 0  # attempts sent again after a failure
    timeouts: int = 0  # attempts that waited out their deadline
    connection_errors: int = 0  # attempts whose peer was gone
    not_accumulated: int = 0  # retries sent with accumulate=False
    frozen: int = 0  # peers found silent (no answer to a ping) while a call waited on them
    hedges: int = 0  # copies of a call sent to another peer because its peer was frozen
    hedges_won: int = 0  # ... that answered first

    def summary(self) -> dict[str, int]:
        """The counters under the names the trainer's summary has always given them."""
        return {
            "retries": self.retries,
            "timeouts": self.timeouts,
            "connection_errors": self.connection_errors,
            "retries_not_accumulated": self.not_accumulated,
            "frozen_peers": self.frozen,
            "hedges": self.hedges,
            "hedges_won": self.hedges_won,
        }


@dataclass(frozen=True)
class Attempt:
    """One try of a call: the peer it goes to and its deadline."""

    peer: str
    # its deadline: below `cap_s` for a peer that is usually fast, so that one that went silent (frozen)
    # is given up early (runtime/trainer/hedging.py)
    wait_s: float
    cap_s: float  # the call's whole timeout (a peer that answers pings is waited for this long)


class CallPlan(Protocol, Generic[T_co]):
    """What a kind of call plugs into `run_call`."""

    stage: int  # the stage whose peer is called
    mb: str  # the micro-batch, for messages
    what: str  # "backward of MB", "chain of MB": for messages
    num_samples: int
    weight: float  # normalizes a charged duration into the peer's throughput
    # False: only the first retry is logged at INFO (a close retries an unreachable peer for many seconds)
    log_every_retry: bool

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt: ...

    async def send(self, attempt: Attempt) -> T_co: ...

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction: ...

    def retry_with(self, failure: FailureAction) -> None:
        """What `failure` changes for the next attempt."""

    def excludes(self, failure: FailureAction) -> bool:
        """Whether the failed attempt's peer is left out of the next choice."""

    def out_of_retries(self, attempt: int, delay_s: float) -> bool:
        """Whether retry `attempt` (1, 2, ...), sent `delay_s` from now, is one too many."""


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


class PeerChoice:
    """Which peer of a stage a call goes to, and what the call taught about it: the one interface through
    which `run_call`, the relayed calls and the chains choose peers (the peer table's IWRR routers and
    bans) and record outcomes (throughput, each peer's usual call time behind its deadline, timings)."""

    def __init__(
        self,
        table: PeerTable,
        swarm: SwarmConfig,
        stopping: asyncio.Event,
        refresh: Callable[[], Awaitable[None]],
    ) -> None:
        """`refresh`: re-reads the DHT view while a stage has no usable peer."""
        self.table, self.swarm, self.stopping, self._refresh = table, swarm, stopping, refresh
        self.timing: dict[tuple[int, str], CallTiming] = {}
        self.call_times: dict[tuple[int, str, str], CallTimes] = {}  # (stage, kind, peer): its deadline

    async def pick(
        self, stage: int, num_samples: int, charge: float, excluded: set[str], prefer: str | None = None
    ) -> str:
        """`prefer` if it is usable now, charged nothing (its forward already paid for this call); else
        the router's pick, charged `charge`. Waits (refreshing the DHT view) while the stage has no
        usable peer; once every live peer was excluded, allows them all again."""
        if prefer is not None:
            others = set(self.table.routers[stage].peers) - {prefer}
            peer = self.table.choose(stage, num_samples, 0.0, exclude=others)
            if peer is not None:
                return peer
        while True:
            if self.stopping.is_set() and not self.table.available(stage):
                raise MicroBatchFailed(f"stopping and stage {stage} has no live peer")
            peer = self.table.choose(stage, num_samples, charge, excluded)
            if peer is None and excluded and self.table.available(stage):
                excluded.clear()  # every live peer failed once for this call: allow them again
                peer = self.table.choose(stage, num_samples, charge, excluded)
            if peer is not None:
                return peer
            await self.wait_a_moment(stage)

    def spare(self, stage: int, num_samples: int, charge: float, exclude: set[str]) -> str | None:
        """A usable peer of `stage` not in `exclude` now (a hedge's, a route's alternate), else None:
        never waits."""
        return self.table.choose(stage, num_samples, charge, exclude)

    async def wait_for_peer(self, stage: int) -> None:
        """Until `stage` has a live peer in our view (or we are stopping)."""
        while not self.table.available(stage) and not self.stopping.is_set():
            await self.wait_a_moment(stage)

    async def wait_a_moment(self, stage: int) -> None:
        """`stage` has no usable peer: say so now and then, wait, refresh the DHT view. RunMismatch once
        a stage has shown peers of other config digests only for a grace (PeerTable.mismatch)."""
        log_repeated(
            logger,
            logging.WARNING,
            "stage %d has no live peer; waiting for a server to announce itself",
            stage,
            key=stage,
        )
        await asyncio.sleep(min(1.0, self.swarm.announce_period_s / 2))
        await self._refresh()
        mismatch = self.table.mismatch(time.monotonic())
        if mismatch is not None:
            raise RunMismatch(mismatch)

    def times(self, stage: int, kind: str, peer: str) -> CallTimes | None:
        """`peer`'s usual time for a call of `kind` (None before its first answer)."""
        return self.call_times.get((stage, kind, peer))

    def deadline_s(self, stage: int, kind: str, peer: str, cap_s: float) -> float:
        """How long to wait for `peer`'s answer to a call of `kind` (planner/deadlines.py)."""
        return deadline_s(self.times(stage, kind, peer), cap_s)

    def observe(self, stage: int, kind: str, peer: str, call_s: float) -> None:
        """`peer` answered a call of `kind` in `call_s`: its deadline learns it."""
        key = (stage, kind, peer)
        self.call_times[key] = self.call_times.get(key, CallTimes()).observed(call_s)

    def report(self, stage: int, peer: str, num_samples: int, duration_s: float, weight: float) -> None:
        """`peer` took `duration_s` for `num_samples`: its throughput in the router."""
        self.table.report(stage, peer, num_samples, duration_s, weight)

    def ban(self, stage: int, peer: str) -> None:
        """No more calls to `peer` until it announces itself again (or answers a ping)."""
        self.table.ban(stage, peer)

    def record_timing(self, stage: int, kind: str, call_s: float, header: dict) -> None:
        """A call's round trip with the server and compute time its reply reports (`timing_summary`)."""
        server_s, compute_s = header.get("server_s"), header.get("compute_s")
        if not isinstance(server_s, (int, float)) or not isinstance(compute_s, (int, float)):
            return  # an older server: no timing in its reply
        self.timing.setdefault((stage, kind), CallTiming()).add(call_s, float(server_s), float(compute_s))

    def timing_summary(self) -> dict:
        """Per stage and call kind: round trip, server time (queue + compute), compute, and the
        overhead = round trip - server time (serialization, relaying and the network, which the
        simulator models as link latency), with standard deviations (the simulator's variability)."""
        return {f"stage{stage}_{kind}": t.summary() for (stage, kind), t in sorted(self.timing.items())}

    def stale_everywhere(self, stage: int, peer: str, exc: BaseException, stale_from: set[str]) -> bool:
        """`peer` answered `stale` (it already applied the micro-batch's step): True once every live
        peer of the stage did, for this call (`stale_from` collects them)."""
        if isinstance(exc, RemoteError) and exc.code == "stale":
            stale_from.add(peer)
        return bool(stale_from) and set(self.table.available(stage)) <= stale_from


def frozen_or(failure: FailureAction, silent: bool) -> FailureAction:
    """A timeout at the peer's own deadline after it stopped answering pings: the peer is taken for
    frozen and banned until it announces itself again (at the request timeout, as before: not banned)."""
    if failure.timed_out and silent and not failure.ban:
        return FailureAction(failure.outcome, ban=True, timed_out=True)
    return failure


def retry_delay_s(attempt: int) -> float:
    """How long to wait before retry `attempt` (1, 2, ...): exponential backoff with jitter."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * (0.5 + random.random())


async def run_call(peers: PeerChoice, stats: CallStats, plan: CallPlan[T]) -> T:
    """`plan`'s answer, retried by one policy; MicroBatchFailed when no retry can help (our request is
    refused, every live peer already applied the micro-batch's step) or the plan is out of retries."""
    attempt, excluded, stale_from, resent_to = 0, set[str](), set[str](), set[str]()
    again: Attempt | None = None  # an attempt sent once more as it was (`FailureAction.resend`)
    while True:
        chosen = again or await plan.choose(attempt, excluded)
        try:
            return await plan.send(chosen)
        except Exception as exc:
            failure = plan.classify(exc, chosen)  # raises what is a bug, not a failure
            error = exc
        reason = f"{error!r:.160}"
        if failure.timed_out:  # given up at the deadline when the peer went silent, else at the cap
            reason = f"no answer in {chosen.wait_s if failure.ban else chosen.cap_s:.1f}s"
        account_failure(peers, stats, plan, chosen, failure)
        stage, peer = plan.stage, chosen.peer
        if failure.outcome is Outcome.FATAL:
            raise MicroBatchFailed(f"stage {stage} peer {peer} refused the {plan.what}: {reason}")
        if peers.stale_everywhere(stage, peer, error, stale_from):
            raise MicroBatchFailed(f"stage {stage} applied the step of {plan.mb} without it: {reason}")
        again = chosen if resend_once(failure, peer, resent_to) else None
        if again is not None:  # the same request to the same peer, once: it counts it once
            reason += ", sent to it again as it was"
        else:
            plan.retry_with(failure)
            if plan.excludes(failure):
                excluded.add(peer)
        attempt += 1
        delay_s = retry_delay_s(attempt)
        if plan.out_of_retries(attempt, delay_s):
            raise MicroBatchFailed(f"stage {stage} {plan.what}: {attempt} attempts failed, last: {reason}")
        stats.retries += 1
        level = logging.INFO if plan.log_every_retry or attempt == 1 else logging.DEBUG
        # one line per stage every few seconds: while a replica catches up, every micro-batch in flight
        # is refused and retried, dozens of lines a second
        log_repeated(
            logger,
            level,
            "stage %d %s on %s failed (%s); retry %d",
            *(stage, plan.what, peer[-8:], reason, attempt),
            key=stage,
        )
        await asyncio.sleep(delay_s)


def account_failure(
    peers: PeerChoice, stats: CallStats, plan: CallPlan, chosen: Attempt, failure: FailureAction
) -> None:
    """Count a failed attempt; ban its peer (gone, or serving another run) or charge it the time it
    kept us waiting."""
    if failure.timed_out:
        stats.timeouts += 1
        peers.report(plan.stage, chosen.peer, plan.num_samples, chosen.cap_s, plan.weight)
    if failure.outcome is Outcome.GONE:
        stats.connection_errors += 1
    if failure.ban:
        peers.ban(plan.stage, chosen.peer)
