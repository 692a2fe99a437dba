"""Forged `close` and `grads` messages in an open run (no run key): a step is decided by what the stage
knows, not by one message (runtime/server/stage_steps.py, planner/step_decision.py). Each forged case of the issue against real
StepCoordinators and stage workers (an in-process network, a fixed view of the stage's live replicas),
then the pure checks one by one. Every replica must step on exactly the honest samples, skip no step and
end with the same parameters as one worker that applied those samples."""

import asyncio
import dataclasses
import time

import pytest
import torch

from swarmtrain.net.protocol import StageRequest
from swarmtrain.planner.step_decision import (
    UNKNOWN_ORIGIN,
    Close,
    StepDecision,
    backed_by_origin,
    close_refusal,
    decide_step,
    settle_step,
    short_close_grace_s,
    step_candidates,
    step_contributions,
    vouched_senders,
)
from swarmtrain.runtime.server.stage_members import LiveReplicas
from swarmtrain.runtime.server.stage_steps import StepCoordinator, StepSettings
from swarmtrain.runtime.server.stage_worker import StageWorker

pytestmark = pytest.mark.unit

STRANGER = "X"  # neither a trainer of the run nor a replica of the stage
TRAINER = "T0"


@pytest.fixture(scope="module")
def micro_batches():
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(8, 64, 64, generator=generator), torch.randint(0, 256, (8, 64), generator=generator))
        for _ in range(6)
    ]


class Net:
    """Delivers `grads` between coordinators (sender id = the authenticated peer id)."""

    def __init__(self):
        self.nodes: dict[str, StepCoordinator] = {}
        self.sent: list[tuple[str, str, int, int]] = []

    def sender(self, me: str):
        async def send(peer, step, samples, sums):
            self.sent.append((me, peer, step, samples))
            if peer not in self.nodes:
                return False  # a stranger's address: nobody answers
            self.nodes[peer].inbox.on_grads(me, step, samples, [s.clone() for s in sums])
            return True

        return send


def _settings(close_timeout_s=5.0, exchange_timeout_s=5.0):
    return StepSettings(close_timeout_s=close_timeout_s, exchange_timeout_s=exchange_timeout_s, poll_s=0.02)


def _view(peers) -> LiveReplicas:
    view = LiveReplicas(keep_s=3600.0)
    view.update(peers)
    return view


def _replicas(cfg, names, net, start_compute, settings=None, live=None, view_of=None, verify=None):
    """Coordinators of stage 1 on `net`, sharing one view of the live replicas (`live`, default: all of
    them) unless `view_of(name)` gives each its own."""
    view = _view(names if live is None else live)
    nodes = {}
    for name in names:
        worker = StageWorker(cfg, cfg.stages()[1])
        nodes[name] = StepCoordinator(
            worker,
            start_compute(),
            name,
            net.sender(name),
            settings or _settings(),
            live_replicas=view if view_of is None else view_of(name),
            verify=verify,
        )
        net.nodes[name] = nodes[name]
    return nodes


def _train(worker, batches, step, prefix, origin=""):
    """`origin`: whose micro-batches they are ("": unknown, any close may claim them)."""
    for i, (x, y) in enumerate(batches):
        request = StageRequest(
            "forward_backward", f"{prefix}{i}", "none", x, labels=y, step=step, origin=origin
        )
        worker.forward(request)


def _close(nodes, step, members, sender=TRAINER, shard=0, shards=1, participants=None, to=None):
    for name in to or nodes:
        nodes[name].inbox.on_close(
            step, shard, shards, dict(members), participants or sorted(nodes), sender=sender
        )


async def _until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _reference(cfg, steps):
    """One worker applying exactly the honest micro-batches of each step: [(batches, prefix), ...] per step."""
    single = StageWorker(cfg, cfg.stages()[1])
    for step, parts in enumerate(steps):
        for batches, prefix in parts:
            _train(single, batches, step, prefix)
        bucket = single.seal(step)
        single.apply_step(step, [g / bucket.samples for g in bucket.grad_sums], bucket.samples)
    return single


def _assert_same_params(workers):
    first, *rest = workers
    for other in rest:
        for p, q in zip(first.params, other.params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def _assert_honest(nodes, reference, steps):
    """Every replica applied `steps` steps, none skipped, with exactly the reference's samples and
    parameters; no partial exchange, nothing left unconfirmed (what would have made a replica resync)."""
    for name, node in nodes.items():
        w = node.worker
        assert w.epoch == steps and node.counters.steps == steps, name
        assert w.counters.skipped_steps == 0, name
        assert w.samples_seen == reference.samples_seen, (name, w.samples_seen, reference.samples_seen)
        assert node.counters.partial_exchanges == 0 and node.counters.unconfirmed_samples == 0, name
        assert node.counters.lenient_steps == 0, name
    _assert_same_params([reference, *(n.worker for n in nodes.values())])


async def _start(nodes):
    return [asyncio.create_task(n.run()) for n in nodes.values()]


async def _stop(tasks):
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# the forged cases against running coordinators -------------------------------------------------
def test_a_close_naming_unknown_members_is_not_acted_on(tiny_cfg, micro_batches, start_compute):
    """Before: A stepped after the exchange timeout with its own 8 samples dropped as unconfirmed."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["B"].worker, micro_batches[1:2], 0, "b")
        tasks = await _start(nodes)
        _close(nodes, 0, {"U1": 8, "U2": 8}, sender=STRANGER)  # unknown members only
        _close(nodes, 0, {"A": 8, "B": 8, "U1": 8}, sender=STRANGER + "2")  # the right counts, plus one
        await asyncio.sleep(0.3)
        assert all(n.worker.epoch == 0 and n.counters.unknown_member_closes == 2 for n in nodes.values())
        assert not any(b.sealed for n in nodes.values() for b in n.worker.buckets.values())
        start = time.monotonic()
        _close(nodes, 0, {"A": 8, "B": 8})  # the trainer's
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        assert time.monotonic() - start < 2.0  # no exchange timeout
        await _stop(tasks)
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "b")]])
        _assert_honest(nodes, reference, 1)
        assert {peer for _, peer, _, _ in net.sent} <= {"A", "B"}  # no gradients sent to U1/U2

    asyncio.run(scenario())


def _sums_of(cfg, batches, prefix):
    """The sealed gradient sums of `batches` at step 0, as a stage peer sends them."""
    worker = StageWorker(cfg, cfg.stages()[1])
    _train(worker, batches, 0, prefix)
    bucket = worker.seal(0)
    return bucket.samples, [g.clone() for g in bucket.grad_sums]


def _drop_from_view(view: LiveReplicas, keep: list[str]) -> None:
    """The DHT records of everyone but `keep` lapsed (a read far enough ahead prunes them)."""
    view.update(keep, now_s=time.monotonic() + view.keep_s + 1.0)


@pytest.mark.parametrize("sender_known", [True, False], ids=["live-when-sent", "never-live"])
def test_a_member_whose_sums_came_while_it_was_live_still_counts_once_the_view_drops_it(
    tiny_cfg, micro_batches, start_compute, sender_known
):
    """Netbed chaos, seed 2 (docs/LOG.md): B sent its sums of the step, then its link was cut and its DHT
    records lapsed; the close naming A and B, due after the close timeout, named a peer outside A's view,
    so no candidate was left and A held the step until B came back (25 s). A peer that was live when its
    sums came is a member for that step; sums from a peer that never was (a stranger's) make it nothing."""

    async def scenario():
        net = Net()
        peer = "B" if sender_known else "U"
        view = _view(["A", "B"])
        (node,) = _replicas(
            tiny_cfg, ["A"], net, start_compute, _settings(close_timeout_s=0.5), view_of=lambda _: view
        ).values()
        _train(node.worker, micro_batches[:1], 0, "a")
        samples, sums = _sums_of(tiny_cfg, micro_batches[1:2], "b")
        assert node.inbox.on_grads(peer, 0, samples, sums)
        _drop_from_view(view, ["A"])
        tasks = await _start({"A": node})
        # one trainer's close of two (the other was sent to B only)
        node.inbox.on_close(0, 0, 2, {"A": 8, peer: 8}, ["A", peer], sender=TRAINER)
        if sender_known:
            await _until(lambda: node.counters.steps == 1)
            reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "b")]])
            _assert_same_params([reference, node.worker])
            assert node.worker.samples_seen == reference.samples_seen
            assert node.counters.partial_exchanges == 0
        else:
            await asyncio.sleep(1.5)  # three close timeouts: not acted on
            assert node.worker.epoch == 0 and node.counters.steps == 0
        await _stop(tasks)

    asyncio.run(scenario())


