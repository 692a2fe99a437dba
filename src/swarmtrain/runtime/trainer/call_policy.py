"""One failure policy for every trainer call: choose a peer, give it a deadline, send (hedged when it
goes silent), classify a failure (net/failures.py), ban or charge the peer, back off and retry.

A relayed call (`StageCaller.call_peer`: one message to one stage) and a chain (`ChainCaller.run`: a
route from one stage to the last) are two `CallPlan`s run by `run_call`. What differs between them is
only how an attempt is chosen and sent and what a failure changes for the next attempt (a gradient the
failed peer may still apply is asked for again without accumulating); the loop, its limits, its
counters and its messages are this module's.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from swarmtrain.net.failures import FailureAction, Outcome
from swarmtrain.utils.logging import get_logger

if TYPE_CHECKING:
    from swarmtrain.runtime.trainer.stage_calls import StageCaller

logger = get_logger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 2.0
PERSISTENT_ATTEMPTS = 60  # while a stage may hold the micro-batch, stopping would leave stages disagreeing


class MicroBatchFailed(RuntimeError):
    """A stage call failed after all retries (or with an error retrying cannot fix)."""


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

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt: ...

    async def send(self, attempt: Attempt) -> T_co: ...

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction: ...

    def retry_with(self, failure: FailureAction) -> None:
        """What `failure` changes for the next attempt."""

    def excludes(self, failure: FailureAction) -> bool:
        """Whether the failed attempt's peer is left out of the next choice."""

    def max_attempts(self) -> int: ...


def frozen_or(failure: FailureAction, silent: bool) -> FailureAction:
    """A timeout at the peer's own deadline after it stopped answering pings: the peer is taken for
    frozen and banned until it announces itself again (at the request timeout, as before: not banned)."""
    if failure.timed_out and silent and not failure.ban:
        return FailureAction(failure.outcome, ban=True, timed_out=True)
    return failure


def retry_delay_s(attempt: int) -> float:
    """How long to wait before retry `attempt` (1, 2, ...): exponential backoff with jitter."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * (0.5 + random.random())


async def run_call(caller: StageCaller, plan: CallPlan[T]) -> T:
    """`plan`'s answer, retried by one policy; MicroBatchFailed when no retry can help (our request is
    refused, every live peer already applied the micro-batch's step) or the attempts ran out."""
    attempt, excluded, stale_from = 0, set[str](), set[str]()
    while True:
        chosen = await plan.choose(attempt, excluded)
        try:
            return await plan.send(chosen)
        except Exception as exc:
            failure = plan.classify(exc, chosen)  # raises what is a bug, not a failure
            error = exc
        reason = f"{error!r:.160}"
        if failure.timed_out:  # given up at the deadline when the peer went silent, else at the cap
            reason = f"no answer in {chosen.wait_s if failure.ban else chosen.cap_s:.1f}s"
        account_failure(caller, plan, chosen, failure)
        stage, peer = plan.stage, chosen.peer
        if failure.outcome is Outcome.FATAL:
            raise MicroBatchFailed(f"stage {stage} peer {peer} refused the {plan.what}: {reason}")
        if caller.stale_everywhere(stage, peer, error, stale_from):
            raise MicroBatchFailed(f"stage {stage} applied the step of {plan.mb} without it: {reason}")
        plan.retry_with(failure)
        if plan.excludes(failure):
            excluded.add(peer)
        attempt += 1
        if attempt > plan.max_attempts():
            raise MicroBatchFailed(f"stage {stage} {plan.what}: {attempt} attempts failed, last: {reason}")
        caller.retries += 1
        logger.info("stage %d %s on %s failed (%s); retry %d", stage, plan.what, peer[-8:], reason, attempt)
        await asyncio.sleep(retry_delay_s(attempt))


def account_failure(caller: StageCaller, plan: CallPlan, chosen: Attempt, failure: FailureAction) -> None:
    """Count a failed attempt; ban its peer (gone, or serving another run) or charge it the time it
    kept us waiting."""
    if failure.timed_out:
        caller.timeouts += 1
        caller.table.report(plan.stage, chosen.peer, plan.num_samples, chosen.cap_s, plan.weight)
    if failure.outcome is Outcome.GONE:
        caller.connection_errors += 1
    if failure.ban:
        caller.table.ban(plan.stage, chosen.peer)
