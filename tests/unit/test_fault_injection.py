"""Faults scheduled at named points (runtime/harness/fault_injection.py) against the real retry logic of the
trainer (StageCaller) and the real gradient exchange of a stage (StepCoordinator): no sleeps for the
fault, no sockets, no SIGKILL; each outcome is asserted."""

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID
from test_peer_table import _ann

from swarmtrain.config import SwarmConfig
from swarmtrain.net.protocol import Message, StageRequest
from swarmtrain.runtime.harness.fault_injection import FailureInjector
from swarmtrain.runtime.server.stage_steps import StepCoordinator, StepSettings
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.runtime.trainer import call_policy, stage_calls
from swarmtrain.runtime.trainer.peer_table import PeerTable

pytestmark = pytest.mark.unit

A, B = (PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32).to_base58() for i in (1, 2))


class RecordingClient:
    """Every replica answers; records (peer, kind, mb, accumulate) of the calls that reached one."""

    def __init__(self):
        self.calls = []

    async def call(self, peer_id, message, timeout_s):
        kind = message.kind
        accumulate = message.header.get("accumulate", True)
        self.calls.append((str(peer_id), kind, message.header["mb"], accumulate))
        return Message("result", {"acc": 8 if accumulate else 0})


@pytest.fixture
def caller(monkeypatch):
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 0.001)
    table = PeerTable(records=None, num_stages=1, digest="d")
    table.apply([{A: _ann(0), B: _ann(0)}])
    faults, client = FailureInjector(), RecordingClient()
    caller = stage_calls.StageCaller(
        faults.wrap_client(client), table, SwarmConfig(), "d", "none", asyncio.Event()
    )
    return caller, faults, client, table


def _backward(caller, mb):
    return asyncio.run(caller.call_peer(0, "backward", mb, 8, {}, 1.0, prefer=A, persistent=True, step=0))


def test_a_backward_that_times_out_is_retried_elsewhere_without_accumulating(caller):
    caller, faults, client, table = caller
    faults.fail_call("backward", mb="t.0-3", peer=A, error="timeout")
    reply, answered_by = _backward(caller, "t.0-3")
    # A may still apply its copy: B returns the input gradient but must not accumulate it too
    assert answered_by == B and reply.header["acc"] == 0
    assert client.calls == [(B, "backward", "t.0-3", False)]
    assert (caller.stats.timeouts, caller.stats.not_accumulated, table.is_banned(A)) == (1, 1, False)
    assert faults.fired == [("fail_call", "backward", A, "t.0-3", "timeout")]
    _, answered_by = _backward(caller, "t.0-4")  # the rule fired once: A serves the next one
    assert answered_by == A and client.calls[-1] == (A, "backward", "t.0-4", True)


def test_a_backward_to_a_dead_peer_is_accumulated_by_the_next_and_the_dead_one_banned(caller):
    caller, faults, client, table = caller
    faults.fail_call("backward", peer=A, error="connection")
    reply, answered_by = _backward(caller, "t.0-5")
    assert answered_by == B and reply.header["acc"] == 8  # A's accumulator died with it
    assert client.calls == [(B, "backward", "t.0-5", True)]
    assert table.is_banned(A) and caller.stats.connection_errors == 1


class WorkerClient:
    """Stage 0 of a one-stage model: each peer a real StageWorker that runs the fused forward-backward
    of a fixed micro-batch and accumulates it as the server does (at most once per micro-batch id)."""

    def __init__(self, tiny_cfg):
        self.workers = {p: StageWorker(tiny_cfg, tiny_cfg.stages()[1]) for p in (A, B)}
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(8, 64, 64, generator=generator)
        self.y = torch.randint(0, 256, (8, 64), generator=generator)

    async def call(self, peer_id, message, timeout_s):
        header = message.header
        request = StageRequest(
            "forward_backward", header["mb"], "none", self.x, labels=self.y,
            accumulate=header.get("accumulate", True), step=header["step"],
        )  # fmt: skip
        reply = self.workers[str(peer_id)].forward(request)
        return Message("result", {"acc": reply.header["acc"]})