def test_a_member_cut_off_during_the_exchange_is_left_out_at_once_though_the_view_drops_it(
    tiny_cfg, micro_batches, start_compute
):
    """Netbed chaos, seed 2 (docs/LOG.md): both replicas of stage 1 held a step closed naming both; B's
    link was cut as the exchange began and, the DHT failing, B left A's view. A's send to B failed (B is
    unreachable: left out), but the close naming B was no candidate any more, so nothing settled and A
    waited out the exchange timeout, with the next step's micro-batches behind it, while B, whose view
    still had A, stepped at once. A member seen live while the step was pending stays one."""

    async def scenario():
        net = Net()
        view = _view(["A", "B"])
        settings = _settings(exchange_timeout_s=60.0)  # waiting it out fails the test's own wait
        (node,) = _replicas(tiny_cfg, ["A"], net, start_compute, settings, view_of=lambda _: view).values()
        send = node.sums_out.send_grads

        async def cut(peer, step, samples, sums):  # B's link goes as A sends; its records lapse
            _drop_from_view(view, ["A"])
            return await send(peer, step, samples, sums)  # not on the net: a failed send

        node.sums_out.send_grads = cut
        _train(node.worker, micro_batches[:1], 0, "a")
        tasks = await _start({"A": node})
        node.inbox.on_close(0, 0, 1, {"A": 8, "B": 8}, ["A", "B"], sender=TRAINER)
        await _until(lambda: node.counters.steps == 1)
        assert node.counters.partial_exchanges == 1  # B's sums never came: stepped without them
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a")]])
        _assert_same_params([reference, node.worker])
        await _stop(tasks)

    asyncio.run(scenario())


def test_sums_held_from_an_unknown_peer_make_it_a_member_once_it_is_seen_live_and_never_before():
    """The held path (sums from a peer the view lacks, pinged meanwhile): once the peer shows up live
    while its sums are held, it stays a member of the step after the view drops it again; a peer never
    seen live stays out. Peers known for the step leave the held-sums room for unknown ones."""
    from swarmtrain.runtime.server.step_inbox import MAX_HELD_GRADS, StepCounters, StepInbox

    view = _view(["A"])
    inbox = StepInbox(lambda: 0, "A", StepCounters(), live_replicas=view)
    sums = [torch.zeros(1)]
    assert inbox.on_grads("B", 0, 8, sums) and inbox.on_grads("U", 0, 8, sums)  # both held, unknown
    state = inbox.state(0)
    assert inbox.view_of(state) == {"A"}
    view.update(["A", "B"])  # B answered its ping (or the DHT showed it)
    assert inbox.view_of(state) == {"A", "B"}
    _drop_from_view(view, ["A"])
    assert inbox.view_of(state) == {"A", "B"}  # B: a member of step 0 still
    assert inbox.state(1) is not None and inbox.view_of(inbox.state(1)) == {"A"}  # of no other step
    others = [f"J{i}" for i in range(MAX_HELD_GRADS - 1)]  # U holds one place of the room
    assert all(inbox.on_grads(peer, 0, 8, sums) for peer in others)
    assert not inbox.on_grads("J-last", 0, 8, sums)  # the room is full of unknown peers only


