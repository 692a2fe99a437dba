"""Token ids and labels packed at the vocabulary's bit width (net/bit_packing.py, codec `bits{N}` in
net/codec.py, `encode_labels` in net/protocol.py): lossless at every width, as small as promised, and
every malformed or hostile packing refused as a protocol error."""

import dataclasses
import struct

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.config.model import token_id_bits
from swarmtrain.net import bit_packing, codec
from swarmtrain.net.protocol import (
    MAGIC,
    Message,
    ProtocolError,
    StageIO,
    encode_labels,
    pack,
    request_message,
    unpack,
    validate_request,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bits", [1, 2, 7, 8, 9, 11, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 513])
def test_every_width_round_trips_exactly_in_the_fewest_bytes(bits, count):
    generator = torch.Generator().manual_seed(bits * 1000 + count)
    values = torch.randint(0, 2**bits, (count,), generator=generator, dtype=torch.int64)
    if count:
        values[0], values[-1] = 2**bits - 1, 0  # both ends of the range
    packed = bit_packing.pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-count * bits // 8)
    assert torch.equal(bit_packing.unpack_bits(packed, bits, count), values)


def test_the_bit_stream_is_least_significant_bit_first():
    # 3-bit values 5 (101), 3 (011), 6 (110): stream 1,0,1, 1,1,0, 0,1,1 -> bytes 0b10011101, 0b1
    packed = bit_packing.pack_bits(torch.tensor([5, 3, 6]), 3)
    assert packed.tolist() == [0b10011101, 0b1]


@pytest.mark.parametrize(
    "vocab_size,bits,dtype",
    [(256, 8, "int16"), (2048, 11, "int16"), (50_257, 16, "int32"), (128_256, 17, "int32")],
)
def test_labels_go_packed_at_the_vocabularys_width_and_keep_their_narrow_dtype(vocab_size, bits, dtype):
    assert token_id_bits(vocab_size) == bits
    labels = torch.randint(0, vocab_size, (8, 64))
    labels[0, 0] = vocab_size - 1
    encoded = encode_labels(labels, vocab_size)
    # the dtype stays the unpacked one, so a byte count against fp32 does not credit the packing twice
    assert (encoded.codec, encoded.dtype) == (f"bits{bits}", dtype)
    assert len(encoded.payload) == 8 * 64 * bits // 8
    assert torch.equal(codec.decode(encoded).long(), labels)


def test_an_ignored_label_sends_the_tensor_unpacked():
    labels = torch.tensor([[5, -100, 7]])
    encoded = encode_labels(labels, 2048)
    assert (encoded.codec, encoded.dtype, len(encoded.payload)) == ("none", "int16", 6)
    assert codec.decode(encoded).tolist() == labels.tolist()


def test_a_width_that_the_dtype_cannot_hold_non_negative_is_refused_on_both_sides():
    with pytest.raises(codec.CodecError):
        codec.encode_ints(torch.zeros(4, dtype=torch.int16), 16)  # the sign bit
    with pytest.raises(codec.CodecError):
        codec.encode_ints(torch.zeros(4), 8)  # floats are never packed
    forged = [
        codec.EncodedTensor("bits16", "int16", (8,), bytes(16)),  # could decode negative
        codec.EncodedTensor("bits8", "float32", (8,), bytes(8)),
        codec.EncodedTensor("bits8", "bool", (8,), bytes(8)),
        codec.EncodedTensor("bits11", "int16", (8,), bytes(12)),  # 11 bytes hold 8 values of 11 bits
        codec.EncodedTensor("bits0", "int16", (8,), b""),
        codec.EncodedTensor("bits33", "int64", (8,), bytes(33)),
    ]
    for encoded in forged:
        with pytest.raises(codec.CodecError):
            codec.decode(encoded)


def _last_stage(vocab_size: int):
    cfg = get_preset("tiny")
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=vocab_size, seq_len=4))
    return cfg, StageIO.from_config(cfg.model, cfg.stages()[-1], max_batch=16)


def _sent(cfg, labels: codec.EncodedTensor) -> Message:
    inputs = torch.randn(1, 4, cfg.model.d_model)
    message = request_message(
        "forward_backward", "m", 1, "d", "none", {"inputs": inputs, "labels": labels}, step=0
    )
    return unpack(pack(message), 10**8)  # as a server receives it


def test_a_server_reads_packed_labels_as_int64_and_refuses_a_packed_label_past_the_vocabulary():
    cfg, io = _last_stage(2000)  # 11 bits hold up to 2,047: 2,000..2,047 fit the packing, not the model
    labels = torch.tensor([[1999, 0, 5, 1024]])
    request = validate_request(_sent(cfg, encode_labels(labels, 2000)), io, "d")
    assert request.labels.dtype == torch.int64 and request.labels.tolist() == labels.tolist()
    forged = codec.encode_ints(torch.tensor([[2040, 0, 5, 1]], dtype=torch.int16), 11)
    with pytest.raises(ProtocolError, match="labels must be in"):
        validate_request(_sent(cfg, forged), io, "d")


@pytest.mark.parametrize("name", ["bits0", "bits33", "bits"])
def test_an_unknown_width_on_the_wire_is_a_protocol_error(name):
    cfg, _ = _last_stage(2048)
    message = _sent(cfg, encode_labels(torch.tensor([[1, 2, 3, 4]]), 2048))
    data = pack(message)
    start = len(MAGIC) + 4
    end = start + struct.unpack_from("<I", data, len(MAGIC))[0]
    header = data[start:end].replace(b'"bits11"', f'"{name}"'.encode(), 1)
    with pytest.raises(ProtocolError, match="unknown codec"):
        unpack(MAGIC + struct.pack("<I", len(header)) + header + data[end:], 10**8)


def _decoding_forbidden(monkeypatch):
    def decode(*args, **kwargs):
        raise AssertionError("decoded before its shape was checked")

    monkeypatch.setattr(codec, "decode", decode)


def test_a_hand_offs_labels_are_bounded_before_anything_decodes_them(monkeypatch):
    # a packed width turns a payload byte into up to 8 values: a peer's shape is checked against the
    # stage's bounds first, so decoding costs no more than a request of the run may
    from swarmtrain.net.hand_off import chain_message, validate_chain

    cfg = get_preset("tiny")
    io = StageIO.from_config(cfg.model, cfg.stages()[0], max_batch=4)
    seq = cfg.model.seq_len
    for shape in ((5, seq), (2, seq + 1), (2, seq, 1)):
        labels = codec.encode_ints(torch.ones(shape, dtype=torch.int16), 8)
        ids = codec.encode_ints(torch.ones(shape[0], 1, dtype=torch.int16), 8)
        message = unpack(
            pack(chain_message("mb", 0, "d", "none", ids, labels, [["p"]], [True, True], step=0)), 10**8
        )
        _decoding_forbidden(monkeypatch)
        with pytest.raises(ProtocolError, match="outside|dimensions"):
            validate_chain(message, io, "d", 2)
        monkeypatch.undo()


def test_ids_of_a_shape_the_message_cannot_use_are_refused_before_decoding(monkeypatch):
    from swarmtrain.net.token_ids import checked_token_ids

    ids = codec.encode_ints(torch.ones(2, 5, dtype=torch.int16), 11)
    _decoding_forbidden(monkeypatch)
    with pytest.raises(ProtocolError, match="need shape"):
        checked_token_ids(ids, 2, 4, 2048, torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ProtocolError, match="need shape"):
        checked_token_ids(codec.encode_ints(torch.ones(2, 1, dtype=torch.int16), 11), 2, 4, 2048, None)
