"""A global step across a stage's replicas (runtime/server/stage_steps.py): two real coordinators and stage
workers, joined by an in-process network whose faults the tests choose (no sleeps, no sockets)."""

import asyncio
import time

import pytest
import torch

from swarmtrain.model.device import ComputeDevice
from swarmtrain.net.protocol import Message, StageRequest
from swarmtrain.planner.catch_up import LagRule, left_behind
from swarmtrain.runtime.server.chain_hop import Admitted
from swarmtrain.runtime.server.stage_catch_up import Replay, StageCatchUp, StepsBridge
from swarmtrain.runtime.server.stage_desk import Admission, MicroBatchDesk
from swarmtrain.runtime.server.stage_steps import StepCoordinator, StepSettings
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.runtime.server.step_versions import VersionGate
from swarmtrain.runtime.trainer.step_tracker import StepTracker
from swarmtrain.utils.silence import PeerSilent

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def micro_batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 64, 64, generator=generator), torch.randint(0, 256, (8, 64), generator=generator))
        for _ in range(4)
    ]


class Net:
    """Delivers `grads` between coordinators; `unreachable` peers fail like a dead process."""

    def __init__(self):
        self.nodes: dict[str, StepCoordinator] = {}
        self.unreachable: set[str] = set()
        self.freeze_when_replayed_from: set[str] = set()  # they freeze once asked for a step's means
        self.frozen: set[str] = set()
        self.sent: list[tuple[str, str, int]] = []

    def sender(self, me: str):
        async def send(peer, step, samples, sums):
            self.sent.append((me, peer, step))
            if peer in self.unreachable:
                return False
            # as the wire delivers them: decoded on the host, wherever the sender computed them
            self.nodes[peer].inbox.on_grads(me, step, samples, [s.to("cpu", copy=True) for s in sums])
            return True

        return send


def _train(worker, batches, step=0, prefix="m"):
    for i, (x, y) in enumerate(batches):
        worker.forward(StageRequest("forward_backward", f"{prefix}{i}", "none", x, labels=y, step=step))


async def _replicas(cfg, names, net, start_compute, settings=None, devices=None):
    """`devices`: name -> torch device of that replica's compute (default: the host)."""
    nodes = {}
    for name in names:
        device = (devices or {}).get(name, "cpu")
        worker = StageWorker(cfg, cfg.stages()[1], compute=ComputeDevice(torch.device(device)))
        compute = start_compute()
        settings = settings or StepSettings(close_timeout_s=5.0, exchange_timeout_s=5.0, poll_s=0.05)
        nodes[name] = StepCoordinator(worker, compute, name, net.sender(name), settings)
        net.nodes[name] = nodes[name]
    return nodes


async def _split_over_two(cfg, batches, net, start_compute):
    """Replicas A (3 of 4 micro-batches) and B (the last), and `single`, one worker holding all four:
    what one replica of every sample applies."""
    nodes = await _replicas(cfg, ["A", "B"], net, start_compute)
    single = StageWorker(cfg, cfg.stages()[1])
    _train(nodes["A"].worker, batches[:3])
    _train(nodes["B"].worker, batches[3:], prefix="b")
    _train(single, batches)
    return nodes, single


def _apply_all(worker):
    bucket = worker.seal(worker.epoch)
    worker.apply_step(worker.epoch, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)


def _close(nodes, step, members, shard=0, shards=1, to=None):
    for name in to or nodes:
        nodes[name].inbox.on_close(step, shard, shards, members, sorted(nodes))


async def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_replicas_sum_their_samples_and_apply_exactly_one_global_batch(
    tiny_cfg, micro_batches, start_compute
):
    """3 micro-batches on A, 1 on B: both apply the mean over all 32 samples, like one replica."""

    async def scenario():
        net = Net()
        nodes, single = await _split_over_two(tiny_cfg, micro_batches, net, start_compute)
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        parked = asyncio.create_task(nodes["B"].versions.wait(1, time.monotonic() + 10))
        await asyncio.sleep(0.05)
        assert not parked.done()  # step 1's forwards wait for step 0's parameters
        _close(nodes, 0, {"A": 24, "B": 8})
        assert await parked
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        _apply_all(single)
        # each replica sends to the other one only: a send to itself was a failed dial every step
        assert sorted((me, peer) for me, peer, _ in net.sent) == [("A", "B"), ("B", "A")]
        for node in nodes.values():
            assert node.worker.samples_seen == 32 and node.counters.last_group_size == 2
            for p, q in zip(node.worker.params, single.params, strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)

    asyncio.run(scenario())


def test_an_unreachable_member_is_not_waited_for(tiny_cfg, micro_batches, start_compute):
    async def scenario():
        net = Net()
        settings = StepSettings(close_timeout_s=5.0, exchange_timeout_s=60.0, poll_s=0.05)
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute, settings)
        _train(nodes["A"].worker, micro_batches[:2])
        net.unreachable.add("B")  # B died after accumulating its share (which is lost with it)
        task = asyncio.create_task(nodes["A"].run())
        start = time.monotonic()
        _close(nodes, 0, {"A": 16, "B": 16}, to=["A"])
        await _until(lambda: nodes["A"].counters.steps == 1)
        task.cancel()
        assert time.monotonic() - start < 5.0  # not the 60 s exchange timeout
        assert nodes["A"].counters.partial_exchanges == 1 and nodes["A"].worker.samples_seen == 16

    asyncio.run(scenario())


