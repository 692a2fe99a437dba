"""Malformed requests get an error answer; the server keeps serving and its parameters do not move."""

import json
import struct

import pytest
import torch

from swarmtrain.net import protocol
from swarmtrain.net.bundle import bundle_message, split_bundle
from swarmtrain.net.protocol import REPLY_KINDS, Message, pack, request_message

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _bad_requests(cfg, digest):
    """(description, kind, raw bytes) for stage 1 (hidden states + labels, last stage)."""
    m, b, t = cfg.model, 2, cfg.model.seq_len
    hidden, labels = torch.randn(b, t, m.d_model), torch.randint(0, m.vocab_size, (b, t))

    def req(tensors, **header):
        fields = {"step": 0, **header}
        return pack(request_message("forward_backward", "bad-1", 1, digest, "none", tensors, **fields))

    nan = hidden.clone()
    nan[0, 0, 0] = float("nan")
    huge = Message("forward", {"mb": "x", "stage": 1, "digest": digest, "codec": "none"})
    huge_bytes = pack(huge)
    header = json.loads(huge_bytes[8:])
    header["tensors"] = [["inputs", "none", "float32", [10**6, 10**6, 10**6], 4 * 10**18]]
    forged = json.dumps(header).encode()
    return [
        (
            "wrong hidden size",
            "forward_backward",
            req({"inputs": torch.randn(b, t, m.d_model + 1), "labels": labels}),
        ),
        ("wrong dtype of labels", "forward_backward", req({"inputs": hidden, "labels": labels.float()})),
        ("int hidden states", "forward_backward", req({"inputs": hidden.long(), "labels": labels})),
        (
            "too long sequence",
            "forward_backward",
            req(
                {
                    "inputs": torch.randn(b, t + 1, m.d_model),
                    "labels": torch.zeros(b, t + 1, dtype=torch.long),
                }
            ),
        ),
        ("labels out of range", "forward_backward", req({"inputs": hidden, "labels": labels + m.vocab_size})),
        ("missing labels", "forward_backward", req({"inputs": hidden})),
        ("NaN activations", "forward_backward", req({"inputs": nan, "labels": labels})),
        (
            "wrong stage",
            "forward",
            pack(request_message("forward", "bad", 0, digest, "none", {"inputs": hidden})).replace(
                b'"stage":0', b'"stage":7'
            ),
        ),
        (
            "wrong digest",
            "forward_backward",
            req({"inputs": hidden, "labels": labels}).replace(digest.encode(), b"0" * len(digest)),
        ),
        ("absurd declared size", "forward", protocol.MAGIC + struct.pack("<I", len(forged)) + forged),
        ("garbage bytes", "forward", b"\x00garbage" * 1000),
        (
            "a bundle of a forward",
            "bundle",
            pack(bundle_message([request_message("forward", "b", 1, digest, "none", {"inputs": hidden})], 1)),
        ),
        ("empty message", "backward", b""),
        ("truncated payload", "forward_backward", req({"inputs": hidden, "labels": labels})[:-100]),
        (
            "oversized message",
            "forward",
            b"\x01" * (cfg.training.micro_batch_size * 4 * t * (8 * m.d_model + 8) + 200_000),
        ),
        (
            "backward to the last stage",
            "backward",
            pack(
                request_message(
                    "backward",
                    "bad",
                    1,
                    digest,
                    "none",
                    {"inputs": hidden, "labels": labels, "grad_outputs": hidden},
                )
            ),
        ),
    ]


@pytest.fixture(scope="module")
def last_stage_server(make_module_swarm):
    """A swarm of one stage-1 server, shared by this module's tests (each starts no swarm of its own: one
    less DHT and server start); (its config, a probe, the server's peer id). Neither test closes a step,
    each uses micro-batch ids of its own and checks what it changes as a delta, whichever runs first."""
    swarm, cfg = make_module_swarm("tiny")
    swarm.start_dht()
    swarm.start_server("s1", 1)
    swarm.wait_ready(["s1"])
    probe = make_module_swarm.probe(cfg, swarm)
    probe.wait_for_peers([0, 1])
    (peer,) = probe.peers(1)
    return cfg, probe, peer


def test_bad_requests_get_error_answers_and_change_nothing(last_stage_server):
    cfg, probe, peer = last_stage_server
    before = probe.info(peer, want="params")

    for description, kind, data in _bad_requests(cfg, cfg.digest()):
        reply = probe.call_raw(peer, kind, data)
        assert reply.kind == "error", description
        print(f"{description:28s} -> {reply.header['code']}: {reply.header['error'][:90]}")

    after = probe.info(peer, want="params")
    assert after.header["pending_samples"] == before.header["pending_samples"]
    assert after.header["epoch"] == before.header["epoch"] == 0
    for name in before.tensors:
        assert torch.equal(before.tensor(name), after.tensor(name)), name
    # still serving: a valid request works
    hidden = torch.randn(2, cfg.model.seq_len, cfg.model.d_model)
    labels = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    good = request_message(
        "forward_backward", "valid-1", 1, cfg.digest(), "none", {"inputs": hidden, "labels": labels}, step=0
    )
    reply = probe.call_raw(peer, "forward_backward", pack(good))
    assert reply.kind == "result" and reply.header["loss"] > 0
    assert reply.tensor("grad_inputs").shape == hidden.shape


def test_a_bundle_answers_each_item_as_if_it_came_alone(last_stage_server):
    cfg, probe, peer = last_stage_server
    m, t = cfg.model, cfg.model.seq_len
    pending = probe.info(peer).header["pending_samples"]  # what the module's other test left

    def item(mb: str, digest: str) -> Message:
        tensors = {"inputs": torch.randn(2, t, m.d_model), "labels": torch.randint(0, m.vocab_size, (2, t))}
        return request_message("forward_backward", mb, 1, digest, "none", tensors, step=0)

    items = [item("good-1", cfg.digest()), item("bad-1", "0" * 16), item("good-2", cfg.digest())]
    reply = probe.call_raw(peer, "bundle", pack(bundle_message(items, 1)))
    answers = split_bundle(reply, REPLY_KINDS)
    assert [a.kind for a in answers] == ["result", "error", "result"]
    assert answers[1].header["code"] == "digest_mismatch"
    assert [answers[0].header["mb"], answers[2].header["mb"]] == ["good-1", "good-2"]
    assert answers[0].tensor("grad_inputs").shape == (2, t, m.d_model)
    # the two good micro-batches accumulated once each; sent again, neither accumulates twice
    assert probe.info(peer).header["pending_samples"] == pending + 4
    again = split_bundle(probe.call_raw(peer, "bundle", pack(bundle_message(items[::2], 1))), REPLY_KINDS)
    assert all(a.kind == "result" for a in again)
    assert probe.info(peer).header["pending_samples"] == pending + 4
