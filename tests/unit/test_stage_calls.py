"""The trainer's retry loops around the shared failure table (net/failures.py): the relayed call
(`StageCaller.call_peer`) and the chain (`ChainCaller.run`), against a scripted client and a real peer
table: which peers are tried, with which accumulate flags, what is banned, charged and counted."""

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID

from swarmtrain.config import SwarmConfig
from swarmtrain.net import codec
from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.net.failures import NEXT_HOP_FAILED
from swarmtrain.net.protocol import Message
from swarmtrain.net.transport import RemoteError, TruncatedReply
from swarmtrain.planner import deadlines
from swarmtrain.runtime.trainer import call_policy, stage_calls
from swarmtrain.runtime.trainer.chain_calls import ChainCaller
from swarmtrain.runtime.trainer.hedging import SilentPastDeadline
from swarmtrain.runtime.trainer.peer_table import PeerTable

pytestmark = pytest.mark.unit

A, B, C = (PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32).to_base58() for i in (1, 2, 3))
TIMEOUT_S = 3.0


def _ann(stage):
    return StageAnnouncement(stage, ["/ip4/127.0.0.1/tcp/1/p2p/X"], 10.0, 0, "d", 0, "online", 0.0)


class SpyTable(PeerTable):
    """A real peer table that records the reports, bans and choices made on it."""

    def __init__(self, peers_per_stage):
        super().__init__(records=None, num_stages=len(peers_per_stage), digest="d")
        self.apply([{p: _ann(stage) for p in peers} for stage, peers in enumerate(peers_per_stage)])
        self.reports, self.bans, self.choices = [], [], []

    def report(self, stage, peer, num_samples, duration_s, weight):
        self.reports.append((stage, peer, duration_s))
        super().report(stage, peer, num_samples, duration_s, weight)

    def ban(self, stage, peer):
        self.bans.append((stage, peer))
        super().ban(stage, peer)

    def choose(self, stage, num_samples, weight, exclude=()):
        peer = super().choose(stage, num_samples, weight, exclude)
        self.choices.append((stage, weight, peer))
        return peer


class ScriptedClient:
    """Raises the scripted exceptions one per call, then answers; records (peer, kind, accumulate)."""

    def __init__(self, *failures, reply=None):
        self.failures, self.calls, self.messages, self.timeouts_s = list(failures), [], [], []
        self.reply = reply or (lambda peer, message: Message("result", {"acc": 8}))

    async def call(self, peer_id, message, timeout_s):
        kind = message.kind
        assert timeout_s > 0
        self.timeouts_s.append(timeout_s)
        self.calls.append((str(peer_id), kind, message.header.get("accumulate")))
        self.messages.append(message)
        if self.failures:
            raise self.failures.pop(0)
        return self.reply(str(peer_id), message)

    async def answers_ping(self, peer_id, ping, timeout_s):
        """As `StageClient.answers_ping`: a timeout is no answer."""
        try:
            await self.call(peer_id, ping, timeout_s)
        except TimeoutError:
            return False
        return True


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 0.0)


def _caller(client, table, **swarm):
    config = SwarmConfig(request_timeout_s=TIMEOUT_S, **swarm)
    return stage_calls.StageCaller(client, table, config, "d", "none", asyncio.Event())


def _counted(caller, names):
    """The counters `names` (space-separated) of the caller's `CallStats`, in that order."""
    return tuple(getattr(caller.stats, name) for name in names.split())


def _call(caller, kind="backward", prefer=A, **header):
    return asyncio.run(caller.call_peer(0, kind, "t.0-1", 8, {}, 1.0, prefer=prefer, step=0, **header))


