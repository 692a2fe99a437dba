"""A step nobody will close (planner/held_step.py): the pure rule, and a replica's step loop applying the
samples it holds of such a step with its stage peers (runtime/server/stage_steps.py `apply_held`)."""

import asyncio

import pytest
import test_stage_steps
import torch
from test_stage_steps import Net, _apply_all, _close, _replicas, _split_over_two, _train, _until

from swarmtrain.planner.held_step import applies_held_step, held_step_decision, held_step_members

pytestmark = pytest.mark.unit

GRACE_S = 10.0


micro_batches = test_stage_steps.micro_batches  # the same four micro-batches (a fixture)


def _due(**changes):
    args = dict(
        epoch=5,
        other_stage_epoch=6,
        held_samples=8,
        has_close=False,
        finishing=False,
        behind_for_s=GRACE_S,
        held_for_s=GRACE_S,
        grace_s=GRACE_S,
    )
    return applies_held_step(**{**args, **changes})


def test_a_held_step_is_applied_once_the_other_stages_and_its_samples_have_waited_a_close_timeout():
    assert _due()
    assert _due(other_stage_epoch=9, behind_for_s=60.0, held_for_s=11.0)


@pytest.mark.parametrize(
    "changes",
    [
        {"held_samples": 0},  # nothing held: the adoption rule (planner/restore.py) moves it
        {"has_close": True},  # a close came: the step loop decides on it (or its lenient fallback)
        {"finishing": True},  # a step is being exchanged or applied
        {"other_stage_epoch": 5},  # the other stages are not past the step
        {"other_stage_epoch": 4},
        {"behind_for_s": GRACE_S - 0.1},  # a trainer's late close may still come
        {"held_for_s": GRACE_S - 0.1},  # samples still came in: the step is under way here
    ],
)
def test_a_held_step_waits(changes):
    assert not _due(**changes)


def test_the_members_are_the_stage_peers_holding_samples_of_the_same_step():
    records = {
        "C": {"epoch": 5, "samples": 16},
        "A": {"epoch": 5, "samples": 4},
        "D": {"epoch": 5, "samples": 0},  # holds nothing
        "E": {"epoch": 6, "samples": 8},  # another step
        "F": {"epoch": 5, "samples": True},  # not a count
        "G": {"epoch": 5},  # an earlier version's record
    }
    members = held_step_members("B", 8, 5, records)
    assert members == {"A": 4, "B": 8, "C": 16} and list(members) == ["A", "B", "C"]
    decision = held_step_decision(members, "B", 100.0)
    assert decision.held and decision.lenient and decision.closes == 0 and decision.complete
    assert decision.participants == {"A", "C"} and decision.due_s == 100.0


def test_two_replicas_with_no_close_apply_their_held_samples_together(tiny_cfg, micro_batches, start_compute):
    """A step's only trainer died before closing it at this stage: both replicas hold samples of step 0,
    no close ever comes. Told to apply them (the synchronizer, once the other stages went on), they exchange
    and apply the mean over all 32 samples, as one replica of every sample would, and count a held step."""

    async def scenario():
        net = Net()
        nodes, single = await _split_over_two(tiny_cfg, micro_batches, net, start_compute)
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        await asyncio.sleep(0.2)
        assert all(n.worker.epoch == 0 for n in nodes.values())  # no close: nothing moves by itself
        members = {"A": 24, "B": 8}
        assert nodes["A"].apply_held(1, members) is False  # not the step it is at
        assert nodes["A"].apply_held(0, members) and nodes["B"].apply_held(0, members)
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        _apply_all(single)
        for node in nodes.values():
            assert node.worker.epoch == 1 and node.worker.samples_seen == 32
            assert node.counters.held_steps == 1 and node.counters.lenient_steps == 0
            assert node.counters.partial_exchanges == 0 and node.counters.timed_out_closes == 0
            for p, q in zip(node.worker.params, single.params, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)

    asyncio.run(scenario())


def test_a_close_that_came_first_decides_and_an_empty_replica_holds_nothing_to_apply(
    tiny_cfg, micro_batches, start_compute
):
    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        assert nodes["B"].apply_held(0, {"B": 8}) is False  # B holds no samples of the step
        _train(nodes["A"].worker, micro_batches[:1])
        _close(nodes, 0, {"A": 8}, to=["A"])
        assert nodes["A"].apply_held(0, {"A": 8}) is False  # the close decides: the usual checks
        task = asyncio.create_task(nodes["A"].run())
        await _until(lambda: nodes["A"].counters.steps == 1)
        task.cancel()
        assert nodes["A"].counters.held_steps == 0 and nodes["A"].counters.lenient_steps == 0

    asyncio.run(scenario())
