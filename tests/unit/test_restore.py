"""Where a starting replica's state comes from (planner/restore.py): live replicas, then the newest
checkpoint, then initial weights, and never initial weights silently once the swarm has stepped."""

import pytest

from swarmtrain.planner.restore import behind_other_stages, choose_start

pytestmark = pytest.mark.unit


def test_a_new_run_starts_from_initial_weights():
    start = choose_start([], None, 0, allow_fresh=False)
    assert (start.source, start.epoch, start.lost_steps) == ("fresh", 0, 0)


def test_live_replicas_ahead_win_over_an_older_checkpoint():
    start = choose_start([40, 41], 30, 41, allow_fresh=False)
    assert (start.source, start.epoch) == ("peers", 41)


def test_a_checkpoint_newer_than_live_replicas_is_used():
    # the live replicas restarted fresh (a new run under the same config): ours is further along
    start = choose_start([0], 30, 0, allow_fresh=False)
    assert (start.source, start.epoch) == ("checkpoint", 30)


def test_checkpoint_restores_at_the_swarm_step_and_counts_the_lost_updates():
    start = choose_start([], 100, 150, allow_fresh=False)
    assert (start.source, start.epoch, start.lost_steps) == ("checkpoint", 150, 50)
    assert "50 update(s) are lost" in start.reason


def test_checkpoint_ahead_of_the_other_stages_keeps_its_step():
    start = choose_start([], 120, 100, allow_fresh=False)
    assert (start.source, start.epoch, start.lost_steps) == ("checkpoint", 120, 0)


def test_no_replica_no_checkpoint_and_a_swarm_that_stepped_is_refused():
    start = choose_start([], None, 150, allow_fresh=False)
    assert start.source == "refuse"
    assert "--checkpoint-dir" in start.reason and "--fresh-start" in start.reason


def test_a_step_zero_checkpoint_is_the_initial_weights_and_no_restore():
    assert choose_start([], 0, 150, allow_fresh=False).source == "refuse"


def test_fresh_start_on_purpose_adopts_the_swarm_step_and_says_what_is_lost():
    start = choose_start([], None, 150, allow_fresh=True)
    assert (start.source, start.epoch, start.lost_steps) == ("fresh", 150, 150)


def test_joining_live_replicas_at_step_zero_is_a_fresh_start():
    assert choose_start([0, 0], None, 3, allow_fresh=False).source == "fresh"


@pytest.mark.parametrize(
    "epoch, other, pending, behind_s, untrained, allow_fresh, expected",
    [
        (10, 10, 0, 99.0, False, False, "wait"),  # not behind
        (10, 11, 0, 0.1, False, False, "wait"),  # stages step milliseconds apart: normal
        (10, 11, 16, 99.0, False, False, "wait"),  # still holding step 10's gradients: being closed
        (10, 50, 0, 5.0, False, False, "advance"),  # restored from an older checkpoint
        (0, 50, 0, 5.0, True, False, "refuse"),  # initial weights in a trained swarm
        (0, 50, 0, 5.0, True, True, "advance"),  # ... unless asked for
    ],
)
def test_behind_other_stages(epoch, other, pending, behind_s, untrained, allow_fresh, expected):
    assert behind_other_stages(epoch, other, pending, behind_s, 3.0, untrained, allow_fresh) == expected


def test_a_replica_whose_step_is_being_closed_is_never_advanced():
    """The chaos bench found this: a replica with no samples of step k waited a close timeout for a
    slow trainer while the other stage moved on; advancing it skipped step k, which its peer applied."""
    assert behind_other_stages(916, 917, 0, 99.0, 3.0, False, False, closing=True) == "wait"


def test_a_replica_that_gives_its_steps_close_up_advances_with_the_samples_it_holds():
    """Netbed chaos, seed 0: a stage-0 replica held 8 samples of a step whose vouched close named only
    its cut-off peer; the catch-up gave the close up, but the held samples kept the replica, and the
    trainers' requests of the next step, for 21 s. Giving the close up gives its samples up too."""
    stranded = dict(restored=False, stranded_grace_s=3.0)
    assert behind_other_stages(483, 484, 8, 3.5, 3.0, False, False, closing=True, **stranded) == "wait"
    given_up = dict(stranded, closing=True, abandon_close=True)
    assert behind_other_stages(483, 484, 8, 3.5, 3.0, False, False, **given_up) == "advance"
    assert behind_other_stages(483, 484, 8, 2.5, 3.0, False, False, **given_up) == "wait"  # the grace
    # the step loop exchanging or applying the step decides it: no adoption under it
    assert behind_other_stages(483, 484, 8, 3.5, 3.0, False, False, finishing=True, **given_up) == "wait"