# relayed calls ----------------------------------------------------------------------------------------
# failure of the first call (to A) -> accumulate flag of the retry (to B), A banned, counters
#   (timeouts, connection_errors, not_accumulated)
ONE_FAILURE = [
    (TimeoutError(), False, False, (1, 0, 1)),  # at the request timeout: not banned (no deadline known)
    (TruncatedReply("cut"), False, False, (0, 0, 1)),  # the second time (sent to A again the first)
    (RemoteError("internal", "bug"), False, False, (0, 0, 1)),
    (RemoteError("something_new", "x"), False, False, (0, 0, 1)),
    (ConnectionResetError("gone"), None, True, (0, 1, 0)),  # its accumulator died with it
    (RemoteError("digest_mismatch", "another run"), None, True, (0, 0, 0)),
    (RemoteError("unavailable", "leaving"), None, False, (0, 0, 0)),
    (RemoteError("timeout", "queue"), None, False, (0, 0, 0)),
    (RemoteError("stale", "resynced past it"), None, False, (0, 0, 0)),
    (RemoteError(NEXT_HOP_FAILED, "x"), None, False, (0, 0, 0)),
]


@pytest.mark.parametrize("kind", ["backward", "forward_backward"])
@pytest.mark.parametrize("exc,accumulate,banned,counters", ONE_FAILURE, ids=lambda v: repr(v)[:30])
def test_an_accumulating_call_is_retried_elsewhere_without_accumulating_only_if_it_may_have_applied(
    kind, exc, accumulate, banned, counters
):
    resent = isinstance(exc, TruncatedReply)  # its reply cut: once more to A as it was, then elsewhere
    table, client = SpyTable([[A, B]]), ScriptedClient(*[exc] * (1 + resent))
    caller = _caller(client, table)
    reply, answered_by = _call(caller, kind)
    assert answered_by == B and reply.header["acc"] == 8
    assert client.calls == [(A, kind, None)] * (1 + resent) + [(B, kind, accumulate)]
    assert (table.is_banned(A), table.bans) == (banned, [(0, A)] if banned else [])
    assert _counted(caller, "timeouts connection_errors not_accumulated") == counters
    assert caller.stats.retries == 1 + resent
    # a timeout is charged to the silent peer's throughput; the answer to the one that answered
    charged = [(0, A, TIMEOUT_S)] if isinstance(exc, TimeoutError) else []
    assert table.reports[:-1] == charged and table.reports[-1][:2] == (0, B)


@pytest.mark.parametrize("exc,accumulate,banned,counters", ONE_FAILURE, ids=lambda v: repr(v)[:30])
def test_a_forward_never_carries_an_accumulate_flag(exc, accumulate, banned, counters):
    resent = isinstance(exc, TruncatedReply)
    table, client = SpyTable([[A, B]]), ScriptedClient(*[exc] * (1 + resent))
    caller = _caller(client, table)
    _, answered_by = _call(caller, "forward")
    assert answered_by == B
    assert client.calls == [(A, "forward", None)] * (1 + resent) + [(B, "forward", None)]
    assert table.is_banned(A) == banned
    assert _counted(caller, "timeouts connection_errors not_accumulated") == counters[:2] + (0,)


def test_a_call_sent_without_accumulating_is_not_counted_again():
    table, client = SpyTable([[A, B]]), ScriptedClient(TimeoutError())
    caller = _caller(client, table)
    _call(caller, accumulate=False)
    assert client.calls == [(A, "backward", False), (B, "backward", False)]
    assert caller.stats.not_accumulated == 0


def test_the_flag_is_cleared_once_and_stays_cleared():
    # A times out (flag cleared), B is refused before any work, either (both allowed again) answers
    table = SpyTable([[A, B]])
    client = ScriptedClient(TimeoutError(), RemoteError("unavailable", "busy"))
    caller = _caller(client, table, max_retries=5)
    _, answered_by = _call(caller)
    assert client.calls[:2] == [(A, "backward", None), (B, "backward", False)]
    assert client.calls[2] == (answered_by, "backward", False) and len(client.calls) == 3
    assert _counted(caller, "not_accumulated retries timeouts") == (1, 2, 1)


@pytest.mark.parametrize("code", ["bad_request", "too_large", "version", "unauthorized"])
def test_a_fatal_answer_fails_at_once(code):
    table, client = SpyTable([[A, B]]), ScriptedClient(RemoteError(code, "no"))
    caller = _caller(client, table)
    with pytest.raises(call_policy.MicroBatchFailed, match=f"refused the backward of .*{code}"):
        _call(caller)
    assert client.calls == [(A, "backward", None)] and caller.stats.retries == 0 and table.bans == []