@pytest.mark.parametrize("data_first", [True, False], ids=["after-the-data", "before-the-data"])
def test_a_close_naming_a_replica_that_holds_nothing_is_not_acted_on(
    tiny_cfg, micro_batches, start_compute, data_first
):
    """Before: B (holding nothing) stepped at once, A dropped its 8 samples and resynced. The forged close
    can come after A accumulated (A's count disagrees) or before (A holds 0 too: it waits for a member's
    gradients to confirm the close, which never come)."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        tasks = await _start(nodes)
        if data_first:
            _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _close(nodes, 0, {"B": 8}, sender=STRANGER)
        await asyncio.sleep(0.3)
        assert all(n.worker.epoch == 0 for n in nodes.values())
        if not data_first:
            _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["A"].worker, micro_batches[1:2], 0, "a2")  # still accumulated: nothing was sealed
        assert nodes["A"].worker.buckets[0].samples == 16
        start = time.monotonic()
        _close(nodes, 0, {"A": 16})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        assert time.monotonic() - start < 2.0
        await _stop(tasks)
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "a2")]])
        _assert_honest(nodes, reference, 1)

    asyncio.run(scenario())


def test_an_empty_close_for_a_later_step_skips_no_step(tiny_cfg, micro_batches, start_compute):
    """Before: an empty close for the step after next made every replica skip it, and the trainer's real
    micro-batch of that step was refused as stale. Now a close more than one step ahead is refused, and
    an empty close of the next step is not acted on while the trainer's data flows."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        tasks = await _start(nodes)
        _close(nodes, 2, {}, sender=STRANGER)  # the step after next
        assert all(n.counters.refused_closes == 1 and 2 not in n.pending for n in nodes.values())
        _close(nodes, 1, {}, sender=STRANGER)  # the next step: kept, never acted on by itself
        steps = []
        for step in range(3):
            a, b = micro_batches[2 * step : 2 * step + 1], micro_batches[2 * step + 1 : 2 * step + 2]
            # the step's compute job done, not only its epoch moved: `live` (what `_train`'s forwards
            # read, on this thread) is rebuilt after the epoch
            await _until(lambda s=step: all(n.counters.steps == s for n in nodes.values()))
            await asyncio.sleep(0.2)  # the forged close of step 1 has had every chance
            assert all(n.worker.epoch == step for n in nodes.values())
            _train(nodes["A"].worker, a, step, f"a{step}")  # not stale, not late: accumulated
            _train(nodes["B"].worker, b, step, f"b{step}")
            assert nodes["A"].worker.buckets[step].samples == 8 == nodes["B"].worker.buckets[step].samples
            _close(nodes, step, {"A": 8, "B": 8})
            steps.append([(a, f"a{step}"), (b, f"b{step}")])
        await _until(lambda: all(n.counters.steps == 3 for n in nodes.values()))
        await _stop(tasks)
        _assert_honest(nodes, _reference(tiny_cfg, steps), 3)

    asyncio.run(scenario())


@pytest.mark.parametrize("forged", [4, 12])
def test_a_strangers_short_close_decides_no_step_while_the_trainers_is_late(
    tiny_cfg, micro_batches, start_compute, forged
):
    """A stranger's close naming B with fewer samples than B holds (what tests/faults/test_forged_steps.py
    sends every round), kept past the short-close grace because the trainer's close came late. Before: B
    acted on it after the grace, applied its own 16 samples without A's ("holds 16 samples, the close
    says 12: all counted", one `disagreeing_closes`) while A applied all 32: the replicas differed. Its
    sender's closes were never found true, so only the trainer's close decides."""

    async def scenario():
        net = Net()
        settings = dataclasses.replace(_settings(), short_close_grace_s=0.2)
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute, settings)
        tasks = await _start(nodes)
        steps = [[(micro_batches[:1], "a0"), (micro_batches[1:2], "b0")]]
        for name, (batches, prefix) in zip("AB", steps[0], strict=True):
            _train(nodes[name].worker, batches, 0, prefix)
        _close(nodes, 0, {"A": 8, "B": 8})  # the trainer's closes were found true before
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))  # `live` rebuilt too
        assert all(TRAINER in n.inbox.trusted for n in nodes.values())
        steps.append([(micro_batches[2:4], "a1"), (micro_batches[4:6], "b1")])
        for name, (batches, prefix) in zip("AB", steps[1], strict=True):
            _train(nodes[name].worker, batches, 1, prefix)
        _close(nodes, 1, {"B": forged}, sender=STRANGER)
        await asyncio.sleep(0.5)  # past the grace, counted from B's first samples and from the close
        assert all(n.worker.epoch == 1 for n in nodes.values())
        assert not any(b.sealed for n in nodes.values() for b in n.worker.buckets.values())
        _close(nodes, 1, {"A": 16, "B": 16})  # the trainer's, late
        await _until(lambda: all(n.counters.steps == 2 for n in nodes.values()))
        await _stop(tasks)
        _assert_honest(nodes, _reference(tiny_cfg, steps), 2)
        assert all(n.counters.disagreeing_closes == 0 for n in nodes.values())
        assert all(STRANGER not in n.inbox.trusted for n in nodes.values())

    asyncio.run(scenario())


def test_a_trainers_short_close_decides_after_the_grace_once_its_closes_were_found_true(
    tiny_cfg, micro_batches, start_compute
):
    """The trainer missed the reply of a micro-batch accumulated here (its close names A with 8 of 16):
    A closed a step on that trainer's close before, so it acts on the short one after the grace, not the
    fallback, and counts all 16 samples."""

    async def scenario():
        net = Net()
        settings = dataclasses.replace(_settings(), short_close_grace_s=0.2)
        nodes = _replicas(tiny_cfg, ["A"], net, start_compute, settings)
        tasks = await _start(nodes)
        steps = [[(micro_batches[:1], "a0")], [(micro_batches[1:3], "a1")]]
        _train(nodes["A"].worker, micro_batches[:1], 0, "a0")
        _close(nodes, 0, {"A": 8})
        await _until(lambda: nodes["A"].counters.steps == 1)  # `live` rebuilt, not only the epoch moved
        _train(nodes["A"].worker, micro_batches[1:3], 1, "a1")
        start = time.monotonic()
        _close(nodes, 1, {"A": 8})
        await _until(lambda: nodes["A"].counters.steps == 2)
        assert time.monotonic() - start < 2.0  # the grace, not the 5 s fallback
        await _stop(tasks)
        _assert_honest(nodes, _reference(tiny_cfg, steps), 2)
        assert nodes["A"].counters.disagreeing_closes == 1

    asyncio.run(scenario())