def _pinged(frozen: set[str], pings: list[str]):
    async def alive(peer: str) -> bool:
        pings.append(peer)
        return peer not in frozen

    return alive


def test_a_frozen_member_is_pinged_and_left_out(tiny_cfg, micro_batches, start_compute):
    """B is named in the close but frozen (no sums, no connection error): A pings it once its sums are
    late and steps without it, long before the 60 s exchange timeout (the test's wait is 10 s)."""

    async def scenario():
        net, pings = Net(), []
        settings = StepSettings(close_timeout_s=5.0, exchange_timeout_s=60.0, poll_s=0.05, probe_after_s=0.05)
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute, settings)
        nodes["A"].sums_out.alive = _pinged({"B"}, pings)
        _train(nodes["A"].worker, micro_batches[:2])
        task = asyncio.create_task(nodes["A"].run())
        _close(nodes, 0, {"A": 16, "B": 16}, to=["A"])
        await _until(lambda: nodes["A"].counters.steps == 1)
        task.cancel()
        assert pings == ["B"]
        assert nodes["A"].counters.partial_exchanges == 1 and nodes["A"].worker.samples_seen == 16

    asyncio.run(scenario())


def test_a_slow_member_that_answers_pings_is_waited_for(tiny_cfg, micro_batches, start_compute):
    async def scenario():
        net, pings = Net(), []
        settings = StepSettings(close_timeout_s=5.0, exchange_timeout_s=60.0, poll_s=0.05, probe_after_s=0.05)
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute, settings)
        nodes["A"].sums_out.alive = _pinged(set(), pings)
        _train(nodes["A"].worker, micro_batches[:2])
        _train(nodes["B"].worker, micro_batches[2:], prefix="b")
        task = asyncio.create_task(nodes["A"].run())
        _close(nodes, 0, {"A": 16, "B": 16}, to=["A"])
        await _until(lambda: len(pings) >= 3)  # B is late and keeps answering
        assert nodes["A"].counters.steps == 0
        _close(nodes, 0, {"A": 16, "B": 16}, to=["B"])
        b = asyncio.create_task(nodes["B"].run())
        await _until(lambda: nodes["A"].counters.steps == 1)
        task.cancel()
        b.cancel()
        assert nodes["A"].counters.partial_exchanges == 0 and nodes["A"].worker.samples_seen == 32
        assert set(pings) == {"B"}

    asyncio.run(scenario())


def test_a_step_is_closing_only_once_a_close_or_gradients_arrived(tiny_cfg, start_compute):
    """The step loop waits on an empty entry for the current step; that alone is not "closing" (a
    restored replica held back by it never adopted the other stages' step after a whole-swarm crash)."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        task = asyncio.create_task(nodes["A"].run())
        await _until(lambda: 0 in nodes["A"].pending)
        assert not nodes["A"].inbox.closing(0)
        nodes["A"].inbox.on_grads("B", 0, 8, [])
        assert nodes["A"].inbox.closing(0)
        nodes["B"].inbox.on_close(0, 0, 1, {"B": 8}, ["B"])
        assert nodes["B"].inbox.closing(0) and not nodes["B"].inbox.closing(1)
        task.cancel()

    asyncio.run(scenario())


def test_a_step_waits_for_every_trainer_or_the_close_timeout(tiny_cfg, micro_batches, start_compute):
    async def scenario():
        net = Net()
        settings = StepSettings(close_timeout_s=0.3, exchange_timeout_s=5.0, poll_s=0.05)
        nodes = await _replicas(tiny_cfg, ["A"], net, start_compute, settings)
        _train(nodes["A"].worker, micro_batches[:2])
        task = asyncio.create_task(nodes["A"].run())
        nodes["A"].inbox.on_close(0, 0, 2, {"A": 16}, ["A"])  # trainer 0 of 2; trainer 1 never closes
        await asyncio.sleep(0.15)
        assert nodes["A"].worker.epoch == 0
        await _until(lambda: nodes["A"].counters.steps == 1)
        task.cancel()
        assert nodes["A"].counters.timed_out_closes == 1

    asyncio.run(scenario())


def test_gradients_no_trainer_saw_are_not_counted(tiny_cfg, micro_batches, start_compute):
    """Every replica must sum the same set: a replica the closes do not list keeps its work out."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        _train(nodes["A"].worker, micro_batches[:2])
        _train(nodes["B"].worker, micro_batches[2:3], prefix="b")  # its reply was lost: unlisted
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        _close(nodes, 0, {"A": 16})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        assert nodes["B"].counters.unconfirmed_samples == 8
        assert all(n.worker.samples_seen == 16 for n in nodes.values())
        for p, q in zip(nodes["A"].worker.params, nodes["B"].worker.params, strict=True):
            assert torch.equal(p, q)

    asyncio.run(scenario())