@pytest.mark.parametrize("exc", [KeyError("bug"), ValueError("bug")])
def test_a_bug_is_raised_not_retried(exc):
    table, client = SpyTable([[A, B]]), ScriptedClient(exc)
    caller = _caller(client, table)
    with pytest.raises(type(exc)):
        _call(caller)
    assert len(client.calls) == 1 and caller.stats.retries == 0 and table.bans == []


def test_retries_are_bounded_and_every_peer_is_tried_again_once_all_failed():
    table = SpyTable([[A, B]])
    client = ScriptedClient(*(RemoteError("unavailable", "busy") for _ in range(10)))
    caller = _caller(client, table, max_retries=2)
    with pytest.raises(call_policy.MicroBatchFailed, match="3 attempts failed, last: .*unavailable"):
        _call(caller)
    peers = [peer for peer, _, _ in client.calls]
    assert peers[:2] == [A, B] and peers[2] in (A, B) and len(peers) == 3 and caller.stats.retries == 2


def test_a_persistent_call_keeps_trying_up_to_its_own_budget(monkeypatch):
    monkeypatch.setattr(stage_calls, "PERSISTENT_ATTEMPTS", 6)
    table = SpyTable([[A, B]])
    client = ScriptedClient(*(RemoteError("internal", "bug") for _ in range(10)))  # maybe applied, no ban
    caller = _caller(client, table, max_retries=1)
    with pytest.raises(call_policy.MicroBatchFailed, match="7 attempts failed, last: .*internal"):
        _call(caller, persistent=True)
    assert len(client.calls) == 7 and _counted(caller, "retries not_accumulated") == (6, 1)


def test_the_preferred_peer_gets_the_first_attempt_charged_nothing():
    table, client = SpyTable([[A, B]]), ScriptedClient()
    caller = _caller(client, table)
    for _ in range(3):
        assert _call(caller, prefer=B)[1] == B
    assert table.choices == [(0, 0.0, B)] * 3
    _call(caller, prefer=None)
    assert table.choices[-1][1] == 1.0  # no preference: the router's pick, charged the call's weight


def test_a_banned_preferred_peer_is_skipped():
    table, client = SpyTable([[A, B]]), ScriptedClient()
    table.ban(0, A)
    caller = _caller(client, table)
    assert _call(caller, prefer=A)[1] == B and client.calls == [(B, "backward", None)]


def test_the_retry_delay_backs_off_with_jitter(monkeypatch):
    monkeypatch.setattr(call_policy, "BACKOFF_BASE_S", 0.05)
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 2.0)
    for attempt, bound in ((1, 0.1), (2, 0.2), (3, 0.4), (10, 2.0), (30, 2.0)):
        delays = [call_policy.retry_delay_s(attempt) for _ in range(50)]
        assert all(0.5 * bound <= d <= 1.5 * bound for d in delays)


# chains -----------------------------------------------------------------------------------------------
def _chain_reply(peer, message):
    """Stage 0 (`peer`) and stage 1 (C) each accumulated the micro-batch if their flag asked it to."""
    flags = [message.header["accumulate"], *message.header["accumulate_after"]]
    hops = [
        {
            "stage": stage,
            "peer": p,
            "acc": 8 if flag else 0,
            "server_s": 0.1,
            "compute_s": 0.1,
            "step_wait_s": 0,
        }
        for stage, (p, flag) in enumerate(zip((peer, C), flags, strict=True))
    ]
    return Message("result", {"loss": 1.5, "hops": hops})


def _chain(client, table, **swarm):
    caller = _caller(client, table, **swarm)
    tokens = codec.encode(torch.zeros(2, 4, dtype=torch.int64), "none")
    chains = ChainCaller(caller, num_stages=2, digest="d", codec="none")
    loss, hops, grad = asyncio.run(chains.run("t.0-1", 0, 8, tokens, tokens))
    flags = [(m.header["accumulate"], *m.header["accumulate_after"]) for m in client.messages]
    return caller, loss, hops, flags


