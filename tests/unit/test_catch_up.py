"""The lag rule (planner/catch_up.py) on data: what a replica behind its stage does at a sync tick."""

import dataclasses

import pytest

from swarmtrain.planner.catch_up import (
    ADOPT,
    ASK,
    READ,
    REPLAY,
    RESYNC,
    WAIT,
    CatchUp,
    Heard,
    LagRule,
    LagView,
    Stuck,
    SwarmAhead,
    decide_catch_up,
    evidence_ttl_s,
    left_behind,
    trails_stage,
)

pytestmark = pytest.mark.unit

RULE = LagRule(
    lag_grace_s=3.0, evidence_ttl_s=120.0, window=4, keep_ahead=4, max_replay=64, close_timeout_s=10.0
)
NOW = 1000.0
EPOCH = 10


def _view(**fields) -> LagView:
    return LagView(**{"epoch": EPOCH, "own_samples": 0, "now_s": NOW, **fields})


def _trusted(step, age_s=1.0) -> SwarmAhead:
    close = Heard(step, NOW - age_s)
    return SwarmAhead(step, close, close, step)


def _stranger(step, age_s=1.0) -> SwarmAhead:
    return SwarmAhead(step, Heard(step, NOW - age_s), None)


LONG_AGO = NOW - 60.0  # the replica has been at its epoch this long
REPLAY_DHT = "peers are {} step(s) ahead (we are at 10)"
REPLAY_ASKED = "peers are {} step(s) ahead (we are at 10; asked directly)"
STUCK = Stuck(NOW - 3.0, NOW - 3.0, frozenset("A"))  # a vouched trainer's close of step 10 naming A, 3 s ago
STUCK_REPLAY = "peers applied step 10, whose close came here 3 s ago"
DIVERGED = "parameters diverged from a peer after a partial exchange"