def test_forged_gradients_are_not_averaged(tiny_cfg, micro_batches, start_compute):
    """Before: a stranger's `grads` with a forged close naming it were averaged into both replicas. Now
    the close is not acted on (the stranger is no live replica); gradients from peers the view lacks are
    held (a few per step) but never counted, and a live replica's gradients count only as a member of the
    decided close with its count."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B", "C"], net, start_compute)
        _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["B"].worker, micro_batches[1:2], 0, "b")
        poison = [torch.full_like(p, 1e3) for p in nodes["A"].worker.params]
        tasks = await _start(nodes)
        _close(nodes, 0, {"A": 8, "B": 8, STRANGER: 8}, sender=STRANGER)
        for node in nodes.values():  # held (at most MAX_HELD_GRADS senders the view lacks), never counted
            held = [
                node.inbox.on_grads(p, 0, 8, [t.clone() for t in poison])
                for p in (STRANGER, "Y1", "Y2", "Y3")
            ]
            assert held == [True] * 4 and not node.inbox.on_grads("Y4", 0, 8, [t.clone() for t in poison])
        await asyncio.sleep(0.3)
        assert all(n.worker.epoch == 0 for n in nodes.values())
        # C is a live replica of the stage but no member of step 0: its sums are kept, never counted
        for name in "AB":
            assert nodes[name].inbox.on_grads("C", 0, 8, [t.clone() for t in poison])
        _close(nodes, 0, {"A": 8, "B": 8})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        await _stop(tasks)
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "b")]])
        _assert_honest(nodes, reference, 1)
        assert all(n.counters.ignored_grads == 1 for n in nodes.values())  # Y4's (C's: kept, not counted)
        assert all(n.counters.last_group_size == 2 for n in nodes.values())

    asyncio.run(scenario())


def test_a_member_sending_another_count_than_the_close_is_left_out(tiny_cfg, micro_batches, start_compute):
    """A close naming B with 16 while B holds 8: B leaves its samples out and tells A at once (its real
    count), so A does not wait; both apply A's 8 alone and stay equal."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute, _settings(exchange_timeout_s=30.0))
        _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["B"].worker, micro_batches[1:2], 0, "b")
        tasks = await _start(nodes)
        start = time.monotonic()
        _close(nodes, 0, {"A": 8, "B": 16})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        assert time.monotonic() - start < 5.0
        await _stop(tasks)
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a")]])
        _assert_same_params([reference, nodes["A"].worker, nodes["B"].worker])
        assert nodes["B"].counters.unconfirmed_samples == 8 and nodes["A"].counters.ignored_grads == 1

    asyncio.run(scenario())


# honest runs keep working -------------------------------------------------------------------------------
def test_two_trainers_and_three_replicas_with_a_forger_about(tiny_cfg, micro_batches, start_compute):
    """Two trainers (shards 0 and 1, each its own sender), A and B members, C a replica that got no
    micro-batch (it waits for a member's gradients), and a stranger's close for shard 0 as well."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B", "C"], net, start_compute)
        _train(nodes["A"].worker, micro_batches[:2], 0, "t0-")  # trainer 0's two micro-batches
        _train(nodes["A"].worker, micro_batches[2:3], 0, "t1-")  # and one of trainer 1's
        _train(nodes["B"].worker, micro_batches[3:4], 0, "t1b-")
        tasks = await _start(nodes)
        _close(nodes, 0, {"C": 8}, sender=STRANGER, shards=2)
        _close(nodes, 0, {"A": 16}, sender="T0", shard=0, shards=2)
        await asyncio.sleep(0.3)
        assert all(n.worker.epoch == 0 for n in nodes.values())  # waiting for trainer 1
        _close(nodes, 0, {"A": 8, "B": 8}, sender="T1", shard=1, shards=2)
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        await _stop(tasks)
        reference = _reference(
            tiny_cfg,
            [[(micro_batches[:2], "t0-"), (micro_batches[2:3], "t1-"), (micro_batches[3:4], "t1b-")]],
        )
        _assert_honest(nodes, reference, 1)
        assert all(n.counters.timed_out_closes == 0 for n in nodes.values())

    asyncio.run(scenario())


def test_a_trainer_that_died_mid_step_does_not_stall_a_lone_replica(tiny_cfg, micro_batches, start_compute):
    """Trainer 1 died after its micro-batch reached A: trainer 0's close (A: 8) disagrees with A's 16 and
    nobody can confirm it. After the close timeout and another one, A steps as before the checks (all its
    samples: it is the only member), instead of stalling the stage."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A"], net, start_compute, _settings(close_timeout_s=0.3))
        _train(nodes["A"].worker, micro_batches[:1], 0, "t0-")
        _train(nodes["A"].worker, micro_batches[1:2], 0, "t1-")
        tasks = await _start(nodes)
        _close(nodes, 0, {"A": 8}, sender="T0", shard=0, shards=2)
        await asyncio.sleep(0.45)
        assert nodes["A"].worker.epoch == 0  # due at 0.3 s, disagreeing: not before another 0.3 s
        await _until(lambda: nodes["A"].counters.steps == 1)
        await _stop(tasks)
        c = nodes["A"].counters
        assert c.lenient_steps == 1 and c.timed_out_closes == 1 and nodes["A"].worker.samples_seen == 16

    asyncio.run(scenario())


def test_a_strangers_close_of_the_exact_count_decides_no_step(tiny_cfg, micro_batches, start_compute):
    """A stranger reads A's pending samples (public `info`) and closes A's step with exactly that count
    (and B's) before the trainer's remaining micro-batch reaches A. A's samples are the trainer's, so the
    stranger's close speaks for none of them: nothing is sealed until the trainer's close, and every
    replica steps on exactly the trainer's samples."""

    async def scenario():
        net = Net()
        nodes = _replicas(tiny_cfg, ["A", "B"], net, start_compute)
        tasks = await _start(nodes)
        _train(nodes["A"].worker, micro_batches[:1], 0, "a", origin=TRAINER)
        _train(nodes["B"].worker, micro_batches[1:2], 0, "b", origin=TRAINER)
        for members in ({"A": 8}, {"A": 8, "B": 8}, {"A": 16, "B": 8}):
            _close(nodes, 0, members, sender=STRANGER)
        await asyncio.sleep(0.3)
        assert all(n.worker.epoch == 0 for n in nodes.values())
        assert not any(b.sealed for n in nodes.values() for b in n.worker.buckets.values())
        _train(nodes["A"].worker, micro_batches[2:3], 0, "a2", origin=TRAINER)  # the trainer's last one
        _close(nodes, 0, {"A": 16, "B": 8})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        await _stop(tasks)
        steps = [[(micro_batches[:1], "a"), (micro_batches[1:2], "b"), (micro_batches[2:3], "a2")]]
        _assert_honest(nodes, _reference(tiny_cfg, steps), 1)
        assert all(STRANGER not in n.inbox.trusted and TRAINER in n.inbox.trusted for n in nodes.values())

    asyncio.run(scenario())


def test_a_replica_joining_mid_run_is_believed_once_the_dht_shows_it(tiny_cfg, micro_batches, start_compute):
    """The trainer may name a replica that joined before our DHT view shows it: the close waits (it is
    kept, not dropped) and decides once the view has it."""

    async def scenario():
        net = Net()
        view = _view(["A"])
        nodes = _replicas(tiny_cfg, "AJ", net, start_compute, view_of=lambda _: view)
        _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["J"].worker, micro_batches[1:2], 0, "j")
        tasks = await _start(nodes)
        _close(nodes, 0, {"A": 8, "J": 8})
        await asyncio.sleep(0.3)
        assert nodes["A"].worker.epoch == 0
        view.update(["A", "J"])
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()))
        await _stop(tasks)
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "j")]])
        _assert_honest(nodes, reference, 1)

    asyncio.run(scenario())