# failure of the chain's first stage-0 peer -> flags of the retry, that peer banned, counters
#   (timeouts, connection_errors, not_accumulated)
CHAIN_FAILURE = [
    (TimeoutError(), (False, False), False, (1, 0, 2)),
    (RemoteError("internal", "bug"), (False, False), False, (0, 0, 2)),
    (ConnectionResetError("gone"), (True, False), True, (0, 1, 1)),
    (RemoteError(NEXT_HOP_FAILED, "stage 1 gone"), (True, False), False, (0, 0, 1)),
    (RemoteError("digest_mismatch", "another run"), (True, True), True, (0, 0, 0)),
    (RemoteError("unavailable", "busy"), (True, True), False, (0, 0, 0)),
]


@pytest.mark.parametrize("exc,retry_flags,banned,counters", CHAIN_FAILURE, ids=lambda v: repr(v)[:30])
def test_a_chain_retry_clears_the_flags_of_the_stages_that_may_hold_the_micro_batch(
    exc, retry_flags, banned, counters
):
    table, client = SpyTable([[A, B], [C]]), ScriptedClient(exc, reply=_chain_reply)
    caller, loss, hops, flags = _chain(client, table)
    assert loss == 1.5 and flags == [(True, True), retry_flags]
    assert [hop.acc for hop in hops] == [8 if f else 0 for f in retry_flags]
    first = client.calls[0][0]
    assert table.is_banned(first) == banned and ((0, first) in table.bans) == banned
    assert _counted(caller, "timeouts connection_errors not_accumulated") == counters
    assert caller.stats.retries == 1
    assert ((0, first, TIMEOUT_S * 2) in table.reports) == isinstance(exc, TimeoutError)


def test_a_chain_whose_reply_was_cut_goes_to_the_same_peer_once_more_as_it_was():
    """Issue 57's 0-byte replies: the reply stream of a stage-0 peer that had run the chain ended empty
    (CI: the forged-steps test, 8 unconfirmed samples on the replica that had accumulated them). Every hop
    answers a copy of a micro-batch it accumulated as held without adding it again, so the same request,
    to the same peer and route, is counted once: flags unchanged, nothing retried without accumulating."""
    table, client = (
        SpyTable([[A, B], [C]]),
        ScriptedClient(TruncatedReply("0-byte reply"), reply=_chain_reply),
    )
    caller, loss, hops, flags = _chain(client, table)
    assert loss == 1.5 and flags == [(True, True), (True, True)]
    assert client.calls[0][0] == client.calls[1][0] and [hop.acc for hop in hops] == [8, 8]
    assert _counted(caller, "timeouts connection_errors not_accumulated") == (0, 0, 0)
    assert caller.stats.retries == 1 and table.bans == []
    # cut again: then as any reply that may have been applied, elsewhere and without accumulating
    table = SpyTable([[A, B], [C]])
    client = ScriptedClient(*[TruncatedReply("cut")] * 2, reply=_chain_reply)
    caller, loss, hops, flags = _chain(client, table)
    assert flags == [(True, True), (True, True), (False, False)] and [h.acc for h in hops] == [0, 0]
    assert client.calls[0][0] == client.calls[1][0] != client.calls[2][0]
    assert _counted(caller, "timeouts connection_errors not_accumulated") == (0, 0, 2)


def test_a_fatal_answer_fails_a_chain_at_once():
    table = SpyTable([[A, B], [C]])
    client = ScriptedClient(RemoteError("unauthorized", "no key"), reply=_chain_reply)
    with pytest.raises(call_policy.MicroBatchFailed, match="refused the chain"):
        _chain(client, table)
    assert len(client.calls) == 1