def test_tracker_closes_a_stage_when_all_its_micro_batches_are_done():
    closed = []
    tracker = StepTracker(
        2, 2, start_step=5, close=lambda step, stage, members: closed.append((step, stage, members))
    )
    assert [tracker.begin() for _ in range(3)] == [5, 5, 6]
    tracker.finished(5, 1, "L", 8)
    tracker.finished(5, 1, "L", 8)
    assert closed == [(5, 1, {"L": 16})]  # the last stage closes before the first one is done
    tracker.finished(5, 0, "A", 8)
    tracker.finished(5, 0)  # this micro-batch failed before stage 0's backward
    assert closed[-1] == (5, 0, {"A": 8}) and tracker.closed_steps == 1
    assert tracker.step_in_progress
    tracker.truncate()  # the trainer stops with one micro-batch of step 6 started
    tracker.finished(6, 1, "L", 8)
    tracker.finished(6, 0, "B", 8)
    assert closed[-2:] == [(6, 1, {"L": 8}), (6, 0, {"B": 8})] and tracker.next_step == 7


def test_three_replicas_hold_bitwise_equal_parameters_after_a_step(tiny_cfg, micro_batches, start_compute):
    """fp32 sums added in a different order differ in the last bits: each replica appended its own
    sums last, and a 3-replica stage drifted apart (found by bench/chaos.py)."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B", "C"], net, start_compute)
        _train(nodes["A"].worker, micro_batches[:2])
        _train(nodes["B"].worker, micro_batches[2:3], prefix="b")
        _train(nodes["C"].worker, micro_batches[3:], prefix="c")
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        _close(nodes, 0, {"A": 16, "B": 8, "C": 8})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        a, b, c = (nodes[n].worker.params for n in "ABC")
        for p, q, r in zip(a, b, c, strict=True):
            assert torch.equal(p, q) and torch.equal(p, r)

    asyncio.run(scenario())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_sums_and_updates_where_the_replica_computes(tiny_cfg, micro_batches, start_compute, device):
    """A's sums stay on its compute device through the step (a GPU replica copied a whole gradient to
    the host and back every step); B's arrive decoded on the host and are added there too; both apply
    what one replica of every sample applies, and the means kept for replays are on the host."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B"], net, start_compute, devices={"A": device})
        single = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
        _train(nodes["A"].worker, micro_batches[:3])
        _train(nodes["B"].worker, micro_batches[3:], prefix="b")
        _train(single, micro_batches)
        assert {g.device.type for g in nodes["A"].worker.bucket(0).grad_sums} == {torch.device(device).type}
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        _close(nodes, 0, {"A": 24, "B": 8})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        _apply_all(single)
        for node in nodes.values():
            assert node.worker.samples_seen == 32
            for p, q in zip(node.worker.params, single.params, strict=True):
                torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
            _, kept = node.means_of(0)
            assert {m.device.type for m in kept} == {"cpu"}

    asyncio.run(scenario())


def _local_round_in_process(cfg, rounds):
    """One replica's two local steps as a stage server takes them, without any network."""
    worker = StageWorker(cfg, cfg.stages()[1])
    for step, (batches, prefix) in enumerate(rounds):
        _train(worker, batches, step=step, prefix=prefix)
        bucket = worker.seal(step)
        means = [g / bucket.samples for g in bucket.grad_sums]
        worker.apply_step(step, means, bucket.samples, hold_epoch=worker.is_sync_step(step))
    return worker


def test_local_steps_differ_between_rounds_and_agree_after_each(tiny_cfg, micro_batches, start_compute):
    """swarm.local_steps = 2: step 0 is each replica's own AdamW step (A and B differ, no grads sent);
    step 1 ends with an outer round: both apply the samples-weighted mean pseudo-gradient to the same
    anchor and hold bitwise-equal parameters, equal to the same round computed in process; step 2's
    forwards wait for the round."""
    import dataclasses

    cfg = tiny_cfg.replace(swarm=dataclasses.replace(tiny_cfg.swarm, local_steps=2))
    rounds_a = [(micro_batches[:3], "m"), (micro_batches[:1], "a1")]
    rounds_b = [(micro_batches[3:], "b"), (micro_batches[1:3], "b1")]

    async def scenario():
        net = Net()
        nodes = await _replicas(cfg, ["A", "B"], net, start_compute)
        a, b = nodes["A"].worker, nodes["B"].worker
        tasks = [asyncio.create_task(n.run()) for n in nodes.values()]
        _train(a, rounds_a[0][0], prefix=rounds_a[0][1])
        _train(b, rounds_b[0][0], prefix=rounds_b[0][1])
        _close(nodes, 0, {"A": 24, "B": 8})
        await _until(lambda: a.epoch == 1 and b.epoch == 1)
        assert net.sent == []  # a local step exchanges nothing
        assert not all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))

        _train(a, rounds_a[1][0], step=1, prefix=rounds_a[1][1])
        _train(b, rounds_b[1][0], step=1, prefix=rounds_b[1][1])
        parked = asyncio.create_task(nodes["B"].versions.wait(2, time.monotonic() + 10))
        await asyncio.sleep(0.05)
        assert not parked.done()
        _close(nodes, 1, {"A": 8, "B": 16})
        assert await parked
        await _until(lambda: all(n.counters.last_group_size == 2 for n in nodes.values()))
        for task in tasks:
            task.cancel()
        assert sorted(net.sent) == [("A", "B", 1), ("B", "A", 1)]
        assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
        assert a.samples_since_sync == 0 and a.epoch == 2
        # every replica stepped on its own gradient: there is no shared mean for a replay
        assert nodes["A"].kept_means is None and nodes["A"].means_of(0) is None

        # the same round in process: pseudo-gradients weighted by samples since the anchor (32, 24)
        a2, b2 = _local_round_in_process(cfg, rounds_a), _local_round_in_process(cfg, rounds_b)
        (na, da), (nb, db) = a2.pseudo_gradient(), b2.pseudo_gradient()
        assert (na, nb) == (32, 24)
        mean = [(x * na + y * nb) / (na + nb) for x, y in zip(da, db, strict=True)]
        a2.finish_sync(1, mean)
        for p, q in zip(a.params, a2.params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)

    asyncio.run(scenario())


