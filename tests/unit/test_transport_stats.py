"""Byte counters cover both ends of every exchange: a caller counts its request (`out`) and the reply
it got (`back`), a servicer the request it got (`in`) and the reply it sent (`reply`), over libp2p and
over the data plane alike, so the bytes a process sent are `sent()` whoever started the exchange."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarmtrain.net.protocol import Message, make_message, pack
from swarmtrain.net.transport import StageServicer, TransportStats, checked_reply

pytestmark = pytest.mark.unit

CONTEXT = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: "caller"))


async def _result(message: Message, context) -> Message:
    return make_message("result", {"stage": 1}, {"grad": torch.ones(64, 64)}, "8bit")


def _request() -> Message:
    return make_message("forward_backward", {"stage": 1, "mb": "a"}, {"inputs": torch.ones(4, 8)}, "8bit")


def test_a_servicer_counts_the_request_it_got_and_the_reply_it_sent():
    servicer = StageServicer(_result, max_message_bytes=1 << 20)
    data = pack(_request())
    reply = b"".join(asyncio.run(servicer.answer_direct("forward_backward", data, CONTEXT)))  # in its parts
    counted = servicer.stats.snapshot()
    assert counted[(1, "forward_backward", "in")].wire_bytes == len(data)
    assert counted[(1, "forward_backward", "reply")].wire_bytes == len(reply)
    assert servicer.stats.received().wire_bytes == len(data)
    assert servicer.stats.sent().wire_bytes == len(reply)
    assert servicer.stats.sent().fp32_bytes > 3 * len(reply) // 2  # 8-bit tensors count as fp32 there
    assert servicer.stats.direct_in == 1


def test_a_refused_request_s_error_reply_is_counted_too():
    servicer = StageServicer(_result, max_message_bytes=1 << 20)
    reply = asyncio.run(servicer.answer_bytes("forward_backward", b"not a message", CONTEXT))
    assert servicer.stats.sent().wire_bytes == len(reply) > 0
    assert servicer.stats.direct_in == 0  # it came over libp2p


def test_a_caller_counts_its_request_as_sent_and_the_reply_as_received():
    stats, request = TransportStats(), _request()
    data, reply = pack(request), pack(Message("result", {"stage": 1}))
    checked_reply(stats, request, "forward_backward", len(data), reply, "peer")
    assert (stats.sent().wire_bytes, stats.received().wire_bytes) == (len(data), len(reply))
    assert stats.totals().wire_bytes == len(data) + len(reply)
