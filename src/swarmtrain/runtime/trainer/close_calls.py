"""Delivering a step's close to one replica of a stage, through the trainer's one retry loop
(runtime/trainer/call_policy.py's `run_call`) and the failure table every call shares (net/failures.py).

A replica that never gets its step's close cannot apply the step (with one replica there is nobody to
resync from), so a close is retried for `CLOSE_RETRY_S`: to the same peer, since the close is that
replica's. What a close retries differs from a micro-batch's calls only where its message does:
- a transport failure (no answer in time, a cut-off reply, a peer unreachable for now, e.g. behind a NAT
  until its relay is reserved, seconds after it announced itself) is retried, with the loop's backoff,
  but not to a peer that looks dead: one we cannot connect to that the DHT has stopped listing
  (planner/close_retry.py: a killed replica's closes kept a trainer that evaluates ~30 s at its exit);
- an error answer is final: the close is idempotent, so the replica would answer it the same way again;
- what is no failure of the peer (a bug) is raised, as everywhere else.
A close's failure bans no peer and charges none: a close is small, goes to banned replicas too, and says
nothing about a peer's speed or whether to route work to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from swarmtrain.net.failures import FailureAction, Outcome, on_request_failure
from swarmtrain.net.protocol import Message
from swarmtrain.net.transport import RemoteError, StageClient
from swarmtrain.planner.close_retry import gives_up_close, unlisted_give_up_s
from swarmtrain.runtime.trainer.call_policy import Attempt, CallStats, MicroBatchFailed, PeerChoice, run_call
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# a close lets a stage's replicas apply the step: one that never gets it waits for good (with one replica
# there is nobody to resync from), so a close is retried this long; the first tries come fast because a
# peer behind a NAT is reachable only once its relay is reserved, seconds after it announced itself
CLOSE_RETRY_S = 30.0
CLOSE_EXIT_WAIT_S = 5.0  # at exit, closes still retried after this are dropped (their peers are gone)
CLOSE_TIMEOUT_S = 5.0  # one attempt's deadline


class ClosePlan:
    """A close (`deliver_close`) for `run_call`: one message to one peer, retried until `retry_s` has
    passed or the peer looks dead (`gives_up_close`, from what `peers`' table last read of the DHT);
    `attempts`, `refused` and `dead` say how it went. `clock`: monotonic seconds, as the table's."""

    log_every_retry = False  # the first failure is logged, then only the outcome
    num_samples, weight = 0, 0.0  # a close charges nobody

    def __init__(
        self,
        client: StageClient,
        peers: PeerChoice,
        peer: str,
        stage: int,
        step: int,
        message: Message,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client, self.peer, self.stage, self.message = client, peer, stage, message
        self.table, self.clock = peers.table, clock
        self.give_up_s = unlisted_give_up_s(peers.swarm.announce_period_s)
        self.mb, self.what = f"step {step}", f"close of step {step}"
        self.until_s = clock() + retry_s
        self.attempts, self.refused, self.dead = 0, False, False
        self.unreachable = False  # the last attempt could not connect (the failure table's GONE)

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        self.attempts = attempt + 1
        return Attempt(self.peer, CLOSE_TIMEOUT_S, CLOSE_TIMEOUT_S)

    async def send(self, attempt: Attempt) -> Message:
        return await self.client.call(attempt.peer, self.message, attempt.cap_s)

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction:
        outcome = on_request_failure(exc).outcome  # raises bugs
        if isinstance(exc, RemoteError):  # an answer: asked again, the replica would answer the same
            outcome = Outcome.FATAL
        self.refused = outcome is Outcome.FATAL
        self.unreachable = outcome is Outcome.GONE
        return FailureAction(outcome)  # no ban, no charge: see the module's docstring

    def retry_with(self, failure: FailureAction) -> None:
        pass  # a close is sent again as it was

    def excludes(self, failure: FailureAction) -> bool:
        return False  # the close is this peer's

    def out_of_retries(self, attempt: int, delay_s: float) -> bool:
        now_s = self.clock()
        unlisted_s = self.table.unlisted_s(self.peer, now_s)
        if not gives_up_close(now_s, self.until_s, delay_s, self.unreachable, unlisted_s, self.give_up_s):
            return False
        self.dead = now_s + delay_s <= self.until_s  # given up before its time: the peer looks dead
        return True


async def deliver_close(
    client: StageClient,
    peers: PeerChoice,
    stats: CallStats,
    peer: str,
    stage: int,
    step: int,
    message: Message,
    retry_s: float = CLOSE_RETRY_S,
    clock: Callable[[], float] = time.monotonic,
) -> int | None:
    """Send `message`, the close of `step`, to `stage`'s replica `peer`: the number of attempts it took,
    or None when it was refused, its peer looks dead (unreachable and no longer in the DHT) or it was not
    delivered within `retry_s`. Failures are counted in `stats`."""
    plan = ClosePlan(client, peers, peer, stage, step, message, retry_s, clock)
    try:
        await run_call(peers, stats, plan)
    except MicroBatchFailed as exc:
        outcome = "refused" if plan.refused else "giving up"
        if plan.dead:
            outcome += f" (unreachable, and not in the DHT for {plan.give_up_s:.0f} s)"
        logger.info(
            "close of step %d to stage %d peer %s failed: %s (%s)", step, stage, peer[-8:], outcome, exc
        )
        return None
    if plan.attempts > 1:
        logger.info(
            "close of step %d to stage %d peer %s delivered at attempt %d",
            step,
            stage,
            peer[-8:],
            plan.attempts,
        )
    return plan.attempts
