"""Trainers on a time limit agree on their last step (planner/stop_step.py): a shard waits for every
shard's proposal (or the wait limit), then all go on to the highest proposal and stop there."""

import pytest

from swarmtrain.planner.stop_step import StopAction, agreed_stop

pytestmark = pytest.mark.unit
LIMIT_S = 10.0


def test_a_single_trainer_stops_where_its_time_is_up():
    assert agreed_stop(7, 7, {}, 1, 0.0, LIMIT_S).action is StopAction.STOP


def test_a_shard_waits_for_the_other_shards_proposals():
    decision = agreed_stop(7, 7, {1: 9}, 3, 1.0, LIMIT_S)
    assert decision.action is StopAction.WAIT and decision.step == 9


def test_every_shard_goes_on_to_the_highest_proposal_and_stops_there():
    proposals = {0: 7, 1: 9, 2: 8}
    for shard, proposed in proposals.items():
        others = {s: p for s, p in proposals.items() if s != shard}
        assert agreed_stop(proposed, proposed, others, 3, 1.0, LIMIT_S).step == 9
    assert agreed_stop(7, 7, {1: 9, 2: 8}, 3, 1.0, LIMIT_S).action is StopAction.GO
    assert agreed_stop(9, 7, {1: 9, 2: 8}, 3, 1.0, LIMIT_S).action is StopAction.STOP


def test_a_shard_that_never_proposes_is_waited_for_only_until_the_limit():
    decision = agreed_stop(7, 7, {1: 8}, 3, LIMIT_S, LIMIT_S)
    assert decision.action is StopAction.GO and decision.step == 8
    assert agreed_stop(8, 7, {1: 8}, 3, LIMIT_S + 1, LIMIT_S).action is StopAction.STOP
