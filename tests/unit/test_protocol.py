"""Wire messages: packing round trip and the server-side validation of requests (no network)."""

import pytest
import torch

from swarmtrain.net import codec
from swarmtrain.net.protocol import (
    MAX_ABS_VALUE,
    Message,
    ProtocolError,
    StageIO,
    pack,
    request_message,
    unpack,
    validate_request,
)

pytestmark = pytest.mark.unit

DIGEST = "abc123"


def _io(tiny_cfg, stage):
    return StageIO.from_config(tiny_cfg.model, tiny_cfg.stages()[stage], max_batch=16)


def test_pack_unpack_round_trip_keeps_header_and_tensors():
    msg = request_message(
        "forward_backward", "t-1", 1, DIGEST, "8bit", {"inputs": torch.randn(2, 3, 4)}, accumulate=False
    )
    back = unpack(pack(msg), max_bytes=10**6)
    assert (
        back.kind == "forward_backward" and back.header["mb"] == "t-1" and back.header["accumulate"] is False
    )
    assert back.tensors["inputs"] == msg.tensors["inputs"]


def test_already_encoded_tensors_are_relayed_unchanged():
    enc = codec.encode(torch.randn(5, 7), "8bit")
    msg = request_message("backward", "m", 0, DIGEST, "8bit", {"grad_outputs": enc})
    assert msg.tensors["grad_outputs"] is enc


def test_fp32_equivalent_counts_floats_as_4_bytes_and_ints_as_is():
    x, ids = torch.randn(4, 8, 16), torch.zeros(4, 8, dtype=torch.long)
    msg = request_message("forward", "m", 0, DIGEST, "8bit", {"inputs": x, "labels": ids})
    wire = len(pack(msg))
    fp32 = msg.fp32_equivalent_bytes()
    assert fp32 - wire == pytest.approx(x.numel() * 4 - len(msg.tensors["inputs"].payload), abs=16)


@pytest.mark.parametrize(
    "data",
    [b"", b"junk" * 10, b"SWT1\xff\xff\xff\xff", b"SWT1\x02\x00\x00\x00{}", b"SWT1\x03\x00\x00\x00[1]"],
)
def test_unpack_rejects_malformed_bytes(data):
    with pytest.raises(ProtocolError):
        unpack(data, max_bytes=10**6)


def test_unpack_enforces_the_size_limit():
    msg = pack(request_message("forward", "m", 0, DIGEST, "none", {"inputs": torch.zeros(1000)}))
    with pytest.raises(ProtocolError) as info:
        unpack(msg, max_bytes=len(msg) - 1)
    assert info.value.code == "too_large"


def test_valid_requests_for_first_and_last_stage(tiny_cfg):
    m = tiny_cfg.model
    tokens = torch.randint(0, m.vocab_size, (3, m.seq_len))
    req = validate_request(
        request_message("forward", "a", 0, DIGEST, "none", {"inputs": tokens}, step=7),
        _io(tiny_cfg, 0),
        DIGEST,
    )
    assert req.num_samples == 3 and not req.evaluate and torch.equal(req.inputs, tokens) and req.step == 7
    hidden = torch.randn(3, m.seq_len, m.d_model)
    msg = request_message(
        "forward_backward", "a", 1, DIGEST, "8bit", {"inputs": hidden, "labels": tokens}, step=0
    )
    req = validate_request(msg, _io(tiny_cfg, 1), DIGEST)
    assert req.fused_backward and req.labels is not None
    msg = request_message("evaluate", "a", 1, DIGEST, "8bit", {"inputs": hidden, "labels": tokens})
    assert validate_request(msg, _io(tiny_cfg, 1), DIGEST).evaluate  # an evaluation needs no step


@pytest.mark.parametrize(("kind", "stage"), [("forward", 1), ("backward", 1), ("forward_backward", 0)])
def test_each_kind_goes_to_its_stages(tiny_cfg, kind, stage):
    m = tiny_cfg.model
    inputs = (
        torch.zeros(2, m.seq_len, dtype=torch.long) if stage == 0 else torch.randn(2, m.seq_len, m.d_model)
    )
    tensors = {"inputs": inputs, **({"labels": torch.zeros(2, m.seq_len, dtype=torch.long)} if stage else {})}
    with pytest.raises(ProtocolError, match="last stage"):
        validate_request(
            request_message(kind, "a", stage, DIGEST, "none", tensors, step=0), _io(tiny_cfg, stage), DIGEST
        )


@pytest.mark.parametrize("step", [None, -1, "3", True, 2**60])
def test_training_requests_must_name_their_global_step(tiny_cfg, step):
    tokens = torch.zeros(2, tiny_cfg.model.seq_len, dtype=torch.long)
    msg = request_message("forward", "a", 0, DIGEST, "none", {"inputs": tokens})
    if step is not None:
        msg.header["step"] = step
    with pytest.raises(ProtocolError, match="global step"):
        validate_request(msg, _io(tiny_cfg, 0), DIGEST)


