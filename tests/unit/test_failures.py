"""The failure table every retry loop shares (net/failures.py): each failure's outcome, ban and timeout
charge, and what each outcome does to the accumulate flags (at most once per stage)."""

import pytest
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from swarmtrain.net.failures import (
    FATAL_CODES,
    NEVER_RAN_CODES,
    NEXT_HOP_FAILED,
    FailureAction,
    Outcome,
    classify_failure,
    flags_after,
    on_request_failure,
)
from swarmtrain.net.transport import RemoteError, TruncatedReply

pytestmark = pytest.mark.unit

NEVER_RAN, GONE, NEXT_FAILED, MAYBE, FATAL = (
    Outcome.NEVER_RAN,
    Outcome.GONE,
    Outcome.NEXT_FAILED,
    Outcome.MAYBE_APPLIED,
    Outcome.FATAL,
)

TABLE = [
    # our request is wrong, or we may not ask
    (RemoteError("bad_request", "x"), FailureAction(FATAL)),
    (RemoteError("too_large", "x"), FailureAction(FATAL)),
    (RemoteError("version", "x"), FailureAction(FATAL)),
    (RemoteError("unauthorized", "x"), FailureAction(FATAL)),
    # refused before any work
    (RemoteError("unavailable", "leaving"), FailureAction(NEVER_RAN)),
    (RemoteError("timeout", "queue"), FailureAction(NEVER_RAN)),
    (RemoteError("stale", "applied"), FailureAction(NEVER_RAN)),
    (RemoteError("digest_mismatch", "another run"), FailureAction(NEVER_RAN, ban=True)),
    # a hop applied nothing, the stages after it may have
    (RemoteError(NEXT_HOP_FAILED, "stage 1 gone"), FailureAction(NEXT_FAILED)),
    # a handler failed, maybe after applying; a code we do not know: assume the worst
    (RemoteError("internal", "bug"), FailureAction(MAYBE)),
    (RemoteError("error", "no code in the answer"), FailureAction(MAYBE)),
    (RemoteError("something_new", "x"), FailureAction(MAYBE)),
    # silent, or cut off after answering (a TimeoutError is an OSError, a TruncatedReply a ConnectionError)
    (TimeoutError(), FailureAction(MAYBE, timed_out=True)),
    (TruncatedReply("cut"), FailureAction(MAYBE, resend=True)),
    # gone
    (ConnectionResetError(), FailureAction(GONE, ban=True)),
    (ConnectionRefusedError(), FailureAction(GONE, ban=True)),
    (EOFError(), FailureAction(GONE, ban=True)),
    (OSError("no route"), FailureAction(GONE, ban=True)),
    (P2PDaemonError("daemon"), FailureAction(GONE, ban=True)),
]


@pytest.mark.parametrize("exc,action", TABLE, ids=lambda v: repr(v)[:40] if isinstance(v, Exception) else "")
def test_each_failure_has_its_outcome_and_action(exc, action):
    assert on_request_failure(exc) == action
    assert classify_failure(exc) is action.outcome


def test_the_table_covers_every_known_code():
    codes = {exc.code for exc, _ in TABLE if isinstance(exc, RemoteError)}
    assert set(FATAL_CODES) | set(NEVER_RAN_CODES) | {NEXT_HOP_FAILED, "internal"} <= codes


@pytest.mark.parametrize("exc", [KeyError("x"), ValueError("x"), P2PHandlerError("the peer answered")])
def test_a_bug_is_not_a_failure_of_the_peer(exc):
    with pytest.raises(type(exc)):
        on_request_failure(exc)
    with pytest.raises(type(exc)):
        classify_failure(exc)


def test_flags_after_a_failure_never_let_a_stage_apply_twice():
    flags = [True, True, True]
    assert flags_after(flags, NEVER_RAN) == flags
    # the called peer is gone with its accumulator; later stages may hold the micro-batch
    assert flags_after(flags, GONE) == [True, False, False]
    assert flags_after(flags, NEXT_FAILED) == [True, False, False]
    assert flags_after(flags, MAYBE) == [False, False, False]
    assert flags_after([False, True], NEVER_RAN) == [False, True]  # False stays False
    assert flags_after([False, True], GONE) == [False, False]
    # a relayed call has one flag: only a maybe-applied failure clears it
    relayed = {o: flags_after([True], o) for o in Outcome if o is not FATAL}
    assert relayed == {NEVER_RAN: [True], GONE: [True], NEXT_FAILED: [True], MAYBE: [False]}


def test_flags_after_does_not_change_its_argument():
    flags = [True, True]
    flags_after(flags, MAYBE)
    assert flags == [True, True]


def test_a_cut_reply_is_resent_to_its_peer_once_and_nothing_else_is():
    from swarmtrain.net.failures import resend_once

    resent: set[str] = set()
    cut, timed_out = on_request_failure(TruncatedReply("cut")), on_request_failure(TimeoutError())
    assert resend_once(cut, "peer-a", resent) and resent == {"peer-a"}
    assert not resend_once(cut, "peer-a", resent)  # cut twice: another peer gets it
    assert resend_once(cut, "peer-b", resent)
    assert not resend_once(timed_out, "peer-c", resent) and "peer-c" not in resent
