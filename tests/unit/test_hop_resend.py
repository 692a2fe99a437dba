"""A stage server's hand-off to the next stage whose reply stream was cut (issue 57's 0-byte replies): the
same hand-off goes to the same peer once more, its accumulate flags unchanged (`ChainHop._call_next`,
as the trainer's `run_call` does: tests/unit/test_stage_calls.py); cut again, it goes to the next
candidate with the later stages' flags cleared."""

import asyncio
import dataclasses

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.net import codec
from swarmtrain.net.hand_off import chain_message, validate_chain
from swarmtrain.net.protocol import Message, StageIO, pack, unpack
from swarmtrain.net.transport import TruncatedReply
from swarmtrain.runtime.server.chain_hop import ChainHop

pytestmark = pytest.mark.unit

DIGEST = "d1"
N = 2


class ScriptedUploads:
    """The hand-offs to one next-stage peer: raises the scripted failures in turn, then answers with a
    gradient of the right shape; records each call's accumulate flag."""

    def __init__(self, peer, failures, calls, shape):
        self.peer, self.failures, self.calls, self.shape = peer, failures, calls, shape

    async def call(self, message, tokens, timeout_s):
        self.calls.append((self.peer, message.header.get("accumulate")))
        if self.failures:
            raise self.failures.pop(0)
        grad = codec.encode(torch.zeros(self.shape), "none")
        return Message("result", {"mb": "mb-1", "loss": 1.5, "acc": N}, {"grad_inputs": grad})


class NextStage:
    async def usable(self, candidates):
        return list(candidates)


def _call_next(failures_by_peer):
    cfg = get_preset("tiny")
    cfg = cfg.replace(swarm=dataclasses.replace(cfg.swarm, num_stages=2))
    io = StageIO.from_config(cfg.model, cfg.stages()[0], max_batch=16)
    seq = cfg.model.seq_len
    tokens = codec.encode(torch.randint(0, 256, (N, seq)), "none")
    message = chain_message("mb-1", 0, DIGEST, "none", tokens, tokens, [["p1", "p2"]], [True, True], step=3)
    chain = validate_chain(unpack(pack(message), 10**8), io, DIGEST, 2)
    hop = ChainHop(None, None, None, NextStage(), io, DIGEST, 2, "p0")
    calls, shape = [], (N, seq, io.wire_dim)
    hop._uploads = {p: ScriptedUploads(p, list(f), calls, shape) for p, f in failures_by_peer.items()}
    outputs = torch.zeros(N, seq, cfg.model.d_model)
    reply, hops, _ = asyncio.run(hop._call_next(chain, outputs, deadline_s=float("inf")))
    return calls, hops, hop.retries


def test_a_hand_off_whose_reply_was_cut_goes_to_the_same_peer_once_more_with_its_flags():
    calls, hops, retries = _call_next({"p1": [TruncatedReply("0-byte reply")], "p2": []})
    assert calls == [("p1", True), ("p1", True)] and hops[0].peer == "p1" and hops[0].acc == N
    assert retries == 1


def test_cut_twice_it_goes_to_the_next_candidate_without_accumulating():
    calls, hops, retries = _call_next({"p1": [TruncatedReply("cut")] * 2, "p2": []})
    assert calls == [("p1", True), ("p1", True), ("p2", False)] and hops[0].peer == "p2"
    assert retries == 2
