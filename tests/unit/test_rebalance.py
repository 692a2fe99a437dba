"""The pure rebalancing policy on hand-made loads."""

import random
from dataclasses import replace

import pytest

from swarmtrain.planner.rebalance import (
    PeerLoad,
    RebalanceConfig,
    bottleneck_stage,
    bottleneck_utilization,
    choose_move,
    plan_moves,
    relative_stage_costs,
    stage_capacities,
    stage_for_new_peer,
    worthwhile_moves,
)

pytestmark = pytest.mark.unit


def loads(*stages, queue=0.0):
    """loads([5, 5], [10, 10, 10]) -> peers s{stage}p{i} with those throughputs."""
    return [
        PeerLoad(f"s{s}p{i}", s, thr, queue_len=queue)
        for s, rates in enumerate(stages)
        for i, thr in enumerate(rates)
    ]


def apply(current, move):
    return [
        PeerLoad(
            x.peer, move.to_stage if x.peer == move.peer else x.stage, x.throughput_samples_per_s, x.queue_len
        )
        for x in current
    ]


def test_moves_a_peer_from_an_over_provisioned_stage_to_the_bottleneck():
    move = choose_move(loads([5, 5], [10, 10, 10], [10, 10, 10]), 3)
    assert (move.peer, move.from_stage, move.to_stage) == ("s1p0", 1, 0)
    assert move.bottleneck_before_samples_per_s == 10
    assert move.pair_min_after_samples_per_s == 20


def test_prefers_the_donor_that_leaves_the_best_pair_and_near_equal_ones_by_peer_id():
    current = [
        PeerLoad("a", 0, 4.0),
        PeerLoad("b", 1, 10.0, queue_len=3),
        PeerLoad("c", 1, 9.0, queue_len=1),
        PeerLoad("d", 1, 10.5, queue_len=1),
        PeerLoad("e", 2, 8.0),
        PeerLoad("f", 2, 8.0),
    ]
    move = choose_move(current, 3)
    # stage 1 (29.5) can give ~10 and stay at ~19.5 > 4*1.1; stage 2 (16) giving 8 leaves 8 < 4.4 + 8:
    # not better. b, c and d leave pairs within 20% of each other: live figures of identical servers
    # differ that much between reads, so the stable peer id decides, not the noise (or the queue)
    assert move.peer == "b" and move.to_stage == 0
    # outside the band the better pair wins whatever the id
    move = choose_move([PeerLoad("a", 0, 1.0), PeerLoad("b", 1, 10.0), PeerLoad("c", 1, 3.0)], 2)
    assert move.peer == "c"  # leaves 10 (b would leave 3, with 4 at stage 0: pair 3 vs c's 4)
    with pytest.raises(ValueError):
        RebalanceConfig(mover_tolerance=1.0)


def test_never_empties_a_stage():
    # stage 0 is empty (capacity 0); stage 1 has its last peer; only stage 2 may give
    move = choose_move(loads([], [10], [10, 10]), 3)
    assert move.from_stage == 2 and move.to_stage == 0
    assert choose_move(loads([10], []), 2) is None  # the only peer of stage 0 stays
    with pytest.raises(ValueError):
        RebalanceConfig(min_peers_per_stage=0)


def test_min_peers_per_stage_is_respected():
    config = RebalanceConfig(min_peers_per_stage=3)
    assert choose_move(loads([1], [10, 10, 10]), 2, config) is None
    assert choose_move(loads([1], [10, 10, 10, 10]), 2, config).from_stage == 1


def test_does_not_oscillate_between_two_equal_stages():
    assert choose_move(loads([5, 5], [5, 5]), 2) is None
    assert choose_move(loads([5, 5], [5, 5], [30, 30]), 3).from_stage == 2


def test_hysteresis_blocks_a_move_that_would_flip_the_bottleneck():
    # a naive "most loaded to least loaded" rule moves one peer from 12 to 10 and back forever
    assert choose_move(loads([2] * 5, [2] * 6), 2) is None
    assert choose_move(loads([2] * 5, [2] * 7), 2, RebalanceConfig(margin=0.0)) is not None
    assert choose_move(loads([2] * 5, [2] * 7), 2, RebalanceConfig(margin=0.25)) is None


def test_tie_breaks_are_deterministic_whatever_the_input_order():
    base = loads([3], [10, 10], [10, 10])
    expected = choose_move(base, 3)
    rng = random.Random(0)
    for _ in range(20):
        shuffled = base[:]
        rng.shuffle(shuffled)
        assert choose_move(shuffled, 3) == expected
    assert expected.peer == "s1p0"


