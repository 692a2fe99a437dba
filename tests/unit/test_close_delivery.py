"""A trainer's close is retried until it is delivered (runtime/trainer/close_calls.py `deliver_close`),
through the trainer's one retry loop and the failure table every call shares: a replica that never gets
its step's close cannot apply the step. A stage-1 server behind a NAT is reachable by the trainer only
once its relay is reserved, seconds after it announced itself; before, the one close of step 0 was tried
3 times in about a second and the stage waited for good (tests/integration/test_nat.py).
But a peer that looks dead (we cannot connect to it and the DHT stopped listing it) is not retried: the
demo's killed replica kept its trainer ~30 s after training on its closes (planner/close_retry.py)."""

import asyncio
import dataclasses
import time

import pytest
from hivemind.p2p import P2PDaemonError
from test_stage_calls import A, B, SpyTable

from swarmtrain.config import SwarmConfig, get_preset
from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.net.failures import FATAL_CODES, NEVER_RAN_CODES, NEXT_HOP_FAILED
from swarmtrain.net.protocol import Message
from swarmtrain.net.transport import RemoteError, TruncatedReply
from swarmtrain.planner.close_retry import UNLISTED_MIN_S, gives_up_close, unlisted_give_up_s
from swarmtrain.runtime.ledger import Ledger
from swarmtrain.runtime.trainer import call_policy, close_calls
from swarmtrain.runtime.trainer.call_policy import CallStats, PeerChoice
from swarmtrain.runtime.trainer.close_calls import CLOSE_RETRY_S, deliver_close
from swarmtrain.runtime.trainer.peer_table import PeerTable
from swarmtrain.runtime.trainer.swarm_trainer import SwarmTrainer, TrainerOptions

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


# --- a peer that looks dead: unreachable, and gone from the DHT (planner/close_retry.py) ----------------

GIVE_UP_S = unlisted_give_up_s(SwarmConfig().announce_period_s)  # 10 s at the default 2 s period


def _listing(state: str = "online") -> StageAnnouncement:
    return StageAnnouncement(0, ["/ip4/127.0.0.1/tcp/1/p2p/X"], 10.0, 0, "d", 0, state, time.time())


@pytest.mark.parametrize(
    "now_s,delay_s,unreachable,unlisted_s,gives_up",
    [
        (0.0, 1.0, True, None, False),  # never listed to us: no evidence, retried
        (0.0, 1.0, True, GIVE_UP_S - 0.1, False),  # a few missed DHT reads are no evidence
        (0.0, 1.0, True, GIVE_UP_S, True),  # unreachable and unlisted that long: dead
        (0.0, 1.0, False, 1e9, False),  # a timeout (frozen: its daemon takes the call) is retried
        (29.5, 1.0, False, 0.0, True),  # the retry time is over, as before
    ],
)
def test_the_rule_gives_a_close_up_when_its_peer_is_unreachable_and_long_unlisted(
    now_s, delay_s, unreachable, unlisted_s, gives_up
):
    assert gives_up_close(now_s, 30.0, delay_s, unreachable, unlisted_s, GIVE_UP_S) is gives_up
    assert unlisted_give_up_s(0.001) == UNLISTED_MIN_S and unlisted_give_up_s(2.0) == 5 * 2.0


def test_the_table_says_how_long_the_dht_has_not_listed_a_peer():
    table = PeerTable(records=None, num_stages=1, digest="d")
    table.apply([{A: _listing(), B: _listing()}], now_s=100.0)
    table.apply([{A: _listing(), B: _listing("offline")}], now_s=104.0)  # B leaves: it says "offline"
    table.apply([{}], now_s=107.0)  # A's record lapsed
    assert table.unlisted_s(A, 110.0) == 6.0 and table.unlisted_s(B, 110.0) == 10.0
    assert table.unlisted_s("never-listed", 110.0) is None


class Timeline:
    """A fake clock and DHT: every close attempt takes `step_s`, and a DHT read (as the trainer's refresh
    makes one every announce period) lists the peer while `listed(now_s)`."""

    def __init__(self, failures, listed, step_s: float = 1.0) -> None:
        self.failures, self.listed, self.step_s = failures, listed, step_s
        self.now_s, self.calls = 0.0, 0
        self.table = PeerTable(records=None, num_stages=1, digest="d")
        self.read()

    def read(self) -> None:
        self.table.apply([{A: _listing()} if self.listed(self.now_s) else {}], now_s=self.now_s)

    async def call(self, peer: str, message: Message, timeout_s: float) -> Message:
        self.now_s += self.step_s
        self.calls += 1
        self.read()
        failure = self.failures(self.now_s)
        if failure is not None:
            raise failure
        return Message("result", {})