CASES = [
    # (what, view, decision)
    ("nothing heard: read the records first", _view(), CatchUp(READ)),
    ("records show nobody ahead, stepping", _view(recorded={"A": 10}, epoch_since_s=NOW), CatchUp(WAIT)),
    (
        "records show nobody ahead, no step for the lag grace: look at the other stages",
        _view(recorded={"A": 10}, epoch_since_s=LONG_AGO),
        CatchUp(ADOPT),
    ),
    (
        "a restored replica looks at the other stages at once",
        _view(recorded={}, fresh_state=True, epoch_since_s=NOW),
        CatchUp(ADOPT),
    ),
    (
        "a peer a step ahead: exchanges finish ms apart, the lag clock starts",
        _view(recorded={"A": 11}, epoch_since_s=NOW),
        CatchUp(WAIT, behind_since_s=NOW),
    ),
    (
        "a peer a step ahead for the lag grace: replay from it",
        _view(recorded={"A": 11, "C": 10}, behind_since_s=NOW - 3.0),
        CatchUp(REPLAY, REPLAY_DHT.format(1), "A", 11),
    ),
    (
        "lagging with samples of its own: resync",
        _view(recorded={"A": 11}, behind_since_s=NOW - 3.0, own_samples=8),
        CatchUp(RESYNC, REPLAY_DHT.format(1)),
    ),
    (
        "more than keep_ahead steps behind: at once, from the most advanced peer",
        _view(recorded={"C": 12, "A": 15}),
        CatchUp(REPLAY, REPLAY_DHT.format(5), "A", 15),
    ),
    (
        "beyond what peers keep: resync",
        _view(recorded={"A": 10 + 65}),
        CatchUp(RESYNC, REPLAY_DHT.format(65)),
    ),
    (
        "parameters diverged from a peer it follows: ask who answers before a download",
        _view(recorded={"A": 10}, diverged=frozenset("A"), epoch_since_s=NOW),
        CatchUp(ASK),
    ),
    (
        "diverged, and a peer answers at its step: resync",
        _view(recorded={"A": 10}, diverged=frozenset("A"), epoch_since_s=NOW, asked={"A": 10, "B": None}),
        CatchUp(RESYNC, DIVERGED),
    ),
    (
        # seed 0 of the netbed chaos bench: the stage's only replica the trainers reached refused them
        # for 15 s, downloading from a peer that was cut off
        "diverged, every peer silent: keep serving, no download that cannot start",
        _view(recorded={"A": 10}, diverged=frozenset("A"), epoch_since_s=NOW, asked={"A": None, "B": None}),
        CatchUp(WAIT),
    ),
    (
        # three replicas: B and C hold the same diverged state, A (which both follow) is cut off
        "diverged, only a peer it did not diverge from answers: it is no better a donor, keep serving",
        _view(
            recorded={"A": 10, "C": 10},
            diverged=frozenset("A"),
            epoch_since_s=NOW,
            asked={"A": None, "C": 10},
        ),
        CatchUp(WAIT),
    ),
    (
        "diverged, the pings could not be sent: no download on that",
        _view(recorded={"A": 10}, diverged=frozenset("A"), epoch_since_s=NOW, ask_failed=True),
        CatchUp(WAIT),
    ),
    (
        "a request held back for the lag grace: ask the peers",
        _view(held_since_s=NOW - 3.0),
        CatchUp(ASK),
    ),
    (
        "a request held back briefly: a step finishing, nothing to ask",
        _view(held_since_s=NOW - 1.0),
        CatchUp(READ),
    ),
    (
        # seed 0 again: a replica that adopted the other stages' step while its peer, frozen, had already
        # applied it; the step's closes had gone to the peer, and trainers' requests of the next step
        # waited here for 60 s
        "held back, a peer answers ahead, no samples of its own: replay the step from that peer",
        _view(held_since_s=NOW - 4.0, asked={"A": 12, "B": None}),
        CatchUp(REPLAY, "peers applied step 10; a trainer's request has waited 4 s for it here", "A", 12),
    ),
    (
        "held back, holding samples of the step: the step loop finishes it, the records decide",
        _view(held_since_s=NOW - 4.0, asked={"A": 11}, own_samples=8),
        CatchUp(READ),
    ),
    (
        "held back, nobody answers ahead: a slow step, nothing to do",
        _view(held_since_s=NOW - 4.0, asked={"A": 10, "B": None}),
        CatchUp(READ),
    ),
    (
        # netbed chaos, seed 0: woken 50 steps behind, the replica heard the close of 663 naming only its
        # peer, which froze 2 s later; it adopted the other stages' 663 and then held the trainers' requests
        # of 664 for the stranded grace
        "held back at a step a vouched close was heard of while far behind, every peer silent: give it up",
        _view(held_since_s=NOW - 4.0, asked={"A": None}, ahead=_trusted(10, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        "the same with no peer in its view",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(10, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        # netbed chaos, seed 0: retried closes of ~50 steps reached the woken replica at once, in no order
        "the same, the highest close a later step: past it at once, not a step at a time",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(12, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=13, abandon_close=True),
    ),
    (
        "the same, but it holds samples or a close of the next step: not past that one",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(12, age_s=5.0), next_held=11),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        # netbed chaos, seed 0: capped at a window, a replica woken 41 steps behind adopted three times (17 s)
        "the same, the close far ahead: straight past it (no peer answers)",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(40, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=41, abandon_close=True),
    ),
    (
        "the same, a vouched close absurdly far ahead: at most max_replay steps at once",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(2**53 - 1, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=74, abandon_close=True),
    ),
    (
        "the same, the close of an earlier step: nothing shows its own step ran elsewhere",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(9, age_s=5.0)),
        CatchUp(READ),
    ),
    (
        "the same, but the close is older than the evidence lasts",
        _view(held_since_s=NOW - 4.0, asked={}, ahead=_trusted(10, age_s=121.0)),
        CatchUp(READ),
    ),
    (
        "the same, reached through records that show nobody (a stage of one replica)",
        _view(recorded={}, epoch_since_s=LONG_AGO, asked={}, ahead=_trusted(10, age_s=5.0)),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        "the same, but a peer answers at its step: the records decide",
        _view(held_since_s=NOW - 4.0, asked={"A": 10}, ahead=_trusted(10, age_s=5.0)),
        CatchUp(READ),
    ),
    (
        "the same, but a stranger's close: nothing given up",
        _view(held_since_s=NOW - 4.0, asked={"A": None}, ahead=_stranger(10, age_s=5.0)),
        CatchUp(READ),
    ),
    (
        "the same, but the close was of an earlier step",
        _view(held_since_s=NOW - 4.0, asked={"A": None}, ahead=_trusted(9, age_s=5.0)),
        CatchUp(READ),
    ),
    (
        "the same, with a kept close of the step naming nobody: the step loop's and the stuck rule's",
        _view(
            held_since_s=NOW - 4.0,
            asked={},
            ahead=_trusted(10, age_s=5.0),
            stuck=Stuck(NOW - 3.0, NOW - 3.0, frozenset()),
        ),
        CatchUp(READ),
    ),
    (
        "the same, holding samples of the step: the step loop's",
        _view(held_since_s=NOW - 4.0, asked={"A": None}, ahead=_trusted(10, age_s=11.0), own_samples=8),
        CatchUp(READ),
    ),
    ("a fresh close far past the window: ask the peers", _view(ahead=_trusted(40)), CatchUp(ASK)),
    (
        "a peer that answers far ahead: replay from the furthest",
        _view(ahead=_trusted(40), asked={"A": 39, "C": 20, "D": None}),
        CatchUp(REPLAY, REPLAY_ASKED.format(29), "A", 39),
    ),
    (
        "a peer that answers far ahead, holding samples: resync",
        _view(ahead=_trusted(40), asked={"A": 39}, own_samples=8),
        CatchUp(RESYNC, REPLAY_ASKED.format(29)),
    ),
    (
        "the peer that ran the steps is silent: adopt after the lag grace",
        _view(ahead=_trusted(40), asked={"A": None, "C": 10}),
        CatchUp(ADOPT, grace_s=3.0),
    ),
    (
        "no peer left in the view: adopt after the lag grace, past the highest vouched close",
        _view(ahead=_trusted(40), asked={}),
        CatchUp(ADOPT, grace_s=3.0, end=41, abandon_close=True),
    ),
    (
        "every peer answers at our step (a forged close): the records decide",
        _view(ahead=_trusted(40), asked={"A": 10, "C": 10}),
        CatchUp(READ),
    ),
    (
        "a peer answers a few steps ahead: the records decide",
        _view(ahead=_trusted(40), asked={"A": 12, "C": None}),
        CatchUp(READ),
    ),
    (
        "a stranger's close: asked, but a silent peer does not make it leave its step",
        _view(ahead=_stranger(40), asked={"A": None}),
        CatchUp(READ),
    ),
    ("a stranger's close is still worth asking about", _view(ahead=_stranger(40)), CatchUp(ASK)),
    ("a close older than the bound shows nothing", _view(ahead=_trusted(40, age_s=121.0)), CatchUp(READ)),
    # a close of its own step it could not act on: the members' sums went to it while it was away
    ("stuck on its step's close for the lag grace: ask the peers", _view(stuck=STUCK), CatchUp(ASK)),
    (
        "stuck for less than the lag grace: the records decide, as without the close",
        _view(stuck=Stuck(NOW - 2.0, NOW - 2.0, frozenset("A"))),
        CatchUp(READ),
    ),
    (
        "stuck, a peer answers a step ahead: it applied the step, replay it from its means",
        _view(stuck=STUCK, asked={"A": 11, "C": 10}),
        CatchUp(REPLAY, STUCK_REPLAY, "A", 11),
    ),
    (
        "stuck holding samples of its own, a peer ahead: the exchange or the records decide",
        _view(stuck=STUCK, asked={"A": 11}, own_samples=8),
        CatchUp(READ),
    ),
    (
        "stuck, the replica that holds the step silent: give the close up, adopt",
        _view(stuck=STUCK, asked={"A": None, "C": 10}),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        # netbed chaos, seed 0: a replica that woke 90 steps behind heard far closes too, and the far-close
        # adoption (which keeps a step with a close) held its step 25 s, until the frozen holder woke
        "stuck with its holder silent, and a vouched close far ahead: give the close up all the same",
        _view(stuck=STUCK, ahead=_trusted(40), asked={"A": None}),
        CatchUp(ADOPT, grace_s=3.0, end=41, abandon_close=True),
    ),
    (
        "the same, another peer answering at its step: at most a close window ahead (it may be closing them)",
        _view(stuck=STUCK, ahead=_trusted(40), asked={"A": None, "C": 10}),
        CatchUp(ADOPT, grace_s=3.0, end=14, abandon_close=True),
    ),
    (
        # netbed chaos, seed 0: a stage-0 replica held 8 samples of a step whose close named only its
        # cut-off peer; they held the step, and the trainers' requests of the next one, for 21 s
        "stuck holding samples, its holder silent for the close timeout: give the close and samples up",
        _view(stuck=Stuck(NOW - 10.0, NOW - 10.0, frozenset("A")), asked={"A": None}, own_samples=8),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        # a slow trainer's close, naming this replica, may still bring the step to a close here
        "stuck holding samples, its holder silent for less than the close timeout: the records",
        _view(stuck=Stuck(NOW - 9.0, NOW - 9.0, frozenset("A")), asked={"A": None}, own_samples=8),
        CatchUp(READ),
    ),
    (
        "stuck, a holder silent but another answers (a second trainer may still close it): the records",
        _view(stuck=Stuck(NOW - 3.0, NOW - 3.0, frozenset("AC")), asked={"A": None, "C": 10}),
        CatchUp(READ),
    ),
    (
        # netbed chaos, seed 0: the one replica that held the step's samples was killed, and its peers
        # held the step for 85 s (a name no replica answers to is no better: no close naming it is acted on)
        "stuck, the holder it names has left its view of the stage: nobody can finish the step, adopt",
        _view(stuck=Stuck(NOW - 3.0, NOW - 3.0, frozenset("X")), asked={"A": 10}),
        CatchUp(ADOPT, grace_s=3.0, end=11, abandon_close=True),
    ),
    (
        "stuck on a close naming no other replica (the only replica of its stage): the records",
        _view(stuck=Stuck(NOW - 3.0, NOW - 3.0, frozenset()), asked={}),
        CatchUp(READ),
    ),
    (
        "stuck on a close older than the evidence bound: no pings",
        _view(stuck=Stuck(NOW - 200.0, NOW - 121.0, frozenset("A"))),
        CatchUp(READ),
    ),
    (
        "stuck, every peer answers at our step: nobody ran it, the records decide",
        _view(stuck=STUCK, asked={"A": 10}),
        CatchUp(READ),
    ),
    ("a close within the window shows nothing", _view(ahead=_trusted(14)), CatchUp(READ)),
    # netbed chaos, seed 1: cut off until the trainers left, a replica stayed a step behind its peer to the
    # end of the run, every read of the records timing out
    (
        "the records show nobody and no step for the lag grace: ask the peers",
        _view(recorded={}, epoch_since_s=LONG_AGO),
        CatchUp(ASK),
    ),
    (
        "the records show nobody, a step a moment ago: no ask",
        _view(recorded={}, epoch_since_s=NOW),
        CatchUp(WAIT),
    ),
    (
        "the records show nobody, a peer answers a step ahead: its answer stands in (the lag clock starts)",
        _view(recorded={}, epoch_since_s=LONG_AGO, asked={"A": 11}),
        CatchUp(WAIT, behind_since_s=NOW),
    ),
    (
        "the records show nobody, a peer has answered ahead for the lag grace: replay from it",
        _view(recorded={}, epoch_since_s=LONG_AGO, asked={"A": 11, "B": None}, behind_since_s=NOW - 3.0),
        CatchUp(REPLAY, REPLAY_DHT.format(1), "A", 11),
    ),
    (
        "the records show a peer ahead for the lag grace that was silent when asked: no donor, wait",
        _view(recorded={"A": 12, "C": 10}, asked={"A": None, "C": 10}, behind_since_s=NOW - 3.0),
        CatchUp(WAIT, behind_since_s=NOW - 3.0),
    ),
    (
        "the same, far ahead, holding samples: no download from a silent peer either",
        _view(recorded={"A": 20}, asked={"A": None}, own_samples=8, epoch_since_s=LONG_AGO),
        CatchUp(WAIT, behind_since_s=NOW),
    ),
    (
        "the records show two peers ahead, the furthest silent when asked: replay from the other",
        _view(recorded={"A": 12, "C": 11}, asked={"A": None, "C": 11}, behind_since_s=NOW - 3.0),
        CatchUp(REPLAY, REPLAY_DHT.format(2), "C", 11),
    ),
    (
        "the records show nobody, nobody answers ahead: the other stages decide, as before",
        _view(recorded={}, epoch_since_s=LONG_AGO, asked={"A": 10}),
        CatchUp(ADOPT),
    ),
]


@pytest.mark.parametrize("what,view,decision", CASES, ids=[case[0] for case in CASES])
def test_the_lag_rule(what, view, decision):
    assert decide_catch_up(view, RULE) == decision


def test_a_replica_is_left_behind_by_the_highest_vouched_close_not_only_the_last():
    """Netbed chaos, seed 0: retried closes reached a woken replica in no order; the last far one came
    within its window once it had replayed a few steps, and it asked nobody while its one up-to-date
    peer was still awake."""
    ahead = SwarmAhead().heard(325, NOW, far=True, trusted=True).heard(289, NOW, far=True, trusted=True)
    assert ahead.latest == Heard(289, NOW) and ahead.trusted == Heard(325, NOW)
    assert left_behind(ahead, 286, NOW + 1.0, RULE)
    assert not left_behind(dataclasses.replace(ahead, trusted=None), 286, NOW + 1.0, RULE)


def test_a_forged_close_far_ahead_expires():
    """A stranger's close of step 10**9 made the replica left behind for good, pinging its stage peers
    every tick. It asks while the close is fresh, never leaves its step on it alone (every peer that
    answers is believed, a silent one counts only behind a vouched close), and stops asking once the
    close is older than the bound."""
    ahead = SwarmAhead().heard(10**9, NOW, far=True, trusted=False)
    assert left_behind(ahead, EPOCH, NOW + 1.0, RULE)
    assert decide_catch_up(_view(ahead=ahead, now_s=NOW + 1.0), RULE).action == ASK
    silent = _view(ahead=ahead, now_s=NOW + 1.0, asked={"A": None})
    assert decide_catch_up(silent, RULE).action == READ
    later = NOW + RULE.evidence_ttl_s + 1.0
    assert not left_behind(ahead, EPOCH, later, RULE)
    assert decide_catch_up(_view(ahead=ahead, now_s=later), RULE).action == READ
    # the step it named is still the newest: an honest request that far ahead is still refused at once
    assert trails_stage(10**9, EPOCH, ahead.newest_step, RULE.window)


def test_the_evidence_a_close_leaves():
    ahead = SwarmAhead().heard(40, 1.0, far=True, trusted=True)
    assert ahead == SwarmAhead(40, Heard(40, 1.0), Heard(40, 1.0), 40)
    forged = ahead.heard(10**9, 2.0, far=True, trusted=False)  # a stranger's keeps the vouched one
    assert forged == SwarmAhead(10**9, Heard(10**9, 2.0), Heard(40, 1.0), 40)
    near = forged.heard(12, 3.0, far=False, trusted=True)  # within the window: only the newest step moves
    assert near == forged
    assert ahead.heard(41, 3.0, far=True, trusted=True).trusted == Heard(41, 3.0)
    # retried closes come in no order: a lower one keeps the highest step, and is the latest news of it
    assert ahead.heard(39, 3.0, far=True, trusted=True).trusted == Heard(40, 3.0)
    assert SwarmAhead().heard(12, 1.0, far=False, trusted=True).vouched_step == 12
    assert SwarmAhead().heard(12, 1.0, far=False, trusted=False).vouched_step == -1


def test_the_lag_clock_runs_while_a_peer_is_ahead_and_restarts_after_an_action():
    waiting = decide_catch_up(_view(recorded={"A": 11}, behind_since_s=NOW - 1.0), RULE)
    assert waiting == CatchUp(WAIT, behind_since_s=NOW - 1.0)
    caught_up = decide_catch_up(_view(recorded={"A": 10}, behind_since_s=NOW - 1.0, epoch_since_s=NOW), RULE)
    assert caught_up.behind_since_s is None
    asked = _view(ahead=_trusted(40), asked={"A": None}, behind_since_s=NOW - 1.0)
    assert decide_catch_up(asked, RULE).behind_since_s == NOW - 1.0  # adopting leaves it as it was
    replay = decide_catch_up(dataclasses.replace(asked, asked={"A": 39}), RULE)
    assert replay.action == REPLAY and replay.behind_since_s is None


def test_the_evidence_outlives_the_lag_grace_by_far():
    ttl_s = evidence_ttl_s(request_timeout_s=30.0, averaging_timeout_s=30.0)
    assert ttl_s == 120.0 and ttl_s > 10 * LagRule().lag_grace_s


def test_a_replica_trails_its_stage_only_when_a_close_and_the_request_are_both_past_the_window():
    assert trails_stage(step=235, epoch=197, newest_close=234, window=4)
    assert not trails_stage(step=235, epoch=197, newest_close=200, window=4)  # no close that far: hold it
    assert not trails_stage(step=201, epoch=197, newest_close=234, window=4)  # it may serve it soon
    assert not trails_stage(step=10**9, epoch=0, newest_close=-1, window=4)  # a request alone refuses nothing