def test_repeated_moves_terminate_and_improve_lexicographically():
    rng = random.Random(1)
    for _ in range(30):
        stages = rng.randint(2, 5)
        current = [
            PeerLoad(f"p{i}", rng.randrange(stages), rng.uniform(1, 10)) for i in range(rng.randint(2, 25))
        ]
        seen_moves = 0
        while (move := choose_move(current, stages, RebalanceConfig(margin=0.05))) is not None:
            before = sorted(stage_capacities(current, stages))
            current = apply(current, move)
            after = sorted(stage_capacities(current, stages))
            assert after > before  # leximin strictly improves: no cycle is possible
            seen_moves += 1
            assert seen_moves <= 1000


def test_plan_moves_does_not_overshoot_and_moves_each_peer_once():
    current = loads([1.0], [1.0] * 9)
    moves = plan_moves(current, 2, RebalanceConfig(margin=0.0), max_moves=10)
    assert len({m.peer for m in moves}) == len(moves)
    assert all(m.to_stage == 0 for m in moves)
    assert len(moves) == 4  # 5 / 5 is balanced; a fifth move would make stage 1 the bottleneck
    assert plan_moves(current, 2, max_moves=1) == [choose_move(current, 2)]


def test_pending_peers_count_as_capacity_but_neither_move_nor_hold_a_stage():
    current = [
        PeerLoad("a", 0, 10.0),
        PeerLoad("b", 1, 10.0),
        PeerLoad("c", 1, 10.0, pending=True),
        PeerLoad("d", 1, 10.0),
    ]
    move = choose_move(current, 2)
    assert move is not None and move.peer == "b"  # c is pending; b and d can give
    only_pending_left = [PeerLoad("a", 0, 1.0), PeerLoad("b", 1, 10.0), PeerLoad("c", 1, 10.0, pending=True)]
    assert choose_move(only_pending_left, 2) is None  # moving b would leave stage 1 with no serving peer


def test_stage_cost_and_per_stage_throughput_drive_the_gain():
    # stage 0 costs twice as much per sample: a peer doing 10/s at stage 1 does 5/s there
    current = loads([4], [10, 10, 10])
    move = choose_move(current, 2, stage_cost=[2.0, 1.0])
    assert move.pair_min_after_samples_per_s == pytest.approx(9.0)
    cannot_serve = [
        PeerLoad("a", 0, 1.0),
        *(PeerLoad(f"b{i}", 1, 10.0, throughput_by_stage=(0.0, 10.0)) for i in range(3)),
    ]
    assert choose_move(cannot_serve, 2) is None


def test_stage_costs_estimated_from_announcements_plan_the_whole_gap():
    """Equal servers read 40 samples/s on stage 0 and 10 on stage 1: stage 1 costs 4x. A stage-0
    server moved there is worth 10, not 40, so the plan from 4+1 is three moves to 1+4; with equal costs
    assumed it stopped at 2+3 (each mover counted 40 there)."""
    current = loads([40, 40, 40, 40], [10])
    costs = relative_stage_costs(current, 2)
    assert costs[1] / costs[0] == pytest.approx(4.0)
    plan = plan_moves(current, 2, RebalanceConfig(margin=0.1), costs, max_moves=len(current))
    assert [m.rate_samples_per_s for m in plan] == [10.0, 10.0, 10.0]
    assert [m.pair_min_after_samples_per_s for m in plan] == [20.0, 30.0, 40.0]
    assert len(plan_moves(current, 2, RebalanceConfig(margin=0.1), None, max_moves=len(current))) == 2
    # pending peers and silent ones tell nothing about a stage's cost; a stage nobody serves gets the mean
    assert relative_stage_costs([PeerLoad("a", 0, 10.0, pending=True)], 2) is None
    assert relative_stage_costs(loads([10], [], [5]), 3) == pytest.approx([0.1, 0.15, 0.2])


def test_stage_for_new_peer_is_the_bottleneck_it_can_serve():
    assert stage_for_new_peer([30.0, 10.0, 20.0]) == 1
    assert stage_for_new_peer([30.0, 10.0, 20.0], peer_rates=[5.0, 0.0, 5.0]) == 2
    assert stage_for_new_peer([30.0, 10.0], peer_rates=[0.0, 0.0]) is None
    assert stage_for_new_peer([10.0, 10.0, 10.0]) == 0  # tie: lower index
    assert stage_for_new_peer([10.0, 10.0, 10.0], queues=[0.0, 5.0, 2.0]) == 1  # tie: longer drain time
    assert bottleneck_stage([0.0, 0.0], queues=[0.0, 3.0]) == 1