def test_a_peers_deadline_is_learned_and_every_call_may_take_the_request_timeout(monkeypatch):
    """Until MIN_CALLS answered, a peer's deadline is the request timeout; then it is its own (planner/
    deadlines.py), here the floor since it answers at once. The deadline only applies once the peer goes
    silent (runtime/trainer/hedging.py): every call itself may take the request timeout."""
    from swarmtrain.planner import deadlines

    monkeypatch.setattr(deadlines, "DEADLINE_FLOOR_S", 1.5)
    table, client = SpyTable([[A, B]]), ScriptedClient()
    caller = _caller(client, table)
    assert caller.peers.deadline_s(0, "backward", A, TIMEOUT_S) == TIMEOUT_S
    for _ in range(deadlines.MIN_CALLS + 1):
        _call(caller, prefer=A)
    assert client.timeouts_s == [TIMEOUT_S] * (deadlines.MIN_CALLS + 1)
    assert caller.peers.deadline_s(0, "backward", A, TIMEOUT_S) == 1.5 < TIMEOUT_S
    assert caller.peers.deadline_s(0, "backward", B, TIMEOUT_S) == TIMEOUT_S  # B's time is not known yet


def test_only_a_silent_peers_timeout_bans_it_as_frozen():
    """A call given up at a silent peer's deadline (`SilentPastDeadline`) bans it until it announces again;
    a call that ran out the request timeout while its peer answered pings does not."""
    for failure, banned in ((SilentPastDeadline("silent"), True), (TimeoutError(), False)):
        table, client = SpyTable([[A, B]]), ScriptedClient(failure)
        caller = _caller(client, table)
        assert _call(caller, prefer=A)[1] == B
        assert table.is_banned(A) == banned and caller.stats.timeouts == 1, failure


# frozen peers: pinged, banned, hedged (runtime/trainer/hedging.py) --------------------------------------
D = PeerID(bytes([0x12, 0x20]) + bytes([4]) * 32).to_base58()


class FreezableClient(ScriptedClient):
    """Peers in `frozen` answer nothing (calls and pings wait out their timeout), nor does a chain whose
    next hop is frozen; `slow` peers answer calls after `slow_s`, pings at once."""

    def __init__(self, frozen=(), slow=(), slow_s=0.0, reply=None):
        super().__init__(reply=reply)
        self.frozen, self.slow, self.slow_s = set(frozen), set(slow), slow_s

    async def call(self, peer_id, message, timeout_s):
        kind = message.kind
        peer = str(peer_id)
        self.calls.append((peer, kind, message.header.get("accumulate")))
        self.messages.append(message)
        waits_on_frozen = kind == "chain" and message.header["route"][0][0] in self.frozen
        if peer in self.frozen or waits_on_frozen:
            await asyncio.sleep(timeout_s)
            raise TimeoutError()
        if kind == "ping":
            return Message("result", {"epoch": 0})
        if peer in self.slow:  # as the real client: past `timeout_s`, the call times out
            await asyncio.sleep(min(self.slow_s, timeout_s))
            if self.slow_s > timeout_s:
                raise TimeoutError()
        return self.reply(peer, message)


def _acc_reply(peer, message):
    return Message("result", {"acc": 8 if message.header.get("accumulate", True) else 0})


def _routed_chain_reply(peer, message):
    """Stage 0 (`peer`) and the route's first stage-1 peer accumulated if their flags asked."""
    flags = [message.header["accumulate"], *message.header["accumulate_after"]]
    peers = (peer, message.header["route"][0][0])
    hops = [
        {"stage": s, "peer": p, "acc": 8 if f else 0, "server_s": 0.1, "compute_s": 0.1, "step_wait_s": 0}
        for s, (p, f) in enumerate(zip(peers, flags, strict=True))
    ]
    return Message("result", {"loss": 1.5, "hops": hops})


@pytest.fixture
def quick_checks(monkeypatch):
    """Ping a silent call's peers after 50 ms, and give a ping 50 ms."""
    from swarmtrain.planner import deadlines

    monkeypatch.setattr(deadlines, "UNMEASURED_CHECK_S", 0.05)
    monkeypatch.setattr(deadlines, "PING_TIMEOUT_FLOOR_S", 0.05)


def test_a_frozen_peer_is_banned_and_its_call_hedged_on_another_replica_without_accumulating(quick_checks):
    table, client = SpyTable([[A, B]]), FreezableClient(frozen={A}, reply=_acc_reply)
    caller = _caller(client, table)
    reply, answered_by = _call(caller, "backward", prefer=A)
    assert answered_by == B and reply.header["acc"] == 0  # the copy accumulated nothing
    assert client.calls == [(A, "backward", None), (A, "ping", None), (B, "backward", False)]
    assert table.is_banned(A) and table.bans == [(0, A)]
    assert _counted(caller, "frozen hedges hedges_won timeouts retries") == (1, 1, 1, 0, 0)
    assert table.reports == []  # a hedge's time measures nobody's usual time