def test_a_replica_the_view_lacks_is_believed_once_it_answers_a_stage_ping(
    tiny_cfg, micro_batches, start_compute
):
    """A replica that just joined (or moved here) and is not in the DHT view yet: the close naming it
    makes the others ping it, and it decides as soon as the ping says it serves this stage; a named
    peer that does not answer as a replica keeps its close from being acted on."""
    pinged: list[str] = []

    async def verify(peer):
        pinged.append(peer)
        return peer in ("A", "J")  # J serves this stage; X (a stranger's name) does not answer

    async def scenario():
        net = Net()
        view = _view(["A"])
        others = _view(["A", "J"])
        nodes = _replicas(
            tiny_cfg, "AJ", net, start_compute, view_of=lambda n: view if n == "A" else others, verify=verify
        )
        _train(nodes["A"].worker, micro_batches[:1], 0, "a")
        _train(nodes["J"].worker, micro_batches[1:2], 0, "j")
        tasks = await _start(nodes)
        _close(nodes, 0, {"A": 8, "X": 8}, sender=STRANGER)
        _close(nodes, 0, {"A": 8, "J": 8})
        await _until(lambda: all(n.counters.steps == 1 for n in nodes.values()), timeout_s=3.0)
        await _stop(tasks)
        assert sorted(set(pinged)) == ["J", "X"]  # only A pinged: J's view had everyone
        assert "J" in view.current() and "X" not in view.current()
        reference = _reference(tiny_cfg, [[(micro_batches[:1], "a"), (micro_batches[1:2], "j")]])
        _assert_honest(nodes, reference, 1)

    asyncio.run(scenario())


# the pure checks ------------------------------------------------------------------------------------------
LIVE = frozenset("ABC")


def _c(members, sender=TRAINER, shard=0, shards=1, at=0.0, participants=("A", "B", "C")):
    return Close(sender, shard, shards, dict(members), frozenset(participants), at)


def _decide(closes, me="A", own=0, received=None, live=LIVE, now=1.0, **kw):
    candidates = step_candidates(closes, me, live, 10.0)
    return decide_step(candidates, me, own, received or {}, now, 10.0, **kw)


def _settle(closes, me="A", own=0, received=None, unreachable=(), timed_out=False, by_origin=None):
    candidates = step_candidates(closes, me, LIVE, 10.0)
    return settle_step(candidates, me, own, received or {}, set(unreachable), timed_out, by_origin)


def test_close_window():
    assert close_refusal(4, 5, 1) is not None  # applied
    assert close_refusal(5, 5, 1) is None and close_refusal(6, 5, 1) is None
    assert close_refusal(7, 5, 1) is not None  # the step after next
    assert close_refusal(7, 5, 2) is None  # max_staleness = 1


def test_a_member_closes_its_step_on_a_close_that_agrees_with_its_own_count():
    d = _decide([_c({"A": 8, "B": 8})], own=8)
    assert d is not None and dict(d.members) == {"A": 8, "B": 8} and d.participants == {"B", "C"}
    assert not d.lenient
    assert _decide([_c({"A": 16, "B": 8})], own=8) is None  # not what A holds
    assert _decide([_c({"B": 8})], own=8) is None  # A's samples left out by a close nobody confirmed


def test_a_non_member_waits_for_a_members_gradients():
    closes = [_c({"A": 8, "B": 8})]
    assert _decide(closes, me="C") is None
    assert _decide(closes, me="C", received={"A": 4}) is None  # another count: no confirmation
    assert _decide(closes, me="C", received={"A": 8}) is not None
    # a replica whose samples no close lists acts once a member confirms it (and leaves them out)
    assert _decide(closes, me="C", own=8, received={"B": 8}) is not None
    # local steps exchange nothing per step: agreeing with its own count is enough
    assert _decide(closes, me="C", confirm=False) is not None


def test_unknown_members_are_never_acted_on_not_even_late():
    closes = [_c({"A": 8, STRANGER: 8})]
    assert _decide(closes, own=8, now=1e6, reached_s=0.0) is None
    assert _decide(closes, own=8, live=None) is not None  # no DHT view (unchecked)
    d = _decide([_c({"A": 8}, participants=("A", "B", STRANGER))], own=8)
    assert d is not None and d.participants == {"B"}  # never send gradients to a stranger


def test_trainers_closes_are_merged_and_waited_for():
    t0, t1 = _c({"A": 8}, "T0", 0, 2, 0.0), _c({"A": 8, "B": 8}, "T1", 1, 2, 0.5)
    assert _decide([t0], own=16, now=5.0) is None  # trainer 1 not yet
    d = _decide([t0, t1], own=16)
    assert d is not None and dict(d.members) == {"A": 16, "B": 8} and d.complete and d.closes == 2
    d = _decide([t0], own=8, now=10.0)  # trainer 1 never closes: the close timeout
    assert d is not None and not d.complete


def test_an_empty_or_disagreeing_close_is_acted_on_only_after_a_second_timeout():
    empty = [_c({}, at=0.0)]
    assert _decide(empty, now=9.0) is None
    assert _decide(empty, now=11.0, reached_s=5.0) is None  # counted from reaching the step
    d = _decide(empty, now=15.0, reached_s=5.0)
    assert d is not None and d.lenient and not d.members
    assert _decide(empty, own=8, now=9.0) is None  # A holds samples: the empty close disagrees ...
    d = _decide([*empty, _c({"A": 8}, sender="T1", at=3.0)], own=8, now=9.0)
    assert d is not None and not d.lenient  # ... and the trainer's close decides


def test_the_fallback_never_acts_on_members_it_cannot_verify_while_it_hears_nobody():
    """Issue 38: in an idle open swarm a forged close naming live replicas reached the fallback on a
    replica holding nothing. Without samples of its own or gradients from a live replica it now waits;
    a live peer's gradients (a trainer died mid-step and that peer stepped on the fallback) unblock it."""
    forged = [_c({"B": 8}, at=0.0)]
    assert _decide(forged, now=100.0, reached_s=0.0) is None  # holds nothing, heard nobody: never
    d = _decide(forged, now=100.0, reached_s=0.0, heard_peers=True)
    assert d is not None and d.lenient
    d = _decide([_c({"A": 8}, at=0.0)], own=16, now=100.0, reached_s=0.0)  # its own samples: as before
    assert d is not None and d.lenient