# The link fleet of bench/rebalance_live.py with fp32 sums after its first move: a alone on stage 0,
# b (unlimited) and the slow-linked y and z on stage 1, while the swarm ran at ~100 samples/s: a's
# compute busy ~30% of the time (the rest of each ~5 s step went to stage 1's exchange).
LINK_FLEET_AFTER = [
    PeerLoad("a", 0, 646.0, utilization=0.3),
    PeerLoad("b", 1, 700.0, utilization=0.3),
    PeerLoad("y", 1, 20.0, utilization=0.9),
    PeerLoad("z", 1, 73.0, utilization=0.9),
]


def test_a_move_that_barely_lifts_an_idling_bottleneck_is_not_made():
    """Live, this plan moved y to stage 0 and the swarm fell from ~100 to ~40 samples/s. Weighed by the
    bottleneck's 30% busy time, lifting it from 646 to 666 gains the swarm under 1%."""
    moved = plan_moves(LINK_FLEET_AFTER, 2, max_moves=4)
    assert [(m.peer, m.from_stage, m.to_stage) for m in moved] == [("y", 1, 0)]
    assert plan_moves(LINK_FLEET_AFTER, 2, max_moves=4, weigh=True) == []
    assert bottleneck_utilization(LINK_FLEET_AFTER, 2) == pytest.approx(0.3)
    # busy all the time, the same 3% would not be worth a move either; a larger gap is made up
    saturated = [replace(load, utilization=1.0) for load in LINK_FLEET_AFTER]
    assert plan_moves(saturated, 2, max_moves=4, weigh=True) == []
    wider = [replace(saturated[0], throughput_samples_per_s=500.0), *saturated[1:]]
    assert plan_moves(wider, 2, max_moves=4, weigh=True) == plan_moves(wider, 2, max_moves=4) != []


def test_a_move_that_lifts_a_busy_link_starved_bottleneck_is_made():
    """The same fleet before it: stage 1 is y and z alone, their links busy 80% of the time."""
    before = [
        PeerLoad("a", 0, 646.0, utilization=0.2),
        PeerLoad("b", 0, 700.0, utilization=0.2),
        PeerLoad("y", 1, 20.0, utilization=0.8),
        PeerLoad("z", 1, 73.0, utilization=0.8),
    ]
    moved = plan_moves(before, 2, max_moves=4, weigh=True)
    assert [(m.from_stage, m.to_stage) for m in moved] == [(0, 1)]


def test_without_a_busy_fraction_the_plan_is_not_weighed():
    unknown = [replace(load, utilization=None) for load in LINK_FLEET_AFTER]
    assert plan_moves(unknown, 2, max_moves=4, weigh=True) == plan_moves(unknown, 2, max_moves=4) != []


def test_moves_count_in_groups_so_two_stages_tied_for_the_bottleneck_both_get_a_peer():
    """[100, 100, 300]: the first move alone lifts nothing (the other stage stays at 100); together the
    two lift the swarm's minimum to 150."""
    current = [replace(load, utilization=0.9) for load in loads([100.0], [100.0], [50.0] * 6)]
    unfiltered = plan_moves(current, 3, max_moves=8)
    assert [(m.from_stage, m.to_stage) for m in unfiltered] == [(2, 0), (2, 1)]
    assert plan_moves(current, 3, max_moves=8, weigh=True) == unfiltered
    assert worthwhile_moves([[100.0, 100.0, 300.0], [150.0, 100.0, 250.0]], 0.9, 0.1) == 0


def test_worthwhile_moves_keeps_a_prefix_each_group_gaining_the_minimum():
    caps = [[100.0, 400.0], [104.0, 396.0], [110.0, 390.0], [112.0, 388.0]]
    # busy all the time: 104 is +4%, 110 is +10% over 100, 112 is +1.8% over 110
    assert worthwhile_moves(caps, 1.0, 0.05) == 2
    assert worthwhile_moves(caps, 1.0, 0.0) == 3
    # busy half the time, the same capacities gain about half as much: only 112 clears 5%
    assert worthwhile_moves(caps, 0.5, 0.05) == 3
    assert worthwhile_moves(caps, 0.5, 0.1) == 0
    assert worthwhile_moves(caps, 0.0, 0.01) == 0  # an idle bottleneck: capacity there buys nothing
    assert worthwhile_moves([[0.0, 400.0], [10.0, 390.0]], 0.5, 0.1) == 1  # an empty stage: every move


def test_a_weighed_plan_is_a_prefix_of_the_plan_on_capacities_alone():
    rng = random.Random(7)
    for _ in range(50):
        stages = rng.randint(2, 5)
        current = [
            PeerLoad(f"p{i}", rng.randrange(stages), rng.uniform(1, 10), utilization=rng.uniform(0, 1))
            for i in range(rng.randint(2, 25))
        ]
        plan = plan_moves(current, stages, max_moves=25)
        weighed = plan_moves(current, stages, max_moves=25, weigh=True)
        assert weighed == plan[: len(weighed)]
