"""What a failed call to a stage peer means: one pure table every retry loop shares (the trainer's
relayed calls, its chains, a chain hop's call to the next stage).

`on_request_failure(exc)` says what the failure tells about the called stage and the stages after it
(`Outcome`) and what the caller does about the peer: ban it (gone, or serving another run), and whether
it kept us waiting the whole timeout (charged to its throughput). The trainer also bans a peer that was
silent past its own deadline (planner/deadlines.py), shorter than the request timeout: it is treated as
frozen until it announces itself again. `flags_after` turns the outcome into
the accumulate flags of the retry, so a stage applies each micro-batch at most once, whoever retries.

| failure                                                        | outcome       | ban | timed out |
| -------------------------------------------------------------- | ------------- | --- | --------- |
| RemoteError `bad_request` `too_large` `version` `unauthorized` | FATAL         | no  | no        |
| RemoteError `unavailable` `timeout` `stale`                    | NEVER_RAN     | no  | no        |
| RemoteError `digest_mismatch`                                  | NEVER_RAN     | yes | no        |
| RemoteError `next_hop_failed`                                  | NEXT_FAILED   | no  | no        |
| RemoteError `internal` (or a code not above)                   | MAYBE_APPLIED | no  | no        |
| TimeoutError                                                   | MAYBE_APPLIED | no  | yes       |
| TruncatedReply (the peer answered before): resent once as is  | MAYBE_APPLIED | no  | no        |
| connection error (`is_connection_error`)                       | GONE          | yes | no        |
| anything else: a bug, not a failure of the peer                | re-raised     |     |           |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from swarmtrain.net.transport import RemoteError, TruncatedReply, is_connection_error

# our request is wrong (or we may not ask): no retry can help
FATAL_CODES = ("bad_request", "too_large", "version", "unauthorized")
# answers that say the request never ran there (nothing applied): another peer may take it as it is
NEVER_RAN_CODES = ("unavailable", "timeout", "stale", "digest_mismatch")
# the peer runs another model, stage cut or optimizer though it announced ours: ban it until it re-announces
BAN_CODES = ("digest_mismatch",)
# a hop's answer when no candidate of the next stage completed: the hop applied nothing, later stages may
NEXT_HOP_FAILED = "next_hop_failed"


class Outcome(Enum):
    """What a failed call says about the called stage and the stages after it."""

    NEVER_RAN = "never_ran"  # refused before any work (busy, leaving, stale, wrong run): nothing applied
    GONE = "gone"  # the peer is unreachable: whatever it accumulated died with it; later stages may have
    NEXT_FAILED = "next_failed"  # the peer applied nothing, the stages after it may have
    MAYBE_APPLIED = "maybe_applied"  # silent or cut off: the peer and every later stage may have applied
    FATAL = "fatal"  # our request is wrong (or we may not ask): no retry can help


@dataclass(frozen=True)
class FailureAction:
    """A failed call's `outcome` and what the caller does about the peer: `ban` it until it
    re-announces; `timed_out`: it kept us waiting the whole timeout (fold that into its throughput);
    `resend`: the same request may go to the same peer once more as it is (see `on_request_failure`)."""

    outcome: Outcome
    ban: bool = False
    timed_out: bool = False
    resend: bool = False


def resend_once(failure: FailureAction, peer: str, resent: set[str]) -> bool:
    """Whether the failed request goes to `peer` again as it was: a cut reply (`resend`), at most once per
    peer and request (`resent`, updated): a peer whose replies keep being cut is left for another."""
    if not failure.resend or peer in resent:
        return False
    resent.add(peer)
    return True


def on_request_failure(exc: BaseException) -> FailureAction:
    """The row of the module's table for `exc`; re-raises `exc` if it is no failure of the peer."""
    if isinstance(exc, RemoteError):
        return FailureAction(_remote_outcome(exc.code), ban=exc.code in BAN_CODES)
    if isinstance(exc, TimeoutError):  # before the connection errors: a TimeoutError is an OSError
        return FailureAction(Outcome.MAYBE_APPLIED, timed_out=True)
    if isinstance(exc, TruncatedReply):  # a ConnectionError, but the peer answered: no ban
        # its reply stream ended early (libp2p closed it; issue 57's 0-byte replies) after the peer may
        # have accumulated the micro-batch. Every hop keeps the ids it accumulated in the step's bucket
        # and answers a copy as held without adding it again (`StageWorker.skip_reason`), so the same
        # request to the same peer (the same route) is counted once wherever the first one got
        return FailureAction(Outcome.MAYBE_APPLIED, resend=True)
    if is_connection_error(exc):
        return FailureAction(Outcome.GONE, ban=True)
    raise exc  # a bug, not a failure of the peer


def classify_failure(exc: BaseException) -> Outcome:
    """`on_request_failure(exc).outcome`."""
    return on_request_failure(exc).outcome


def _remote_outcome(code: str) -> Outcome:
    if code in FATAL_CODES:
        return Outcome.FATAL
    if code == NEXT_HOP_FAILED:
        return Outcome.NEXT_FAILED
    # `internal` (a handler failed, maybe after applying) and codes we do not know: assume the worst
    return Outcome.NEVER_RAN if code in NEVER_RAN_CODES else Outcome.MAYBE_APPLIED


def flags_after(flags: list[bool], outcome: Outcome) -> list[bool]:
    """Accumulate flags for the retry of a call that failed with `outcome`: `flags[0]` is the called
    stage's, the rest are the later stages'. A flag that is False stays False."""
    if outcome is Outcome.NEVER_RAN:
        return list(flags)
    if outcome in (Outcome.GONE, Outcome.NEXT_FAILED):
        return [flags[0]] + [False] * (len(flags) - 1)
    return [False] * len(flags)