@pytest.mark.parametrize(
    "stage, tensors, header, code",
    [
        (0, {"inputs": torch.randint(0, 256, (2, 64)).float()}, {}, "bad_request"),
        (0, {"inputs": torch.full((2, 64), 300)}, {}, "bad_request"),
        (0, {"inputs": torch.zeros(17, 64, dtype=torch.long)}, {}, "bad_request"),
        (0, {"inputs": torch.zeros(2, 64, dtype=torch.long)}, {"digest": "other"}, "digest_mismatch"),
        (0, {"inputs": torch.zeros(2, 64, dtype=torch.long)}, {"stage": 1}, "bad_request"),
        (0, {"inputs": torch.zeros(2, 64, dtype=torch.long)}, {"mb": ""}, "bad_request"),
        (1, {"inputs": torch.randn(2, 64, 64)}, {}, "bad_request"),  # labels missing
        (
            1,
            {"inputs": torch.full((2, 64, 64), float("inf")), "labels": torch.zeros(2, 64, dtype=torch.long)},
            {},
            "bad_request",
        ),
        (
            1,
            {"inputs": torch.randn(2, 64, 64), "labels": torch.zeros(2, 63, dtype=torch.long)},
            {},
            "bad_request",
        ),
    ],
)
def test_invalid_requests_are_refused_with_a_reason(tiny_cfg, stage, tensors, header, code):
    msg = request_message("forward", "m", stage, DIGEST, "none", tensors)
    msg.header.update(header)
    with pytest.raises(ProtocolError) as info:
        validate_request(msg, _io(tiny_cfg, stage), DIGEST)
    assert info.value.code == code and str(info.value)


def test_backward_needs_matching_gradient_shape(tiny_cfg):
    m = tiny_cfg.model
    tokens = torch.zeros(2, m.seq_len, dtype=torch.long)
    good = request_message(
        "backward",
        "m",
        0,
        DIGEST,
        "none",
        {"inputs": tokens, "grad_outputs": torch.randn(2, m.seq_len, m.d_model)},
        step=0,
    )
    assert validate_request(good, _io(tiny_cfg, 0), DIGEST).grad_outputs.shape == (2, m.seq_len, m.d_model)
    bad = request_message(
        "backward",
        "m",
        0,
        DIGEST,
        "none",
        {"inputs": tokens, "grad_outputs": torch.randn(2, m.seq_len, m.d_model + 1)},
        step=0,
    )
    with pytest.raises(ProtocolError):
        validate_request(bad, _io(tiny_cfg, 0), DIGEST)


def test_absurd_but_finite_hidden_states_are_refused(tiny_cfg):
    # 1e20 hidden states made a stage's parameters NaN although every value was finite
    m = tiny_cfg.model
    hidden = torch.randn(2, m.seq_len, m.d_model)
    hidden[1, 3, 5] = 1e20
    labels = torch.zeros(2, m.seq_len, dtype=torch.long)
    msg = request_message(
        "forward_backward", "m", 1, DIGEST, "none", {"inputs": hidden, "labels": labels}, step=0
    )
    with pytest.raises(ProtocolError) as info:
        validate_request(msg, _io(tiny_cfg, 1), DIGEST)
    assert info.value.code == "bad_request"
    assert "inputs" in str(info.value) and f"{MAX_ABS_VALUE:g}" in str(info.value)


@pytest.mark.parametrize("codec_name", ["none", "8bit"])
def test_absurd_but_finite_gradients_are_refused(tiny_cfg, codec_name):
    # 3e38 is finite in fp32 (and survives the 8-bit codec's fp32 block scale) but made replicas non-finite
    m = tiny_cfg.model
    grads = torch.randn(2, m.seq_len, m.d_model)
    grads[0, 0, 0] = -3e38
    assert bool(torch.isfinite(grads).all())
    tokens = torch.zeros(2, m.seq_len, dtype=torch.long)
    msg = request_message(
        "backward", "m", 0, DIGEST, codec_name, {"inputs": tokens, "grad_outputs": grads}, step=0
    )
    with pytest.raises(ProtocolError) as info:
        validate_request(msg, _io(tiny_cfg, 0), DIGEST)
    assert info.value.code == "bad_request"
    assert "grad_outputs" in str(info.value) and f"{MAX_ABS_VALUE:g}" in str(info.value)


def test_large_but_plausible_values_are_accepted(tiny_cfg):
    m = tiny_cfg.model
    hidden = torch.randn(2, m.seq_len, m.d_model) * 100
    hidden[0, 0, 0] = MAX_ABS_VALUE  # exactly on the bound: "none" keeps it exact, 8-bit might round past
    labels = torch.zeros(2, m.seq_len, dtype=torch.long)
    msg = request_message(
        "forward_backward", "m", 1, DIGEST, "none", {"inputs": hidden, "labels": labels}, step=0
    )
    assert validate_request(msg, _io(tiny_cfg, 1), DIGEST).inputs.shape == hidden.shape


def test_info_messages_are_not_stage_requests(tiny_cfg):
    with pytest.raises(ProtocolError):
        validate_request(Message("info", {}), _io(tiny_cfg, 0), DIGEST)