def test_a_replica_that_has_stepped_with_the_swarm_waits_a_request_timeout_before_it_advances():
    """Found by the chaos bench: all of a step's micro-batches went to a peer that died, the close was
    slow; skipping that step after the short grace made this replica differ from its live peers. And by
    the chaos test in CI: the only stage-0 replica that applied step 711 was killed, the two left (which
    had downloaded their state from peers) waited at 711 while stage 1 was at 712, for good."""
    stepped = dict(restored=False, stranded_grace_s=30.0)
    assert behind_other_stages(1050, 1051, 0, 29.0, 3.0, False, False, **stepped) == "wait"
    assert behind_other_stages(711, 712, 0, 31.0, 3.0, False, False, **stepped) == "advance"
    assert behind_other_stages(711, 712, 4, 99.0, 3.0, False, False, **stepped) == "wait"  # holds samples
    assert behind_other_stages(711, 712, 0, 99.0, 3.0, False, False, closing=True, **stepped) == "wait"
    assert behind_other_stages(30, 32, 0, 5.0, 3.0, False, False, restored=True) == "advance"
    # without a stranded grace (the default), only a restored replica advances
    assert behind_other_stages(1050, 1051, 0, 99.0, 3.0, False, False, restored=False) == "wait"


def test_of_two_mismatched_replicas_the_one_that_skipped_steps_or_trained_less_follows():
    from swarmtrain.planner.restore import Line, follows_on_mismatch

    def follows(ours, theirs):
        return follows_on_mismatch(Line(*ours), Line(*theirs))

    assert follows(("B", False), ("A", False)) and not follows(("A", False), ("B", False))
    assert follows(("A", True), ("B", False))  # skipped: follows whatever the ids
    assert not follows(("B", False), ("A", True))
    assert follows(("B", True), ("A", True)) and not follows(("A", True), ("B", True))
    # netbed chaos, seed 2: the replica that computed the recent steps' gradients keeps its line,
    # whatever the ids; the follower of those exchanges (no samples of its own) takes it
    assert not follows(("B", False, 256), ("A", False, 0)) and follows(("A", False, 0), ("B", False, 256))
    assert follows(("B", False, 8), ("A", True, 0)) is False  # skipped still comes first
    assert follows(("B", False, 8), ("A", False, 8))  # a tie: by id
    # a peer of an earlier version publishes no count: both go by id
    assert follows(("B", False, 8), ("A", False, None)) and not follows(("A", False, 0), ("B", False, None))
    # counted: the one that skipped more of the recent steps follows, whatever it trained and the ids
    assert follows(("A", 14, 0), ("B", 1, 200)) and not follows(("B", 1, 200), ("A", 14, 0))


def test_a_skip_counts_for_the_recent_steps_only():
    """Netbed chaos, seed 0: s0-7 adopted step 387 over one step, then applied every step to 420; s0-12
    was restored from the checkpoint of 400 at step 414, 14 updates lost."""
    from swarmtrain.planner.restore import RECENT_STEPS, recent_skipped

    assert recent_skipped([(387, 1)], 420) == 0 and recent_skipped([(414, 14)], 420) == 14
    assert recent_skipped([(420 - RECENT_STEPS + 1, 1)], 420) == 1  # the oldest step still counted
    assert recent_skipped([(400, 3), (410, 2), (300, 50)], 420) == 5 and recent_skipped([], 7) == 0


def test_a_skips_record_keeps_only_what_can_still_count():
    from swarmtrain.planner.restore import RECENT_STEPS, recent_skipped, with_skip

    skips: list[tuple[int, int]] = []
    for step in range(0, 10 * RECENT_STEPS, 3):  # a replica adopting a step over and over, for long
        skips = with_skip(skips, step, 1)
    assert len(skips) <= RECENT_STEPS  # not one entry per skip ever made
    last = 10 * RECENT_STEPS - 1
    assert recent_skipped(skips, last) == len(
        [s for s in range(0, 10 * RECENT_STEPS, 3) if last - s < RECENT_STEPS]
    )
    assert with_skip([(100, 3)], 140, 2) == [(140, 2)] and with_skip([(130, 3)], 140, 2) == [
        (130, 3),
        (140, 2),
    ]