def test_a_close_short_of_our_samples_waits_a_grace_then_decides_without_them():
    """The trainer missed a reply of a micro-batch accumulated here (its count for A is short): after the
    grace (not the lenient fallback) A acts on it (and counts all its samples, as its peers do); a close
    naming A exactly wins whenever it comes within the grace, and none of this applies to a replica the
    close does not name or to a close naming more than A holds."""
    short = [_c({"A": 8, "B": 8}, at=0.0)]
    assert _decide(short, own=16, now=0.5, reached_s=0.0, short_grace_s=1.0) is None
    d = _decide(short, own=16, now=1.5, reached_s=0.0, short_grace_s=1.0)
    assert d is not None and not d.lenient and d.members["A"] == 8
    exact = _c({"A": 16, "B": 8}, sender="T1", at=0.7)
    d = _decide([*short, exact], own=16, now=1.5, reached_s=0.0, short_grace_s=1.0)
    assert d is not None and d.members["A"] == 16
    assert _decide([_c({"B": 8}, at=0.0)], own=16, now=5.0, reached_s=0.0, short_grace_s=1.0) is None
    assert _decide([_c({"A": 24}, at=0.0)], own=16, now=5.0, reached_s=0.0, short_grace_s=1.0) is None
    assert _decide(short, own=16, now=5.0, reached_s=0.0) is None  # no grace given: only the fallback


def test_a_short_close_kept_while_idle_waits_its_grace_from_the_first_samples():
    """A forger's close naming A short (4) came while the swarm was idle, long after A reached the step.
    Its grace counts from A's first samples of the step, not from reaching it: the next trainer's first
    micro-batch does not let it decide the step, and the trainer's close, within the grace, does
    (before: it decided at once, and the replica resynced; tests/faults/test_forged_steps.py)."""
    forged = [_c({"A": 4, "B": 4}, sender="F", at=1.0)]
    assert _decide(forged, own=8, now=60.0, reached_s=0.0, held_s=59.8, short_grace_s=1.0) is None
    honest = _c({"A": 32, "B": 32}, sender="T1", at=60.3)
    d = _decide([*forged, honest], own=32, now=60.5, reached_s=0.0, held_s=59.8, short_grace_s=1.0)
    assert d is not None and d.members["A"] == 32
    d = _decide(forged, own=8, now=61.0, reached_s=0.0, held_s=59.8, short_grace_s=1.0)
    assert d is not None and d.members["A"] == 4  # no better close came within the grace: as before
    # a trainer's own short close comes after its micro-batches: counted from when it became due
    assert _decide(forged, own=8, now=1.5, reached_s=0.0, held_s=0.2, short_grace_s=1.0) is None
    assert _decide(forged, own=8, now=2.5, reached_s=0.0, held_s=0.2, short_grace_s=1.0) is not None


def test_a_short_close_decides_after_the_grace_only_from_senders_whose_closes_were_found_true():
    """A short count needs no knowledge of the replica, so a stranger's short close waits for the fallback
    however late the trainer's close comes; a trainer whose closes were found true here gets the grace
    (its first close, short, the fallback too), and a merged candidate only when all its senders do."""
    kw = dict(own=16, reached_s=0.0, held_s=0.0, short_grace_s=1.0)
    forged = [_c({"A": 4}, sender=STRANGER, at=0.0)]
    assert _decide(forged, now=9.0, trusted={TRAINER}, **kw) is None
    d = _decide(forged, now=10.5, trusted={TRAINER}, **kw)
    assert d is not None and d.lenient  # the fallback, as for any close no check passes
    short = [_c({"A": 8}, at=0.0)]
    d = _decide(short, now=1.5, trusted={TRAINER}, **kw)
    assert d is not None and not d.lenient and d.members["A"] == 8
    assert _decide(short, now=1.5, trusted=set(), **kw) is None
    merged = [_c({"A": 8}, TRAINER, 0, 2, at=0.0), _c({"B": 8}, STRANGER, 1, 2, at=0.0)]
    assert _decide(merged, now=1.5, trusted={TRAINER}, **kw) is None
    d = _decide(merged, now=1.5, trusted={TRAINER, STRANGER}, **kw)
    assert d is not None and dict(d.members) == {"A": 8, "B": 8}


def test_only_the_senders_of_closes_that_data_bore_out_are_trusted():
    (honest,) = step_candidates([_c({"A": 8, "B": 8})], "A", LIVE, 10.0)
    assert vouched_senders(honest, "A", 8, {}) == {TRAINER}  # what A holds
    assert vouched_senders(honest, "A", 16, {}) == frozenset()  # short: nothing bore it out
    assert vouched_senders(honest, "C", 0, {"B": 8}) == {TRAINER}  # B's gradients confirm it
    assert vouched_senders(honest, "C", 0, {"B": 4}) == frozenset()
    assert vouched_senders(dataclasses.replace(honest, lenient=True), "A", 8, {}) == frozenset()
    # a stranger's empty close for another shard merges into the trainer's: it names nobody to check
    closes = [_c({"A": 8}, TRAINER, 0, 2, at=0.0), _c({}, STRANGER, 1, 2, at=0.0)]
    merged = max(step_candidates(closes, "A", LIVE, 10.0), key=lambda c: c.closes)
    assert merged.senders == {TRAINER, STRANGER} and vouched_senders(merged, "A", 8, {}) == {TRAINER}


def test_an_empty_close_after_reaching_the_step_is_graced_one_sent_before_is_not():
    """Every micro-batch of a trainer failed at this stage: its close names nobody and comes after the
    replica reached the step (graced). A forger's empty close for a later step comes before (fallback)."""
    late = [_c({}, at=2.0)]
    assert _decide(late, now=2.5, reached_s=1.0, short_grace_s=1.0) is None
    d = _decide(late, now=3.5, reached_s=1.0, short_grace_s=1.0)
    assert d is not None and not d.lenient and not d.members
    early = [_c({}, at=0.5)]
    assert _decide(early, now=9.0, reached_s=1.0, short_grace_s=1.0) is None
    assert _decide(late, own=8, now=9.0, reached_s=1.0, short_grace_s=1.0) is None  # we hold samples