def test_a_replica_that_missed_steps_replays_them_from_a_peers_means(tiny_cfg, micro_batches, start_compute):
    """C was no participant of steps 0 and 1 (it joined while they were closed): it applies them from
    A's kept mean gradients and ends with A's parameters and optimizer state, bitwise, without a state
    download; a step A no longer keeps, or one C holds samples of, is refused (C resyncs instead)."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "B", "C"], net, start_compute)
        tasks = [asyncio.create_task(nodes[n].run()) for n in "AB"]
        for step in (0, 1):
            _train(nodes["A"].worker, micro_batches[:2], step=step, prefix=f"a{step}")
            _train(nodes["B"].worker, micro_batches[2:], step=step, prefix=f"b{step}")
            _close(nodes, step, {"A": 16, "B": 16}, to="AB")
            # the epoch moves on the compute thread before the loop keeps the step's means: wait for both
            await _until(
                lambda s=step: (
                    nodes["A"].worker.epoch == s + 1 == nodes["B"].worker.epoch
                    and nodes["A"].means_of(s) is not None
                )
            )
        for task in tasks:
            task.cancel()
        a, c = nodes["A"], nodes["C"]
        stepped: list[tuple[int, bool]] = []  # what the stage service hears (it saves live steps only)
        c.on_step = lambda epoch, fingerprint, live, own: stepped.append((epoch, live))
        for step in (0, 1):
            samples, means = a.means_of(step)
            assert samples == 32
            assert await c.replay(step, samples, means)
        assert stepped == [(1, False), (2, False)]
        assert c.worker.epoch == 2 and c.counters.replayed_steps == 2 and c.worker.samples_seen == 64
        for p, q in zip(a.worker.params, c.worker.params, strict=True):
            assert torch.equal(p, q)
        state_a, state_c = a.worker.optimizer.state_dict()["state"], c.worker.optimizer.state_dict()["state"]
        for key, moments in state_a.items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(moments[name], state_c[key][name])
        # kept: the last KEPT_STEP_MEANS steps; replay only at this replica's own epoch
        assert a.means_of(5) is None and not await c.replay(1, 32, a.means_of(1)[1])
        _train(c.worker, micro_batches[:1], step=2, prefix="c")  # samples of its own: not replayed
        assert not await c.replay(2, 32, a.means_of(1)[1])

    asyncio.run(scenario())


def test_an_epoch_moved_by_the_sync_thread_is_reached_by_the_step_loop_at_once(tiny_cfg, start_compute):
    """Netbed chaos, seed 2: a trainer's empty close came 0.16 s after an adoption, before the step loop's
    next poll reached the step; taken for a close sent ahead of the step, it waited a second close
    timeout (20 s without a micro-batch). The adoption wakes the step loop: the step is reached then."""

    async def scenario():
        settings = StepSettings(close_timeout_s=5.0, exchange_timeout_s=5.0, poll_s=5.0)  # a slow poll
        node = (await _replicas(tiny_cfg, ["C"], Net(), start_compute, settings))["C"]
        bridge = StepsBridge(node, None, asyncio.get_running_loop())
        loop_task = asyncio.create_task(node.run())
        await _until(lambda: 0 in node.pending and node.pending[0].reached_s is not None)

        def adopt() -> float:  # what the sync thread does
            node.worker.advance_to(3)
            bridge.epoch_moved()
            return time.monotonic()

        moved_s = await asyncio.to_thread(adopt)
        await _until(lambda: 3 in node.pending and node.pending[3].reached_s is not None, timeout_s=2.0)
        assert node.pending[3].reached_s - moved_s < 1.0
        loop_task.cancel()

    asyncio.run(scenario())


def test_a_step_being_finished_holds_the_catch_up_until_its_bookkeeping_ran(tiny_cfg, start_compute):
    """The apply moves the epoch inside its compute job; `untrained` and the rest are updated only when
    `_finish` returns. In between, the catch-up must still see the step as being finished, or it reads a
    replica at the new epoch that seems never to have stepped."""

    async def scenario():
        node = (await _replicas(tiny_cfg, ["C"], Net(), start_compute))["C"]
        bridge = StepsBridge(node, None, asyncio.get_running_loop())
        assert not bridge.finishing()
        node.finishing = 0
        node.worker.advance_to(1)  # the epoch moved, `_finish` of step 0 not yet returned
        assert bridge.finishing()
        node.finishing = None
        assert not bridge.finishing()

    asyncio.run(scenario())


def test_a_replica_trailing_its_stage_refuses_requests_at_once_and_lets_go_of_held_ones(
    tiny_cfg, micro_batches, start_compute
):
    """Netbed chaos, seed 0: a replica 38 steps behind (its link just back) held two micro-batches for
    12 s while it replayed, and the stage closed their step without them. Once a trainer's close shows
    the stage far past it, a request it would hold is refused (the caller tries another replica), and
    one already held is let go; a request it can serve soon, and an evaluation, are still admitted."""

    async def scenario():
        node = (await _replicas(tiny_cfg, ["C"], Net(), start_compute))["C"]
        bridge = StepsBridge(node, None, asyncio.get_running_loop())
        catch_up = StageCatchUp(node.worker, bridge, LagRule(window=bridge.window))
        desk = MicroBatchDesk(
            tiny_cfg, None, None, "", node.worker, None, node, catch_up, Admission(lambda: True), None
        )

        def behind() -> bool:
            return left_behind(bridge.swarm_ahead(), node.worker.epoch, time.monotonic(), catch_up.rule)

        x, y = micro_batches[0]

        def admit(step, kind="forward_backward"):
            request = StageRequest(kind, f"m{step}", "none", x, labels=y, step=step)
            return asyncio.create_task(desk._admit(request, {"timeout_s": 5.0}))

        held = admit(9)
        await asyncio.sleep(0.1)
        assert not held.done()  # no close says the stage is ahead: the whole stage may be behind
        assert not behind()
        assert not node.inbox.on_close(9, 0, 1, {"A": 8}, ["A", "C"], "t")  # too far ahead to keep
        assert behind()  # the sync thread now asks its peers' epochs directly
        answer = await asyncio.wait_for(held, 1.0)
        assert isinstance(answer, Message) and answer.header["code"] == "unavailable"
        assert "behind its stage" in answer.header["error"]
        refused = await asyncio.wait_for(admit(10), 1.0)
        assert isinstance(refused, Message) and refused.header["code"] == "unavailable"
        assert isinstance(await asyncio.wait_for(admit(0), 1.0), Admitted)  # its own step runs
        evaluation = admit(9, "evaluate")  # an evaluation names the parameters it must see: it waits
        await asyncio.sleep(0.1)
        assert not evaluation.done()
        evaluation.cancel()

    asyncio.run(scenario())


def test_a_close_past_the_window_is_evidence_of_the_stage_ahead_vouched_or_not(tiny_cfg, start_compute):
    """The inbox keeps the newest step any close named and the last close past the window, and apart the
    last one from a sender whose closes were found true here: a stranger's close far ahead makes the
    replica ask its peers, only a vouched one lets it leave its step (planner/catch_up.py)."""

    async def scenario():
        inbox = (await _replicas(tiny_cfg, ["C"], Net(), start_compute))["C"].inbox
        assert inbox.ahead.newest_step == -1 and inbox.ahead.latest is None
        inbox.vouch(["t"])
        inbox.on_close(40, 0, 1, {"A": 8}, ["A", "C"], "t")
        assert inbox.ahead.trusted is not None and inbox.ahead.trusted.step == 40
        inbox.on_close(10**9, 0, 1, {"A": 8}, ["A", "C"], "X")  # a stranger's
        ahead = inbox.ahead
        assert ahead.newest_step == 10**9 and ahead.latest.step == 10**9 and ahead.trusted.step == 40
        inbox.on_close(1, 0, 1, {"A": 8}, ["A", "C"], "t")  # within the window: no evidence
        assert inbox.ahead.latest == ahead.latest and inbox.ahead.trusted == ahead.trusted

    asyncio.run(scenario())


def test_recent_means_are_kept_within_a_byte_budget(tiny_cfg, start_compute, monkeypatch):
    """A moved server's download lasts several of `tiny`'s steps: the means of as many steps as fit the
    budget are kept (at least KEPT_STEP_MEANS, at most MAX_REPLAY_STEPS), so it replays them instead of
    downloading the state again."""
    from swarmtrain.runtime.server import stage_steps

    async def scenario():
        (node,) = (await _replicas(tiny_cfg, ["A"], Net(), start_compute)).values()
        means = [torch.zeros_like(p) for p in node.worker.params]
        step_bytes = sum(m.numel() * m.element_size() for m in means)
        for budget_steps, kept in (
            (1, stage_steps.KEPT_STEP_MEANS),
            (10, 10),
            (10_000, stage_steps.MAX_REPLAY_STEPS),
        ):
            monkeypatch.setattr(stage_steps, "KEPT_MEANS_BYTES", budget_steps * step_bytes)
            node.kept_means.steps.clear()
            for step in range(100):
                node.kept_means.keep(step, 32, means)
            assert list(node.kept_means.steps) == list(range(100 - kept, 100))
        node.kept_means.keep(100, 32, None)  # a step every micro-batch of which failed: nothing to size
        assert node.means_of(100) == (32, None)

    asyncio.run(scenario())


class NetLink:
    """`StagePeerLink` as the catch-up uses it (epochs asked with a ping, a step's means), over `Net`:
    an unreachable peer is silent."""

    request_timeout_s = 5.0
    client = object()  # not None: the link can call

    def __init__(self, net: Net):
        self.net = net

    async def epoch_of(self, peer):
        if peer in self.net.frozen:
            await asyncio.sleep(0.5)  # a frozen peer's ping is never answered: None at its deadline
            return None
        return None if peer in self.net.unreachable else self.net.nodes[peer].worker.epoch

    async def step_means(self, peer, step):
        if peer in self.net.unreachable:
            raise ConnectionError(f"{peer} is unreachable")
        if peer in self.net.freeze_when_replayed_from | self.net.frozen:
            self.net.frozen.add(peer)
            raise PeerSilent(f"{peer} stopped answering pings")  # what the real link's watch raises
        kept = self.net.nodes[peer].means_of(step)
        if kept is None:
            raise ConnectionError(f"the means of step {step} are not kept at {peer}")
        return kept


class StuckSync:
    """The synchronizer as the catch-up reaches it (`SyncPort`): the DHT's records lapsed (they show
    nobody), and what the catch-up asked of it is recorded."""

    fresh_state = False
    stopping = False

    def __init__(self):
        self.calls: list[tuple] = []

    def recorded_peers(self):
        return {}

    def diverged_from(self, others):
        return frozenset()

    def resync(self, reason):
        self.calls.append(("resync", reason))

    def check_other_stages(self, epoch, now_s, stranded_grace_s=None, abandon_close=False, at_least=0):
        self.calls.append(("adopt", epoch, stranded_grace_s, abandon_close))

    def stop_adopting(self):
        pass

    def publish(self):
        pass


def test_a_replica_stuck_on_a_close_whose_sums_it_never_got_replays_the_step_from_a_peer_that_applied_it(
    tiny_cfg, micro_batches, start_compute
):
    """Netbed chaos, seed 1: a stage-1 replica downloaded its state at step 745 while its peer applied
    step 745 alone; the peer's sums had gone to it during the download and were refused, the trainers'
    closes of 745 named only the peer, the DHT's records had lapsed, and the peer's link was then cut:
    the replica waited 65 s on a step it could never close, the stage's only reachable replica. Stuck on
    the close for the lag grace, it asks its peers: one that answers ahead applied the step, and C
    replays it from that peer's means (bitwise A's state); when the peer that ran it is silent, a vouched
    close lets it adopt the other stages' step although its own step has a close, a stranger's does not."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "C"], net, start_compute)
        a, c = nodes["A"], nodes["C"]
        for node in (a, c):
            node.inbox.live = lambda: frozenset("AC")  # the stage's replicas as the DHT last showed them
        tasks = [asyncio.create_task(n.run()) for n in (a, c)]
        net.unreachable.add("C")  # A's sums of step 0 never reach C
        _train(a.worker, micro_batches[:2], prefix="a")
        for node in (a, c):
            node.inbox.vouch(["t"])
            node.inbox.on_close(0, 0, 1, {"A": 16}, ["A", "C"], "t")
        await _until(lambda: a.worker.epoch == 1 and a.means_of(0) is not None)
        net.unreachable.discard("C")
        patient = LagRule(lag_grace_s=60.0, window=4)  # the close is younger than this lag grace
        catch_up = StageCatchUp(c.worker, StepsBridge(c, NetLink(net), asyncio.get_running_loop()), patient)
        sync = StuckSync()
        await asyncio.to_thread(catch_up.tick, sync)
        assert c.worker.epoch == 0 and sync.calls == []  # nothing asked, nothing done
        catch_up.rule = RULE
        await asyncio.sleep(RULE.lag_grace_s + 0.1)
        await asyncio.to_thread(catch_up.tick, sync)
        assert c.worker.epoch == 1 and c.counters.replayed_steps == 1 and sync.calls == []
        assert all(torch.equal(p, q) for p, q in zip(a.worker.params, c.worker.params, strict=True))
        # step 1: A applies it alone again, then falls silent (its link cut) before C can ask
        net.unreachable.add("C")
        _train(a.worker, micro_batches[2:], step=1, prefix="a1")
        for node, sender in ((a, "t"), (c, "t")):
            node.inbox.on_close(1, 0, 1, {"A": 16}, ["A", "C"], sender)
        await _until(lambda: a.worker.epoch == 2)
        net.unreachable.add("A")
        await asyncio.sleep(RULE.lag_grace_s + 0.1)
        await asyncio.to_thread(catch_up.tick, sync)
        assert c.worker.epoch == 1 and sync.calls == [("adopt", 1, RULE.lag_grace_s, True)]
        c.inbox.trusted.clear()  # the same, but the close is a stranger's: C never leaves its step for it
        sync.calls.clear()
        await asyncio.sleep(RULE.lag_grace_s + 0.1)
        await asyncio.to_thread(catch_up.tick, sync)
        assert sync.calls == [] and c.worker.epoch == 1
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


