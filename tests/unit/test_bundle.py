"""Bundles (net/bundle.py) and a server's uploads to a next-stage peer (runtime/server/hop_uploads.py):
the wire format round-trips and refuses what it must; uploads go one at a time; with a token budget, the
hand-offs that queue together go as one bundle and every caller gets its own answer or failure."""

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID

from swarmtrain.net.bundle import MAX_BUNDLE_ITEMS, bundle_message, split_bundle
from swarmtrain.net.protocol import (
    HAND_OFF_KINDS,
    Message,
    ProtocolError,
    error_message,
    make_message,
    pack,
    unpack,
)
from swarmtrain.net.transport import RemoteError
from swarmtrain.runtime.server import hop_uploads
from swarmtrain.runtime.server.hop_uploads import PeerUploads

pytestmark = pytest.mark.unit

PEER = PeerID(b"next-stage-peer").to_base58()


def _request(mb: str, value: float) -> Message:
    header = {"mb": mb, "stage": 1, "step": 3}
    return make_message("forward_backward", header, {"inputs": torch.full((2, 4, 8), value)}, "8bit")


def _result(message: Message) -> Message:
    return make_message(
        "result", {"mb": message.header["mb"], "acc": 2}, {"grad_inputs": torch.ones(2, 4, 8)}
    )


def test_a_bundle_round_trips_through_the_wire_format():
    items = [_request("a", 1.0), _request("b", 2.0), _request("c", 3.0)]
    wire = unpack(pack(bundle_message(items, stage=1)), 1 << 24)
    assert wire.kind == "bundle" and wire.header["stage"] == 1
    back = split_bundle(wire, HAND_OFF_KINDS)
    assert [m.kind for m in back] == ["forward_backward"] * 3
    assert [m.header for m in back] == [m.header for m in items]
    for sent, got in zip(items, back, strict=True):
        assert torch.equal(got.tensor("inputs"), sent.tensor("inputs"))


@pytest.mark.parametrize(
    "header, tensors, reason",
    [
        ({"items": []}, {}, "1 to"),
        ({"items": [{"kind": "chain"}] * (MAX_BUNDLE_ITEMS + 1)}, {}, "1 to"),
        ({"items": [{"kind": "forward"}]}, {}, "carries only"),
        ({"items": [{"kind": "bundle"}]}, {}, "carries only"),
        ({"items": ["chain"]}, {}, "carries only"),
        ({"items": [{"kind": "chain"}]}, {"1.inputs": None}, "names no item"),
        ({"items": [{"kind": "chain"}]}, {"inputs": None}, "names no item"),
        ({"items": [{"kind": "chain"}]}, {"0.": None}, "names no item"),
    ],
)
def test_a_malformed_bundle_is_refused(header, tensors, reason):
    with pytest.raises(ProtocolError, match=reason):
        split_bundle(Message("bundle", header, tensors), HAND_OFF_KINDS)


class FakeClient:
    """Answers like a next-stage server: each call's request is in at once, the answer comes when
    `release` is set; `fail` makes every call raise it."""

    def __init__(self, answer=_result) -> None:
        self.calls: list[tuple[str, Message]] = []
        self.release = asyncio.Event()
        self.answer = answer
        self.fail: Exception | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    async def call(self, peer_id, message, timeout_s, received=None):
        kind = message.kind
        self.calls.append((kind, message))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # the upload
            if received is not None:
                received.set()
            await self.release.wait()
            if self.fail is not None:
                raise self.fail
            if kind == "bundle":
                items = split_bundle(message, HAND_OFF_KINDS)
                return bundle_message([self.answer(m) for m in items], 1)
            return self.answer(message)
        finally:
            self.in_flight -= 1


async def _send_all(uploads: PeerUploads, client: FakeClient, count: int, timeout_s: float = 5.0):
    calls = [asyncio.ensure_future(uploads.call(_request(f"mb{i}", i), 8, timeout_s)) for i in range(count)]
    await asyncio.sleep(0.1)
    client.release.set()
    return await asyncio.gather(*calls, return_exceptions=True)