def test_a_hedged_forward_is_an_ordinary_copy(quick_checks):
    table, client = SpyTable([[A, B]]), FreezableClient(frozen={A}, reply=_acc_reply)
    _, answered_by = _call(_caller(client, table), "forward", prefer=A)
    assert answered_by == B and client.calls[-1] == (B, "forward", None)


def test_a_busy_peer_that_answers_pings_is_waited_for_and_never_hedged(quick_checks):
    table, client = SpyTable([[A, B]]), FreezableClient(slow={A}, slow_s=0.3, reply=_acc_reply)
    caller = _caller(client, table)
    reply, answered_by = _call(caller, "backward", prefer=A)
    assert answered_by == A and reply.header["acc"] == 8
    pings = [c for c in client.calls if c[1] == "ping"]
    assert len(pings) >= 2 and {c[0] for c in pings} == {A}
    assert not table.bans and _counted(caller, "frozen hedges") == (0, 0)


def _measured(caller, peer, kind, call_s, stage=0):
    for _ in range(deadlines.MIN_CALLS):
        caller.peers.observe(stage, kind, peer, call_s)


def test_a_peer_slower_than_its_deadline_that_answers_pings_is_waited_for(quick_checks, monkeypatch):
    """The link fleet with fp32 sums (bench/rebalance_live.py): the only stage-0 replica's chains waited
    4-6 s at stage 1 for its step's exchange, past the replica's 5 s deadline, and each was retried
    without accumulating. A peer that answers pings is waited for up to the request timeout: one call,
    no retry, no ban."""
    monkeypatch.setattr(deadlines, "DEADLINE_FLOOR_S", 0.1)
    table, client = SpyTable([[A]]), FreezableClient(slow={A}, slow_s=0.4, reply=_acc_reply)
    caller = _caller(client, table)
    _measured(caller, A, "backward", 0.01)
    assert caller.peers.deadline_s(0, "backward", A, TIMEOUT_S) == 0.1
    reply, answered_by = _call(caller, "backward", prefer=A)
    assert answered_by == A and reply.header["acc"] == 8
    assert [c for c in client.calls if c[1] == "backward"] == [(A, "backward", None)]
    assert not table.bans and _counted(caller, "timeouts retries not_accumulated") == (0, 0, 0)


def test_a_chain_slower_than_its_deadline_whose_peers_answer_pings_is_waited_for(quick_checks, monkeypatch):
    """The same for a chain (the trainer's default hand-off): no retry, every stage accumulates."""
    monkeypatch.setattr(deadlines, "DEADLINE_FLOOR_S", 0.1)
    table = SpyTable([[A], [C]])
    client = FreezableClient(slow={A}, slow_s=0.4, reply=_routed_chain_reply)
    caller = _caller(client, table)
    _measured(caller, A, "chain", 0.01)
    tokens = codec.encode(torch.zeros(2, 4, dtype=torch.int64), "none")
    chains = ChainCaller(caller, num_stages=2, digest="d", codec="none")
    loss, hops, _ = asyncio.run(chains.run("t.0-1", 0, 8, tokens, tokens))
    assert loss == 1.5 and [(h.peer, h.acc) for h in hops] == [(A, 8), (C, 8)]
    assert _chain_flags(client) == [(True, True)] and not table.bans
    assert _counted(caller, "timeouts retries hedges") == (0, 0, 0)


def test_a_silent_peer_nobody_can_replace_is_given_up_at_its_deadline(quick_checks, monkeypatch):
    """No other replica to take a copy: the silent peer's call ends at its deadline, not at the request
    timeout, and the peer is banned as frozen."""
    monkeypatch.setattr(deadlines, "DEADLINE_FLOOR_S", 0.3)
    table, client = SpyTable([[A]]), FreezableClient(frozen={A}, reply=_acc_reply)
    caller = _caller(client, table)
    _measured(caller, A, "backward", 0.01)
    took_s = _given_up_after_s(caller, call_policy.Attempt(A, 0.3, TIMEOUT_S))
    assert 0.3 <= took_s < TIMEOUT_S
    assert client.calls[0] == (A, "backward", True) and (A, "ping", None) in client.calls


