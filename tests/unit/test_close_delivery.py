"""A trainer's close is retried until it is delivered (runtime/trainer/close_calls.py `deliver_close`),
through the trainer's one retry loop and the failure table every call shares: a replica that never gets
its step's close cannot apply the step. A stage-1 server behind a NAT is reachable by the trainer only
once its relay is reserved, seconds after it announced itself; before, the one close of step 0 was tried
3 times in about a second and the stage waited for good (tests/integration/test_nat.py)."""

import asyncio

import pytest
from hivemind.p2p import P2PDaemonError
from test_stage_calls import A, SpyTable

from swarmtrain.config import SwarmConfig
from swarmtrain.net.failures import FATAL_CODES, NEVER_RAN_CODES, NEXT_HOP_FAILED
from swarmtrain.net.protocol import Message
from swarmtrain.net.transport import RemoteError, TruncatedReply
from swarmtrain.runtime.trainer import call_policy, close_calls
from swarmtrain.runtime.trainer.call_policy import CallStats, PeerChoice
from swarmtrain.runtime.trainer.close_calls import deliver_close

pytestmark = pytest.mark.unit

CLOSE = Message("close", {"step": 3, "stage": 0})


class FlakyPeer:
    """Raises the scripted failures one per call, then answers; records each call's timeout."""

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures, self.timeouts_s = list(failures), []

    @property
    def calls(self) -> int:
        return len(self.timeouts_s)

    async def call(self, peer: str, message: Message, timeout_s: float) -> Message:
        assert peer == A and message is CLOSE
        self.timeouts_s.append(timeout_s)
        if self.failures:
            raise self.failures.pop(0)
        return Message("result", {})


def _deliver(peer: FlakyPeer, retry_s: float = 5.0) -> tuple[int | None, CallStats, SpyTable]:
    table, stats = SpyTable([[A]]), CallStats()

    async def deliver():
        peers = PeerChoice(table, SwarmConfig(), asyncio.Event(), refresh=None)
        return await deliver_close(peer, peers, stats, A, 0, 3, CLOSE, retry_s)

    return asyncio.run(deliver()), stats, table


def test_transport_failures_are_retried_until_the_close_is_delivered():
    peer = FlakyPeer([ConnectionError("failed to dial"), TimeoutError(), ConnectionError("no relay yet")])
    attempts, stats, _ = _deliver(peer)
    assert attempts == 4 and peer.calls == 4
    assert peer.timeouts_s == [close_calls.CLOSE_TIMEOUT_S] * 4  # every attempt has the close's deadline
    assert (stats.retries, stats.connection_errors, stats.timeouts) == (3, 2, 0)


def test_an_error_answer_is_not_retried():
    peer = FlakyPeer([RemoteError("stale", "step 3 is applied here")])
    attempts, stats, _ = _deliver(peer)
    assert attempts is None and peer.calls == 1 and stats.retries == 0


def test_a_peer_that_stays_unreachable_is_given_up_on_after_the_retry_time(monkeypatch):
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 2.0)
    peer = FlakyPeer([ConnectionError()] * 100)
    attempts, stats, _ = _deliver(peer, retry_s=1.0)
    # the trainer's backoff (0.1, 0.2, 0.4 s ..., with jitter): about 1 s of retries, then a last failure
    assert attempts is None and 2 <= peer.calls <= 5 and stats.retries == peer.calls - 1


# the failure table's rows (net/failures.py) -> whether a close retries: every transport failure is, no
# error answer is (a close is idempotent: the replica would answer the same)
ROWS = [
    *(
        (RemoteError(code, "x"), False)
        for code in (*FATAL_CODES, *NEVER_RAN_CODES, NEXT_HOP_FAILED, "internal")
    ),
    (TimeoutError(), True),
    (TruncatedReply("cut"), True),
    (ConnectionResetError("gone"), True),
    (P2PDaemonError("failed to dial"), True),
]


@pytest.mark.parametrize("exc,retried", ROWS, ids=lambda v: repr(v)[:40])
def test_a_close_retries_by_the_failure_table_and_never_bans_or_charges_its_peer(exc, retried):
    peer = FlakyPeer([exc])
    attempts, stats, table = _deliver(peer)
    assert (attempts, peer.calls, stats.retries) == ((2, 2, 1) if retried else (None, 1, 0))
    # a close says nothing of a peer's speed or whether to route to it
    assert table.bans == [] and table.reports == [] and not table.is_banned(A)


@pytest.mark.parametrize("exc", [KeyError("bug"), ValueError("bug")])
def test_a_bug_is_raised_not_retried(exc):
    peer = FlakyPeer([exc])
    with pytest.raises(type(exc)):
        _deliver(peer)
    assert peer.calls == 1
