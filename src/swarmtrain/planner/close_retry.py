"""When a trainer stops retrying a step's close to one replica: a pure rule (runtime/trainer/close_calls.py
sends the closes; tests/unit/test_close_delivery.py).

A close is retried on transport failures because a replica that never hears its step's close cannot apply
the step (with one replica there is nobody to resync from), and a live replica can be unreachable for a
while: behind a NAT until its relay is reserved, seconds after it announced itself ("failed to dial");
frozen (SIGSTOP: its daemon takes the call, nothing answers, the attempt times out); cut off for a few
seconds. So a close is retried until `retry_s` after it was first sent.

A killed replica used to be retried just as long, for every step it was still sent closes of (a trainer
keeps a lapsed peer in its view for LAPSE_GRACE_S), and a trainer that evaluates after training waits for
its closes up to `retry_s`: the demo, which kills a replica, spent ~30 s after training on them. A dead peer
differs from a live unreachable one in two things at once: its last attempt could not connect (a
connection error, the failure table's GONE; a frozen peer's attempt times out instead), and the DHT no
longer lists it (a live replica announces itself every announce period, one behind a NAT included, and
a leaving one says "offline"). Once both hold, after the DHT has not listed it for `unlisted_give_up_s`
(a few announce periods: one failed DHT read, which lists nobody, is not enough), its close is given up.
A replica that was only cut off that long catches up from its stage peers or the closes of later steps
(planner/catch_up.py), as one cut off for longer than `retry_s` always had to. A peer the DHT never listed
to us (a member we do not know of yet) gives no such evidence: its close is retried the whole `retry_s`.
"""

from __future__ import annotations

# how long, in announce periods, a peer that cannot be connected to must have gone unlisted in the DHT
# before its close is given up: its record lapses three periods after its last store (ANNOUNCE_TTL_PERIODS),
# and a DHT read that fails lists nobody, so a few missed reads are no evidence of death
UNLISTED_PERIODS = 5
UNLISTED_MIN_S = 5.0  # with a short announce period: a second of failed DHT reads is no evidence either


def unlisted_give_up_s(announce_period_s: float) -> float:
    """How long the DHT must not have listed an unreachable peer before its close is given up."""
    return max(UNLISTED_MIN_S, UNLISTED_PERIODS * announce_period_s)


def gives_up_close(
    now_s: float,
    until_s: float,
    delay_s: float,
    unreachable: bool,
    unlisted_s: float | None,
    give_up_s: float,
) -> bool:
    """Whether a close whose last attempt failed is not sent again: its retry, due `delay_s` after `now_s`,
    would come past `until_s` (the close's whole retry time), or its peer looks dead: the last attempt
    could not connect to it (`unreachable`) and the DHT has not listed it for `unlisted_s` >= `give_up_s`
    (None: the DHT never listed it to us, no evidence)."""
    if now_s + delay_s > until_s:
        return True
    return unreachable and unlisted_s is not None and unlisted_s >= give_up_s