def _deliver_on(timeline: Timeline, monkeypatch) -> int | None:
    monkeypatch.setattr(call_policy, "BACKOFF_BASE_S", 1e-4)  # the fake clock counts attempts, not sleeps
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 1e-3)

    async def deliver():
        peers = PeerChoice(timeline.table, SwarmConfig(), asyncio.Event(), refresh=None)
        clock = lambda: timeline.now_s  # noqa: E731
        return await deliver_close(timeline, peers, CallStats(), A, 0, 3, CLOSE, CLOSE_RETRY_S, clock)

    return asyncio.run(deliver())


def test_a_killed_replica_is_given_up_once_the_dht_has_not_listed_it_for_a_few_periods(monkeypatch):
    """The demo: the trainer retried its closes to the killed replica for 30 s after training."""
    listed_s = 3.0  # the last DHT read that listed it; every dial fails
    timeline = Timeline(lambda now_s: P2PDaemonError("failed to dial"), lambda now_s: now_s <= listed_s)
    assert _deliver_on(timeline, monkeypatch) is None
    assert timeline.now_s == listed_s + GIVE_UP_S  # not CLOSE_RETRY_S (30 s)


@pytest.mark.parametrize(
    "failure,listed,delivered_s",
    [
        # behind a NAT, announced, dialled only once its relay is reserved (test_nat: 15 s late)
        (lambda now_s: ConnectionError("no relay yet") if now_s < 20 else None, lambda now_s: True, 20.0),
        # cut off from the DHT and us for less than the give-up time, then back
        (
            lambda now_s: ConnectionError("cut") if now_s < 12 else None,
            lambda now_s: not 3 < now_s < 12,
            12.0,
        ),
        # frozen (SIGSTOP: its daemon takes the call, nothing answers), its record lapsed: woken at 25 s
        (lambda now_s: TimeoutError() if now_s < 25 else None, lambda now_s: now_s < 3, 25.0),
        # a member the DHT never listed to us (no evidence it is gone), reachable at 25 s
        (lambda now_s: ConnectionError("dial") if now_s < 25 else None, lambda now_s: False, 25.0),
    ],
    ids=["behind-a-nat", "cut-briefly", "frozen", "never-listed"],
)
def test_a_close_to_a_live_replica_is_still_retried_until_delivered(
    failure, listed, delivered_s, monkeypatch
):
    timeline = Timeline(failure, listed)
    assert _deliver_on(timeline, monkeypatch) == delivered_s and timeline.now_s == delivered_s


def test_at_exit_the_trainer_does_not_wait_for_a_killed_replicas_close(monkeypatch):
    """A trainer that evaluates waits up to CLOSE_RETRY_S for its last closes: the demo's killed replica
    (its record lapsed, still in the trainer's view for the lapse grace) kept it ~28.6 s; now no wait,
    and the live replica still gets its close."""
    cfg = get_preset("tiny")
    trainer = SwarmTrainer.__new__(SwarmTrainer)
    trainer.cfg = cfg.replace(swarm=dataclasses.replace(cfg.swarm, announce_period_s=1.0))  # the demo's
    trainer.options, trainer.digest, trainer.ledger = TrainerOptions(trainer_id="t"), "d", Ledger(None)
    trainer.table = PeerTable(records=None, num_stages=1, digest="d")
    now_s = time.monotonic()
    trainer.table.apply([{A: _listing(), B: _listing()}], now_s=now_s - UNLISTED_MIN_S)  # B killed since
    trainer.table.apply([{A: _listing()}], now_s=now_s)
    assert B in trainer.table.close_recipients(0, {})  # still in the view: its closes are still sent
    calls: list[str] = []

    class Client:
        async def call(self, peer: str, message: Message, timeout_s: float) -> Message:
            calls.append(peer)
            if peer == B:
                raise P2PDaemonError("failed to dial")
            return Message("result", {})

    trainer.client, trainer.caller = Client(), type("Caller", (), {})()
    trainer.caller.peers = PeerChoice(trainer.table, trainer.cfg.swarm, asyncio.Event(), refresh=None)
    trainer.close_stats, trainer._close_tasks = CallStats(), set()

    async def last_step_then_exit() -> float:
        trainer._close(41, 0, {A: 8, B: 8})
        start_s = time.monotonic()
        await asyncio.wait_for(trainer._finish_closes(CLOSE_RETRY_S), timeout=10.0)
        return time.monotonic() - start_s

    assert asyncio.run(last_step_then_exit()) < 2.0
    assert sorted(calls) == sorted([A, B])  # the live replica's close delivered, the dead one dialled once