RULE = LagRule(lag_grace_s=0.3, window=4)


def test_a_replay_follows_its_donor_to_the_steps_it_applied_meanwhile(tiny_cfg, micro_batches, start_compute):
    """Netbed chaos, seed 2: a joiner replayed up to the step its peer answered (825) while the peer
    applied 825-828; stopped there, it held the trainers' requests of step 829, and the peer was cut off
    2 s later: 30 s without a completed micro-batch. A replay asked up to step 1 goes on to step 2, where
    its donor is now, bitwise the donor's state."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "C"], net, start_compute)
        a, c = nodes["A"], nodes["C"]
        tasks = [asyncio.create_task(n.run()) for n in (a, c)]
        net.unreachable.add("C")  # A applies steps 0 and 1 alone
        for step, batches in ((0, micro_batches[:2]), (1, micro_batches[2:])):
            _train(a.worker, batches, step=step, prefix=f"a{step}")
            a.inbox.on_close(step, 0, 1, {"A": 16}, ["A"], "t")
            await _until(lambda step=step: a.worker.epoch == step + 1 and a.means_of(step) is not None)
        net.unreachable.clear()
        bridge = StepsBridge(c, NetLink(net), asyncio.get_running_loop())
        assert await asyncio.to_thread(bridge.replay, "A", 0, 1) is Replay.DONE
        assert c.worker.epoch == 2 and c.counters.replayed_steps == 2
        assert all(torch.equal(p, q) for p, q in zip(a.worker.params, c.worker.params, strict=True))
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


class DonorClient:
    """A stage peer's client as `StagePeerLink.step_means` uses it: the means come after `means_s`;
    the peer answers pings while `alive` (a frozen one never does)."""

    def __init__(self, means_s: float, alive: bool):
        self.means_s, self.alive, self.pings = means_s, alive, 0

    async def call(self, peer, message, timeout_s):
        if message.kind == "grads":  # a step's exchange, at once: the link times its peer with it
            return Message("result", {"ok": True})
        await asyncio.sleep(self.means_s)
        return Message("result", {"samples": 8, "empty": True})

    async def ping_reply(self, peer, message, timeout_s):
        self.pings += 1
        return Message("result", {"epoch": 3}) if self.alive else None


@pytest.mark.parametrize("alive", [True, False])
def test_a_replay_gives_up_a_donor_that_stops_answering_pings(tiny_cfg, alive, monkeypatch):
    """A step's means from a peer that answers pings are waited for however long they take (a slow link);
    from one that does not, the call ends at its first unanswered ping (`PeerSilent`), long before its
    request timeout (netbed chaos, seed 0: a donor frozen during a replay held the stage 10 s). The
    pings are sized for the means (`reply_ping_timeout_s`): here fp32 sums were exchanged at once, so
    the floor."""
    import swarmtrain.runtime.server.stage_exchange as exchange
    from swarmtrain.runtime.faults import FaultHooks
    from swarmtrain.runtime.server.stage_exchange import StagePeerLink
    from swarmtrain.runtime.server.sums_codec import SumsCodec

    sized = []  # the sizes the pings' timeout was asked for: our sums', the means'

    def reply_ping_timeout_s(times, sums_bytes, reply_bytes):
        sized.append((sums_bytes, reply_bytes))
        return exchange.exchange_ping_timeout_s(times, sums_bytes)

    monkeypatch.setattr(exchange, "reply_ping_timeout_s", reply_ping_timeout_s)

    async def scenario():
        spec = tiny_cfg.stages()[1]
        worker = StageWorker(tiny_cfg, spec)
        link = StagePeerLink(spec, "d", worker, FaultHooks(), 5.0, request_timeout_s=60.0)
        # alive: past the first ping check (the floor, 1 s), so the call was waited for after a ping
        client = DonorClient(means_s=1.5 if alive else 4.0, alive=alive)
        link.attach(client)
        zeros = SumsCodec().encode([torch.zeros(p.shape) for p in worker.params])
        assert await link.send_grads("peer", 0, 8, zeros)
        if alive:
            assert await link.step_means("peer", 3) == (8, None)
            assert client.pings >= 1  # asked meanwhile, and waited for
        else:
            with pytest.raises(PeerSilent):
                await asyncio.wait_for(link.step_means("peer", 3), 3.5)  # the call alone takes 4 s
            assert client.pings == 1
        fp32_bytes = 4 * sum(p.numel() for p in worker.params)
        assert sized == [(fp32_bytes, fp32_bytes)]  # sized for the fp32 means it queues behind

    asyncio.run(scenario())


def test_a_replica_whose_donor_freezes_during_the_replay_adopts_the_step_without_downloading(
    tiny_cfg, micro_batches, start_compute
):
    """Netbed chaos, seed 0: a woken stage-1 replica was replaying a step from its only peer when that
    peer froze; the replay took a whole request timeout to fail, the download from the same frozen peer
    3 s more, and the trainers waited 33 s. A donor that stops answering pings ends the replay
    (`Replay.DONOR_SILENT`) with no download; the next tick asks again: the frozen peer's ping is never
    answered, the live peer D answers, and with the step's only holder silent the replica adopts the
    step although it has a close."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "C", "D"], net, start_compute)
        a, c = nodes["A"], nodes["C"]
        for node in nodes.values():
            node.inbox.live = lambda: frozenset("ACD")
        tasks = [asyncio.create_task(n.run()) for n in (a, c)]
        net.unreachable.update("CD")  # A's sums of step 0 reach neither
        _train(a.worker, micro_batches[:2], prefix="a")
        for node in (a, c):
            node.inbox.vouch(["t"])
            node.inbox.on_close(0, 0, 1, {"A": 16}, ["A", "C"], "t")
        await _until(lambda: a.worker.epoch == 1 and a.means_of(0) is not None)
        net.unreachable.clear()
        net.freeze_when_replayed_from.add("A")
        catch_up = StageCatchUp(c.worker, StepsBridge(c, NetLink(net), asyncio.get_running_loop()), RULE)
        sync = StuckSync()
        await asyncio.sleep(RULE.lag_grace_s + 0.1)
        await asyncio.to_thread(catch_up.tick, sync)  # A answers ahead, then freezes: no download
        assert c.worker.epoch == 0 and c.counters.replayed_steps == 0 and sync.calls == []
        await asyncio.to_thread(catch_up.tick, sync)  # A silent, D at step 0: the holder is silent
        assert sync.calls == [("adopt", 0, RULE.lag_grace_s, True)]
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_a_replica_that_holds_a_request_back_replays_the_step_its_peer_applied(
    tiny_cfg, micro_batches, start_compute
):
    """Netbed chaos, seed 0: a stage-1 replica far behind adopted the other stages' step 622 while its
    frozen peer had already applied 622 alone; the closes of 622 had gone to the peer, the DHT's records
    had lapsed, and the trainers' requests of step 624 waited here for parameters it never reached, 60 s
    in all. A request held back for the lag grace makes it ask its peers; the one that answers ahead
    applied the step, which C replays from its means (bitwise A's state), and the request runs."""

    async def scenario():
        net = Net()
        nodes = await _replicas(tiny_cfg, ["A", "C"], net, start_compute)
        a, c = nodes["A"], nodes["C"]
        for node in (a, c):
            node.inbox.live = lambda: frozenset("AC")
        tasks = [asyncio.create_task(n.run()) for n in (a, c)]
        net.unreachable.add("C")  # A's sums of step 0 never reach C, nor does any close of step 0
        _train(a.worker, micro_batches[:2], prefix="a")
        a.inbox.on_close(0, 0, 1, {"A": 16}, ["A"], "t")
        await _until(lambda: a.worker.epoch == 1 and a.means_of(0) is not None)
        net.unreachable.discard("C")
        held = asyncio.create_task(c.versions.wait(1, time.monotonic() + 30))  # a request of step 2
        await asyncio.sleep(0.05)
        catch_up = StageCatchUp(c.worker, StepsBridge(c, NetLink(net), asyncio.get_running_loop()), RULE)
        sync = StuckSync()
        await asyncio.to_thread(catch_up.tick, sync)
        assert c.worker.epoch == 0 and c.counters.replayed_steps == 0  # held briefly: a step finishing
        await asyncio.sleep(RULE.lag_grace_s + 0.1)
        await asyncio.to_thread(catch_up.tick, sync)
        assert c.worker.epoch == 1 and c.counters.replayed_steps == 1 and sync.calls == []
        assert all(torch.equal(p, q) for p, q in zip(a.worker.params, c.worker.params, strict=True))
        assert await asyncio.wait_for(held, 5) and c.versions.held_since(10) is None
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def test_the_version_gate_tells_since_when_a_request_waits_past_the_epoch():
    async def scenario():
        epoch = [3]
        gate = VersionGate(lambda: epoch[0], asyncio.get_running_loop())
        assert await gate.wait(3, time.monotonic() + 1) and gate.held_since(10) is None  # no wait at all
        before_s = time.monotonic()
        first = asyncio.create_task(gate.wait(5, time.monotonic() + 10))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(gate.wait(4, time.monotonic() + 10))
        await asyncio.sleep(0.05)
        since_s = gate.held_since(10)
        assert since_s is not None and before_s <= since_s < before_s + 0.05  # the oldest waiter
        assert gate.held_since(4) > since_s  # the oldest waits for 5: past the window given, not shown
        evaluation = asyncio.create_task(gate.wait(6, time.monotonic() + 10, counted=False))
        await asyncio.sleep(0.01)
        assert gate.held_since(10) == since_s  # an evaluation's wait is never shown
        epoch[0] = 4
        gate.changed()
        assert await asyncio.wait_for(second, 1)
        assert gate.held_since(10) == since_s  # the first still waits for 5
        assert not await gate.wait(5, time.monotonic() + 0.05)  # a deadline: released, not kept
        epoch[0] = 5
        gate.changed()
        assert await asyncio.wait_for(first, 1) and gate.held_since(10) is None
        evaluation.cancel()

    asyncio.run(scenario())


def test_a_step_the_replica_left_meanwhile_is_neither_applied_nor_replayed_twice(
    tiny_cfg, micro_batches, start_compute
):
    """The sync thread may adopt the other stages' step while the step loop finishes a step (a close it
    was stuck on, then given up): the loop's apply finds the epoch moved and applies nothing (it used
    to raise "step 0 applied at epoch 3" into the log); a replay of the step the loop is finishing is
    refused (and the catch-up does not download the state for it: `StepsBridge.finishing`)."""

    async def scenario():
        node = (await _replicas(tiny_cfg, ["C"], Net(), start_compute))["C"]
        node.finishing = 0
        assert not await node.replay(0, 16, None)  # the step loop is finishing step 0
        node.finishing = None
        await asyncio.to_thread(node.worker.advance_to, 3)
        _train(node.worker, micro_batches[:1], step=3, prefix="c")
        bucket_samples = node.worker.unapplied_samples
        await node._apply(0, {}, [], time.monotonic())  # step 0, left for step 3 meanwhile
        assert node.worker.epoch == 3 and node.counters.steps == 0
        assert node.worker.unapplied_samples == bucket_samples

    asyncio.run(scenario())