def test_a_silent_peer_never_measured_is_given_up_at_the_floor_not_the_request_timeout(
    quick_checks, monkeypatch
):
    """A replica that went silent before its calls were measured: its deadline is the whole request
    timeout, but once pings say it is silent the call ends at the floor (netbed chaos: a fresh replica
    whose link was cut held every chain for 20 s)."""
    monkeypatch.setattr(deadlines, "DEADLINE_FLOOR_S", 0.3)
    table, client = SpyTable([[A]]), FreezableClient(frozen={A}, reply=_acc_reply)
    caller = _caller(client, table)
    attempt = call_policy.Attempt(A, TIMEOUT_S, TIMEOUT_S)  # what an unmeasured peer's deadline is
    assert 0.3 <= _given_up_after_s(caller, attempt) < TIMEOUT_S / 2


def _given_up_after_s(caller, attempt) -> float:
    """Seconds until a backward to the silent peer A raises `SilentPastDeadline`."""
    message = Message("backward", {"mb": "t.0-1", "accumulate": True})

    async def hedged():
        start_s = asyncio.get_running_loop().time()
        with pytest.raises(SilentPastDeadline):
            await caller.hedged(0, message, attempt, 8, 1.0)
        return asyncio.get_running_loop().time() - start_s

    return asyncio.run(hedged())


def _hedged_chain(client, table):
    caller = _caller(client, table)
    tokens = codec.encode(torch.zeros(2, 4, dtype=torch.int64), "none")
    chains = ChainCaller(caller, num_stages=2, digest="d", codec="none")
    loss, hops, _ = asyncio.run(chains.run("t.0-1", 0, 8, tokens, tokens))
    return caller, loss, hops


def _chain_flags(client):
    return [
        (m.header["accumulate"], *m.header["accumulate_after"]) for m in client.messages if m.kind == "chain"
    ]


def test_a_chain_whose_stage_0_peer_is_frozen_is_hedged_on_the_other_accumulating_nothing(quick_checks):
    table, client = SpyTable([[A, B], [C]]), FreezableClient(frozen={A}, reply=_routed_chain_reply)
    caller, loss, hops = _hedged_chain(client, table)
    assert loss == 1.5 and [(h.peer, h.acc) for h in hops] == [(B, 0), (C, 0)]
    assert _chain_flags(client) == [(True, True), (False, False)]
    pinged = {c[0] for c in client.calls if c[1] == "ping"}
    assert pinged == {A, C} and table.bans == [(0, A)]
    assert _counted(caller, "frozen hedges hedges_won timeouts") == (1, 1, 1, 0)


def test_a_chain_waiting_on_a_frozen_later_stage_is_hedged_on_a_route_around_it(quick_checks):
    table = SpyTable([[A], [C, D]])
    client = FreezableClient(frozen={C}, reply=_routed_chain_reply)
    table.choose(1, 8, 1e6, exclude={C})  # D charged a lot: the first route goes through C
    _, loss, hops = _hedged_chain(client, table)
    first, copy = [m for m in client.messages if m.kind == "chain"]
    assert first.header["route"][0][0] == C and copy.header["route"] == [[D]]
    assert [(h.peer, h.acc) for h in hops] == [(A, 0), (D, 0)]  # the live stage-0 peer carried the copy
    assert table.bans == [(1, C)] and not table.is_banned(A)


# a step every replica already applied ------------------------------------------------------------------
def test_a_call_every_live_peer_answers_stale_fails_at_once():
    """Every replica of the stage is past the micro-batch's step: no retry can run it for that step."""
    stale = [RemoteError("stale", "step 3 is already applied here (at 4)") for _ in range(2)]
    table, client = SpyTable([[A, B]]), ScriptedClient(*stale)
    with pytest.raises(call_policy.MicroBatchFailed, match="applied the step of t.0-1 without it"):
        _call(_caller(client, table, max_retries=10), "backward")
    assert [c[0] for c in client.calls] == [A, B]