def test_the_exchange_settles_which_close_is_applied():
    honest = _c({"A": 8, "B": 8}, at=0.5)
    # the case: a close naming B, which holds nothing; A holds 8 and applies the trainer's close
    assert dict(_settle([_c({"B": 8}, "X", at=0.0), _c({"A": 8})], own=8).members) == {"A": 8}
    # a forged subset that happens to agree with B: B waits for A's gradients, which confirm the trainer's
    subset = _c({"B": 8}, "X", at=0.0)
    assert _settle([subset, honest], me="B", own=8) is None
    assert dict(_settle([subset, honest], me="B", own=8, received={"A": 8}).members) == {"A": 8, "B": 8}
    # a forged superset naming C, which never answers: the trainer's close once the exchange times out
    superset = _c({"A": 8, "B": 8, "C": 8}, "X", at=0.0)
    assert _settle([superset, honest], own=8, received={"B": 8}) is None
    assert dict(_settle([superset, honest], own=8, received={"B": 8}, timed_out=True).members) == {
        "A": 8,
        "B": 8,
    }
    # a dead member (unreachable) is not waited for
    assert dict(_settle([honest], own=8, unreachable={"B"}).members) == {"A": 8, "B": 8}


def test_a_forged_close_for_a_trainers_shard_loses_to_the_trainers():
    """Two trainers; a stranger's close claims shard 0 (naming C, which holds nothing). B agrees with both
    sets; A's gradients (24 samples, what trainer 0's close and trainer 1's say) settle it."""
    forged, t0, t1 = (
        _c({"C": 8}, "X", 0, 2, 0.0),
        _c({"A": 16}, "T0", 0, 2, 0.1),
        _c({"A": 8, "B": 8}, "T1", 1, 2, 0.2),
    )
    closes = [forged, t0, t1]
    assert _settle(closes, me="B", own=8) is None
    assert dict(_settle(closes, me="B", own=8, received={"A": 24}).members) == {"A": 24, "B": 8}
    assert dict(_settle(closes, me="A", own=24, received={"B": 8}).members) == {"A": 24, "B": 8}
    assert dict(_settle(closes, me="C", received={"A": 24, "B": 8}).members) == {"A": 24, "B": 8}


# a close speaks only for its sender's own samples (`backed_by_origin`) ---------------------------------
def test_a_strangers_close_of_a_plausible_count_decides_nothing():
    """A holds 16 samples of the trainer's micro-batches. A stranger's close naming A with exactly 16
    (read from `info`), or 8 or 16 with B, decides nothing at once, whatever it merges with; the
    trainer's does. The stranger's close stays a candidate: the lenient fallback still sees it."""
    kw = dict(own=16, by_origin={TRAINER: 16})
    for members in ({"A": 16}, {"A": 8}, {"A": 16, "B": 8}, {"A": 16, "B": 16}):
        assert _decide([_c(members, STRANGER)], **kw) is None, members
    d = _decide([_c({"A": 16}, STRANGER, at=0.0), _c({"A": 16, "B": 8}, at=0.5)], **kw)
    assert d is not None and d.senders == {TRAINER} and not d.lenient
    d = _decide([_c({"A": 16}, STRANGER, at=0.0)], now=100.0, reached_s=0.0, **kw)
    assert d is not None and d.lenient  # no trainer's close ever came: the fallback, as before


def test_a_trainers_close_counts_only_for_samples_of_its_own_micro_batches():
    """A holds 8 samples of trainer T1's only: trainer T0's close naming A with 8 is not backed (T0's
    micro-batches are elsewhere); a replica holding nothing is not decided by a close naming it."""
    assert _decide([_c({"A": 8}, "T0")], own=8, by_origin={"T1": 8}) is None
    assert _decide([_c({"A": 8}, "T1")], own=8, by_origin={"T1": 8}) is not None
    assert _decide([_c({"A": 8}, "T0")], own=0, by_origin={}) is None
    # a close not naming A, when A holds nothing, still needs a member's gradients
    assert _decide([_c({"B": 8}, "T0")], by_origin={}) is None
    assert _decide([_c({"B": 8}, "T0")], by_origin={}, received={"B": 8}) is not None


def test_two_shards_each_close_names_its_own_trainers_samples():
    t0, t1 = _c({"A": 8}, "T0", 0, 2, 0.0), _c({"A": 8, "B": 8}, "T1", 1, 2, 0.5)
    by_origin = {"T0": 8, "T1": 8}
    d = _decide([t0, t1], own=16, by_origin=by_origin)
    assert d is not None and d.senders == {"T0", "T1"}
    # a stranger's close for either shard with the count the trainer's would have merges, but is not backed
    for forged in (_c({"A": 8}, STRANGER, 1, 2, 0.2), _c({"A": 16}, STRANGER, 1, 2, 0.2)):
        assert _decide([t0, forged], own=16, by_origin=by_origin) is None
    # nor does one trainer's close claim the other's samples
    assert (
        _decide([_c({"A": 16}, "T0", 0, 2, 0.0), _c({"B": 8}, "T1", 1, 2, 0.5)], own=16, by_origin=by_origin)
        is None
    )


def test_samples_of_unknown_origin_are_claimable_as_before_and_only_they():
    """Micro-batches whose origin is unknown (`UNKNOWN_ORIGIN`: no trainer named) may be claimed by any
    close, as before this check; samples of a known trainer only by that trainer's close."""
    assert _decide([_c({"A": 16}, STRANGER)], own=16, by_origin={UNKNOWN_ORIGIN: 16}) is not None
    mixed = {UNKNOWN_ORIGIN: 8, TRAINER: 8}
    assert _decide([_c({"A": 16}, STRANGER)], own=16, by_origin=mixed) is None
    assert _decide([_c({"A": 16})], own=16, by_origin=mixed) is not None
    assert backed_by_origin({TRAINER: 8, STRANGER: 8}, mixed)  # the stranger's claim: the unknown 8
    assert not backed_by_origin({TRAINER: 4, STRANGER: 12}, mixed)  # less than the trainer's own
    assert backed_by_origin({}, {}) and backed_by_origin({STRANGER: 8}, None)


def test_an_older_servers_hand_off_decides_at_the_fallback():
    """An older stage server hands off without `origin`: its samples are counted as its own (the caller),
    and it never closes. The trainer's close is then not backed, and a peer's confirming gradients do
    not make up for it (the replica holds samples of no sender of the close): the step decides at the
    lenient fallback, never at once (slower, and never on a stranger's count)."""
    kw = dict(own=8, by_origin={"S0": 8})
    assert _decide([_c({"A": 8, "B": 8})], **kw) is None
    assert _decide([_c({"A": 8, "B": 8})], received={"B": 8}, **kw) is None
    d = _decide([_c({"A": 8})], now=21.0, reached_s=0.0, **kw)
    assert d is not None and d.lenient