def test_without_a_token_budget_each_hand_off_goes_alone_one_upload_at_a_time():
    async def main():
        client = FakeClient()
        uploads = PeerUploads(client, PEER, 1, max_tokens=0)
        replies = await _send_all(uploads, client, 3)
        assert [kind for kind, _ in client.calls] == ["forward_backward"] * 3
        assert [r.header["mb"] for r in replies] == ["mb0", "mb1", "mb2"]
        # the next upload starts only once the peer has the previous one; all three then wait together
        assert client.most_in_flight == 3 and uploads.bundles == 0

    asyncio.run(main())


def test_hand_offs_that_queue_together_go_as_one_bundle_and_each_caller_gets_its_own_answer():
    async def main():
        client = FakeClient()
        uploads = PeerUploads(client, PEER, 1, max_tokens=64)
        replies = await _send_all(uploads, client, 5)
        assert [kind for kind, _ in client.calls] == ["bundle"]
        assert [r.header["mb"] for r in replies] == [f"mb{i}" for i in range(5)]
        assert all(torch.equal(r.tensor("grad_inputs"), torch.ones(2, 4, 8)) for r in replies)
        assert uploads.bundles == 1

    asyncio.run(main())


def test_the_token_budget_splits_a_queue_into_several_bundles():
    async def main():
        client = FakeClient()
        uploads = PeerUploads(client, PEER, 1, max_tokens=16)  # two hand-offs of 8 tokens each
        replies = await _send_all(uploads, client, 5)
        sizes = [len(split_bundle(m, HAND_OFF_KINDS)) if k == "bundle" else 1 for k, m in client.calls]
        assert sizes == [2, 2, 1]
        assert [r.header["mb"] for r in replies] == [f"mb{i}" for i in range(5)]

    asyncio.run(main())


def test_an_error_answer_in_a_bundle_fails_only_its_own_caller():
    def answer(message: Message) -> Message:
        if message.header["mb"] == "mb1":
            return error_message("step 3 is already applied here", "stale")
        return _result(message)

    async def main():
        client = FakeClient(answer)
        replies = await _send_all(PeerUploads(client, PEER, 1, max_tokens=64), client, 3)
        assert isinstance(replies[1], RemoteError) and replies[1].code == "stale"
        assert [r.header["mb"] for r in (replies[0], replies[2])] == ["mb0", "mb2"]

    asyncio.run(main())


def test_a_failed_bundle_fails_every_caller_with_the_same_error():
    async def main():
        client = FakeClient()
        client.fail = ConnectionResetError("peer went away")
        replies = await _send_all(PeerUploads(client, PEER, 1, max_tokens=64), client, 3)
        assert all(isinstance(r, ConnectionResetError) for r in replies)

    asyncio.run(main())


def test_a_bundle_answered_with_the_wrong_number_of_replies_is_a_protocol_error():
    async def main():
        client = FakeClient()
        uploads = PeerUploads(client, PEER, 1, max_tokens=64)

        async def short_answer(peer_id, message, timeout_s, received=None):
            received.set()
            items = split_bundle(message, HAND_OFF_KINDS)
            return bundle_message([_result(m) for m in items[:-1]], 1)

        client.call = short_answer
        calls = [asyncio.ensure_future(uploads.call(_request(f"mb{i}", i), 8, 5.0)) for i in range(3)]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, ProtocolError) for r in replies)

    asyncio.run(main())


def test_a_caller_that_gave_up_while_queued_is_not_sent(monkeypatch):
    monkeypatch.setattr(hop_uploads, "GATHER_S", 0.0)

    async def main():
        client = FakeClient()
        uploads = PeerUploads(client, PEER, 1, max_tokens=0)
        first = asyncio.ensure_future(uploads.call(_request("mb0", 0), 8, 5.0))
        await asyncio.sleep(0)
        # queued behind mb0, whose upload holds the lane until the peer has it (10 ms)
        late = asyncio.ensure_future(uploads.call(_request("mb1", 1), 8, 0.001))
        with pytest.raises(TimeoutError):
            await late
        client.release.set()
        assert (await first).header["mb"] == "mb0"
        await asyncio.sleep(0.05)
        assert [m.header["mb"] for _, m in client.calls] == ["mb0"]

    asyncio.run(main())