def test_a_chain_every_stage_0_peer_answers_stale_fails_at_once():
    stale = [RemoteError("stale", "step 3 is already applied here (at 4)") for _ in range(2)]
    table, client = SpyTable([[A, B], [C]]), ScriptedClient(*stale, reply=_chain_reply)
    with pytest.raises(call_policy.MicroBatchFailed, match="without it"):
        _chain(client, table, max_retries=10)
    assert sorted(c[0] for c in client.calls) == sorted([A, B])


def test_a_banned_peer_that_answers_a_ping_again_is_unbanned_a_silent_one_is_not():
    table, client = SpyTable([[A, B], [C]]), FreezableClient(frozen={B})
    caller = _caller(client, table)
    for stage, peer in ((0, A), (0, B), (1, C)):
        table.ban(stage, peer)
    asyncio.run(caller.recheck_banned())
    assert not table.is_banned(A) and not table.is_banned(C) and table.is_banned(B)
    assert sorted(table.available(0)) == [A] and table.available(1) == [C]
    assert sorted(c[0] for c in client.calls if c[1] == "ping") == sorted([A, B, C])


# a chain from a later stage: the trainer relayed the stages before it ---------------------------------
D, E = (PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32).to_base58() for i in (4, 5))


def _nat_table(peers_per_stage, natted):
    table = SpyTable([[] for _ in peers_per_stage])
    table.apply(
        [{p: _ann_nat(stage, p in natted) for p in peers} for stage, peers in enumerate(peers_per_stage)]
    )
    return table


def _ann_nat(stage, behind_nat):
    ann = _ann(stage)
    ann.behind_nat = behind_nat
    return ann


def test_a_chain_from_stage_1_reports_stages_1_on_and_returns_the_input_gradient():
    table = _nat_table([[A], [B], [C]], natted=set())
    grad = codec.encode(torch.ones(2, 4, 3), "none")

    def reply(peer, message):
        assert message.header["stage"] == 1 and message.header["route"] == [[C]]
        hops = [
            {"stage": s, "peer": p, "acc": 8, "server_s": 0.1, "compute_s": 0.1, "step_wait_s": 0}
            for s, p in ((1, peer), (2, C))
        ]
        return Message("result", {"loss": 2.5, "hops": hops}, {"grad_inputs": grad})

    client = ScriptedClient(reply=reply)
    chains = ChainCaller(_caller(client, table), num_stages=3, digest="d", codec="none")
    hidden = codec.encode(torch.zeros(2, 4, 3), "none")
    labels = codec.encode(torch.zeros(2, 4, dtype=torch.int64), "none")
    loss, hops, got = asyncio.run(chains.run("t.0-1", 0, 8, hidden, labels, first=1))
    assert client.calls == [(B, "chain", True)]
    assert (loss, [(h.stage, h.peer) for h in hops], got) == (2.5, [(1, B), (2, C)], grad)
    assert len(client.messages[0].header["accumulate_after"]) == 1  # stage 2's flag only


def test_a_route_leaves_out_peers_the_previous_one_cannot_hand_off_to_while_others_remain():
    table = _nat_table([[A], [B, D], [C, E]], natted={A, B, C})
    chains = ChainCaller(_caller(ScriptedClient(), table), num_stages=3, digest="d", codec="none")
    # A is behind a NAT: stage 1 must be D (public); after D anyone goes, C first by insertion order
    route = asyncio.run(chains._route(8, 0, A))
    assert route[0] == [D] and set(route[1]) == {C, E}
    # after a public head nothing is left out
    assert set(asyncio.run(chains._route(8, 0, D))[0]) == {B, D}
    # no public peer at stage 2: the NAT'd ones stay (the trainer relays that boundary instead)
    only_natted = _nat_table([[A], [B], [C]], natted={A, B, C})
    chains = ChainCaller(_caller(ScriptedClient(), only_natted), num_stages=3, digest="d", codec="none")
    assert asyncio.run(chains._route(8, 0, A)) == [[B], [C]]
