"""How long a trainer waits for one peer before treating it as frozen: a deadline from that peer's own
call times, not the run's fixed request timeout.

A frozen peer (SIGSTOP, a laptop lid, a partition: its sockets stay open and nothing answers) is only
noticed when a call to it times out. With the fixed `swarm.request_timeout_s` (30 s) every micro-batch
sent to it would wait 30 s, its step could not close meanwhile, and the whole swarm would complete
nothing for as long (a 20 s SIGSTOP of one stage-0 replica: 20.0 s without a completed micro-batch).
A peer's usual time is known: every completed call measures it. The deadline is a generous multiple of
it, so a healthy peer on a noisy machine almost never exceeds it, and a silent one is given up on in a
few seconds (never less than `DEADLINE_FLOOR_S`, never more than the request timeout).

The estimate is an exponentially weighted mean and variance of the whole call time (queueing for the
previous step's parameters included: it is part of what a call normally takes). Until `MIN_CALLS`
calls were measured the request timeout applies.

Long before that deadline a caller asks a peer that is past its usual time whether it is alive
(`check_after_s`): a `ping` its event loop answers at once however busy its compute thread is
(`ping_timeout_s`). A silent peer is frozen: the call is hedged on another replica
(runtime/trainer/hedging.py). A peer that answers the ping is only slow (a long step wait, a busy
core) and is waited for, up to the request timeout, so a noisy machine costs no work; that is why the
check can come this early while the deadline keeps its generous floor. The deadline thus ends only the
call of a peer that went silent and that no other replica could take over.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.1  # ~the last 20 calls
MIN_CALLS = 8
DEADLINE_FLOOR_S = 5.0  # a short hiccup (GC, a busy core, a step's exchange) is never taken for a freeze
DEADLINE_RATIO = 4.0  # x the mean call time
DEADLINE_SPREAD = 6.0  # standard deviations above the mean
CHECK_FLOOR_S = 0.5  # the earliest a silent call makes us ping its peer
CHECK_RATIO = 2.0  # x the mean call time
CHECK_SPREAD = 3.0  # standard deviations above the mean
UNMEASURED_CHECK_S = 1.0  # before MIN_CALLS calls were measured
# a ping is a few milliseconds on a LAN; on a slow link it may queue behind a transfer on the same
# connection, so it is given at least as long as the peer's usual call
PING_TIMEOUT_FLOOR_S = 1.0
EXCHANGE_PING_RATIO = 2.0  # a stage ping queues behind one exchange each way (`exchange_ping_timeout_s`)
# before a stage peer's first exchange is timed: a slow link's rate (the test bed's slow links are 4 Mbit/s)
UNMEASURED_EXCHANGE_BYTES_PER_S = 2e6 / 8


@dataclass(frozen=True)
class CallTimes:
    """One peer's call times for one kind of call: an exponentially weighted mean and variance."""

    mean_s: float = 0.0
    var_s2: float = 0.0
    calls: int = 0

    def observed(self, call_s: float) -> CallTimes:
        if self.calls == 0:
            return CallTimes(call_s, 0.0, 1)
        delta = call_s - self.mean_s
        mean = self.mean_s + EWMA_WEIGHT * delta
        var = (1 - EWMA_WEIGHT) * (self.var_s2 + EWMA_WEIGHT * delta * delta)
        return CallTimes(mean, var, self.calls + 1)


def deadline_s(times: CallTimes | None, cap_s: float) -> float:
    """How long to wait for the next call to this peer: `cap_s` (the request timeout) until enough calls
    were measured, else max(floor, ratio x mean, mean + spread x std), at most `cap_s`."""
    if times is None or times.calls < MIN_CALLS:
        return cap_s
    usual_s = max(DEADLINE_RATIO * times.mean_s, times.mean_s + DEADLINE_SPREAD * times.var_s2**0.5)
    return min(cap_s, max(DEADLINE_FLOOR_S, usual_s))


def silent_deadline_s(times: CallTimes | None, wait_s: float) -> float:
    """How long after its start a call whose peer went silent (answers no ping) is given up: its
    deadline `wait_s` once the peer's calls were measured; before that, `DEADLINE_FLOOR_S` at most.
    Without that cap an unmeasured peer's deadline is the whole request timeout: a fresh replica whose
    link is cut holds every chain through it for that long while it answers no ping (docs/LOG.md)."""
    if times is None or times.calls < MIN_CALLS:
        return min(wait_s, DEADLINE_FLOOR_S)
    return wait_s


def check_after_s(times: CallTimes | None, cap_s: float) -> float:
    """How long a call to this peer runs before we ask whether the peer is alive (and again every as
    long while it runs): max(floor, ratio x mean, mean + spread x std), at most `cap_s`."""
    if times is None or times.calls < MIN_CALLS:
        return min(cap_s, UNMEASURED_CHECK_S)
    usual_s = max(CHECK_RATIO * times.mean_s, times.mean_s + CHECK_SPREAD * times.var_s2**0.5)
    return min(cap_s, max(CHECK_FLOOR_S, usual_s))


def ping_timeout_s(times: CallTimes | None) -> float:
    """How long a peer's event loop may take to answer a ping before the peer is taken for frozen."""
    return max(PING_TIMEOUT_FLOOR_S, times.mean_s if times is not None else 0.0)


def exchange_ping_timeout_s(times: CallTimes | None, sums_bytes: int = 0) -> float:
    """How long a stage peer may take to answer a ping before it is taken for frozen, from its step
    exchanges (`times`: the calls that sent it our gradient sums). A ping shares one libp2p connection
    with the sums: on a slow link it waits behind ours on the way there and behind the peer's on the
    way back. With the floor alone, replicas behind 4 Mbit/s links take each other for frozen several
    times a run and step without each other's sums (bench/rebalance_live.py --fleet link). Before the
    first exchange with the peer is timed, its size (`sums_bytes`, ours) at a slow link's rate: with the
    floor there, fp32 sums (1 MB on `tiny`) make every new member of a stage behind 4 Mbit/s look frozen
    at its first step, and the stage resyncs after the partial exchange."""
    if times is None:
        unmeasured_s = EXCHANGE_PING_RATIO * sums_bytes / UNMEASURED_EXCHANGE_BYTES_PER_S
        return max(PING_TIMEOUT_FLOOR_S, unmeasured_s)
    usual_s = times.mean_s + CHECK_SPREAD * times.var_s2**0.5
    return max(PING_TIMEOUT_FLOOR_S, EXCHANGE_PING_RATIO * usual_s)


def reply_ping_timeout_s(times: CallTimes | None, sums_bytes: int, reply_bytes: int) -> float:
    """How long a stage peer may take to answer a ping while it sends us a reply of `reply_bytes`
    (a step's mean gradients, fp32) on the connection the ping shares: `exchange_ping_timeout_s` scaled
    by how much larger the reply is than the sums our exchanges with it sent (8-bit sums are a quarter
    of the means), or, before any sums were sent, the reply's own size at a slow link's rate. Sized for
    the sums alone, a live donor on a 4 Mbit/s link looked frozen on every replay from it."""
    if sums_bytes <= 0:
        return exchange_ping_timeout_s(None, reply_bytes)
    return exchange_ping_timeout_s(times, sums_bytes) * max(1.0, reply_bytes / sums_bytes)