def test_a_reply_cut_after_the_peer_accumulated_is_sent_there_again_and_counted_once(tiny_cfg, monkeypatch):
    """Issue 57's 0-byte replies: the peer ran the micro-batch and accumulated it, and its reply stream
    ended empty. Sent to the same peer again as it was, the copy is answered as held (its id is in the
    step's bucket) and not added twice: the micro-batch counts once, where it was, and nowhere else."""
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 0.001)
    table = PeerTable(records=None, num_stages=1, digest="d")
    table.apply([{A: _ann(0), B: _ann(0)}])
    faults, client = FailureInjector(), WorkerClient(tiny_cfg)
    faults.fail_call("forward_backward", peer=A, error="cut_after")
    caller = stage_calls.StageCaller(
        faults.wrap_client(client), table, SwarmConfig(), "d", "none", asyncio.Event()
    )
    reply, answered_by = asyncio.run(
        caller.call_peer(0, "forward_backward", "t.0-7", 8, {}, 1.0, prefer=A, persistent=True, step=0)
    )
    assert answered_by == A and reply.header["acc"] == 8  # held there: the trainer's close names it
    a, b = client.workers[A], client.workers[B]
    assert a.buckets[0].micro_batch_ids == ["t.0-7"] and a.buckets[0].samples == 8
    assert a.counters.duplicates == 1 and 0 not in b.buckets
    assert caller.stats.not_accumulated == 0 and caller.stats.retries == 1


def test_a_refused_forward_twice_then_served(caller):
    caller, faults, client, _ = caller
    faults.fail_call("forward", error="refused", times=2)
    asyncio.run(caller.call_peer(0, "forward", "t.0-6", 8, {}, 1.0, step=0))
    assert len(faults.fired) == 2 and len(client.calls) == 1 and caller.stats.retries == 2


def test_an_exchange_that_loses_a_member_leaves_both_replicas_partial(tiny_cfg, start_compute):
    """Step 0's sums of A never reach B: B waits out the exchange timeout and applies its own half; A
    (unable to deliver to B, so not waiting for it) applies what it has. The replicas' parameters
    differ, which is what the fingerprint check of stage_sync.py then repairs with a resync."""
    faults = FailureInjector().lose_grads(step=0, sender="A", receiver="B")
    generator = torch.Generator().manual_seed(3)

    async def scenario():
        nodes = {}

        def deliver(me):
            async def send(peer, step, samples, sums):
                nodes[peer].inbox.on_grads(me, step, samples, [s.clone() for s in sums])
                return True

            return faults.wrap_sender(me, send)

        settings = StepSettings(close_timeout_s=5.0, exchange_timeout_s=0.5, poll_s=0.02)
        for name in ("A", "B"):
            worker = StageWorker(tiny_cfg, tiny_cfg.stages()[1])
            nodes[name] = StepCoordinator(worker, start_compute(), name, deliver(name), settings)
            for i in range(2):
                x, y = (
                    torch.randn(8, 64, 64, generator=generator),
                    torch.randint(0, 256, (8, 64), generator=generator),
                )
                request = StageRequest("forward_backward", f"{name}{i}", "none", x, labels=y, step=0)
                worker.forward(request)
        tasks = [asyncio.create_task(node.run()) for node in nodes.values()]
        for node in nodes.values():
            node.inbox.on_close(0, 0, 1, {"A": 16, "B": 16}, ["A", "B"])
        for _ in range(500):
            if all(node.counters.steps == 1 for node in nodes.values()):
                break
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        return nodes

    nodes = asyncio.run(scenario())
    assert faults.fired == [("lose_grads", 0, "A", "B")]
    a_node, b_node = nodes["A"], nodes["B"]
    assert a_node.worker.epoch == b_node.worker.epoch == 1
    assert b_node.counters.partial_exchanges == 1 and b_node.worker.samples_seen == 16  # only its own
    assert a_node.worker.samples_seen in (16, 32)  # B's sums reach A unless A gave up on B first
    a, b = (nodes[n].worker.params for n in ("A", "B"))
    assert not all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_unknown_error_kinds_are_refused():
    with pytest.raises(ValueError, match="error must be one of"):
        FailureInjector().fail_call("forward", error="explode")