def test_a_confirmed_close_not_naming_a_replica_holding_samples_needs_a_trainer_of_them():
    """B's gradients confirm a stranger's close naming only B (its count read from `info`): A, holding
    the trainer's samples, must not act on it and leave them out before the trainer's close comes. A
    trainer's close that lists A nowhere (its replies from A were lost) is still acted on when confirmed."""
    kw = dict(own=16, received={"B": 8}, by_origin={TRAINER: 16})
    assert _decide([_c({"B": 8}, STRANGER)], **kw) is None
    d = _decide([_c({"B": 8}, STRANGER, at=0.0), _c({"A": 16, "B": 8}, at=0.5)], **kw)
    assert d is not None and d.senders == {TRAINER}
    assert _decide([_c({"B": 8})], **kw) is not None
    assert _decide([_c({"B": 8}, STRANGER)], me="C", received={"B": 8}, by_origin={}) is not None


def test_the_fallback_still_fires_when_a_trainer_died_mid_step():
    t0 = _c({"A": 8}, "T0", 0, 2, 0.0)  # trainer 1 died after its micro-batch reached A
    kw = dict(own=16, by_origin={"T0": 8, "T1": 8}, reached_s=0.0)
    assert _decide([t0], now=15.0, **kw) is None
    d = _decide([t0], now=20.5, **kw)
    assert d is not None and d.lenient and not d.complete


def test_a_short_close_is_graced_only_from_a_trainer_whose_samples_the_replica_holds():
    kw = dict(own=16, reached_s=0.0, held_s=0.0, short_grace_s=1.0, trusted={TRAINER, "T1"})
    short = [_c({"A": 8}, at=0.0)]
    assert _decide(short, now=1.5, by_origin={TRAINER: 16}, **kw) is not None
    assert _decide(short, now=1.5, by_origin={"T1": 16}, **kw) is None


def test_local_steps_act_on_the_trainers_close_not_a_strangers():
    assert _decide([_c({"A": 8})], own=8, by_origin={TRAINER: 8}, confirm=False) is not None
    assert _decide([_c({"A": 8}, STRANGER)], own=8, by_origin={TRAINER: 8}, confirm=False) is None
    assert _decide([_c({"B": 8})], me="C", by_origin={}, confirm=False) is not None  # holds nothing


def test_the_exchange_prefers_the_trainers_close_to_a_strangers_copy_of_it():
    """A stranger copies the trainer's counts for every member and sends them first: both agree with A's
    count and B's gradients, but only the trainer's speaks for A's samples, so it is applied and its
    sender alone is trusted."""
    forged, honest = _c({"A": 16, "B": 8}, STRANGER, at=0.0), _c({"A": 16, "B": 8}, at=0.5)
    by_origin = {TRAINER: 16}
    d = _settle([forged, honest], own=16, received={"B": 8}, by_origin=by_origin)
    assert d is not None and d.senders == {TRAINER}
    assert vouched_senders(d, "A", 16, {}, by_origin) == {TRAINER}
    (copy,) = step_candidates([forged], "A", LIVE, 10.0)
    assert vouched_senders(copy, "A", 16, {}, by_origin) == frozenset()


def test_live_replicas_keep_a_peer_for_a_while_after_a_read_misses_it():
    view = LiveReplicas(keep_s=3.0)
    view.update(["A", "B"], now_s=0.0)
    view.update([], now_s=2.0)  # a failed DHT read
    assert view.current(now_s=2.5) == {"A", "B"}
    view.update(["A"], now_s=4.0)
    assert view.current(now_s=4.0) == {"A"}


def test_the_grace_is_twice_the_usual_wait_but_never_half_the_fallback_or_more():
    """A close that came 15 s late once (the trainer reached this replica only through a relay reserved
    later) made the grace 30 s+ for good: every later empty close then waited the whole 10 s fallback."""
    assert short_close_grace_s(None, 1.0, 10.0) == 1.0  # no step decided yet: the floor
    assert short_close_grace_s(0.2, 1.0, 10.0) == 1.0
    assert short_close_grace_s(1.5, 1.0, 10.0) == 3.0
    assert short_close_grace_s(15.0, 1.0, 10.0) == 5.0  # capped below the fallback
    # with the cap, an empty close after a late step is acted on before the fallback
    empty = [_c({}, at=0.0)]
    grace_s = short_close_grace_s(15.0, 1.0, 10.0)
    assert _decide(empty, now=4.0, reached_s=0.0, short_grace_s=grace_s) is None
    d = _decide(empty, now=5.5, reached_s=0.0, short_grace_s=grace_s)
    assert d is not None and not d.lenient and d.members == {}


def _decision(members, lenient=False) -> StepDecision:
    return StepDecision(members, frozenset(members) - {"A"}, 1, True, 0.0, 0.0, lenient)


def test_a_replica_adds_its_own_sums_only_when_the_close_names_it_with_at_most_what_it_holds():
    assert step_contributions(_decision({"A": 8}), "A", 8, {}).own
    assert step_contributions(_decision({"A": 8}), "A", 16, {}).own  # a trainer missed a reply
    assert not step_contributions(_decision({"A": 16}), "A", 8, {}).own  # it claims more than we hold
    assert not step_contributions(_decision({"B": 8}), "A", 8, {"B": 8}).own  # not named
    assert step_contributions(_decision({"A": 16}, lenient=True), "A", 8, {}).own


def test_peers_count_with_at_least_the_samples_named_and_in_one_sorted_order():
    chosen = step_contributions(_decision({"A": 8, "C": 8, "B": 8, "D": 8}), "A", 8, {"C": 9, "B": 8, "D": 4})
    assert chosen.peers == ("B", "C") and chosen.ignored == ("D",) and chosen.missing == ("D",)
    assert step_contributions(_decision({"A": 8, "D": 8}, lenient=True), "A", 8, {"D": 4}).peers == ("D",)


def test_a_member_nobody_heard_from_makes_the_exchange_partial_and_a_stranger_s_sums_never_count():
    chosen = step_contributions(_decision({"A": 8, "B": 8}), "A", 8, {STRANGER: 64})
    assert chosen.peers == () and chosen.missing == ("B",) and chosen.ignored == ()
    assert step_contributions(_decision({"A": 8, "B": 8}), "A", 8, {"B": 8}).missing == ()
