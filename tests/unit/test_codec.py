"""Wire codecs: round-trip error bounds, odd sizes, empty and non-contiguous tensors, integers untouched."""

import struct
import warnings

import pytest
import torch

from swarmtrain.net import codec

pytestmark = pytest.mark.unit


def _blockwise_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-value bound: half a quantization step of the value's block (+ fp32 rounding slack)."""
    flat = x.reshape(-1).float()
    bound = torch.empty_like(flat)
    for start in range(0, flat.numel(), codec.BLOCK_SIZE):
        block = flat[start : start + codec.BLOCK_SIZE]
        bound[start : start + codec.BLOCK_SIZE] = block.abs().max() / 254 * (1 + 1e-5) + 1e-12
    return bound.view(x.shape)


@pytest.mark.parametrize(
    "numel", [1, 7, codec.BLOCK_SIZE - 1, codec.BLOCK_SIZE, 3 * codec.BLOCK_SIZE + 5, 10_000]
)
def test_8bit_error_is_within_half_a_step_per_block(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.linspace(0.01, 100, numel)
    enc = codec.encode(x, "8bit")
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(((y - x).abs() <= _blockwise_bound(x)).all())
    assert len(enc.payload) == numel + 4 * -(-numel // codec.BLOCK_SIZE)


def test_8bit_keeps_outliers_local_and_relative_error_small():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    x[0, 0] = 1e4  # one outlier only degrades its own block
    y = codec.decode(codec.encode(x, "8bit"))
    rest = slice(codec.BLOCK_SIZE, None)
    rel = (y.view(-1)[rest] - x.view(-1)[rest]).norm() / x.view(-1)[rest].norm()
    assert rel < 0.01
    assert y[0, 0] == pytest.approx(1e4, rel=1e-6)


def test_zero_blocks_and_exact_values_round_trip():
    x = torch.zeros(1000)
    x[500] = -3.0
    y = codec.decode(codec.encode(x, "8bit"))
    assert torch.equal(y, x)


def test_float16_and_none_round_trip():
    x = torch.randn(33, 17)
    assert torch.equal(codec.decode(codec.encode(x, "none")), x)
    y = codec.decode(codec.encode(x, "float16"))
    assert torch.allclose(y, x, rtol=1e-3, atol=1e-4) and y.dtype == torch.float32


@pytest.mark.parametrize("name", codec.CODECS)
def test_empty_tensors(name):
    for shape in [(0,), (4, 0, 3)]:
        x = torch.empty(shape)
        enc = codec.encode(x, name)
        y = codec.decode(enc)
        assert y.shape == x.shape and enc.payload == b""


@pytest.mark.parametrize("name", codec.CODECS)
def test_non_contiguous_input(name):
    base = torch.randn(40, 30)
    x = base.t()[::2]  # transposed and strided
    assert not x.is_contiguous()
    y = codec.decode(codec.encode(x, name))
    assert y.shape == x.shape
    # 8-bit: half a step of 1/127 of the absmax; below 8 bits, a step of 1/(2^bits - 1) of it, and the
    # rotated codecs' error of a block is that of the rotated block, spread over its 64 values
    bits = codec.LOWBIT.get(name, (8, False))[0]
    tolerance = 1 / 200 if bits == 8 else 8 / (2**bits - 1)
    assert torch.allclose(y, x, atol=float(x.abs().max()) * tolerance)


@pytest.mark.parametrize("name", codec.CODECS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integers_are_never_compressed(name, dtype):
    x = (torch.arange(-50, 250) % 7).to(dtype) if dtype != torch.uint8 else torch.arange(0, 255, dtype=dtype)
    enc = codec.encode(x, name)
    assert enc.codec == "none"
    y = codec.decode(enc)
    assert y.dtype == dtype and torch.equal(y, x)


def test_half_precision_inputs_keep_their_dtype():
    x = torch.randn(300).to(torch.bfloat16)
    assert codec.encode(x, "float16").codec == "none"
    y = codec.decode(codec.encode(x, "8bit"))
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), x.float(), atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("name", codec.CODECS)
def test_decoded_tensor_is_writable_and_owned(name, dtype):
    """decode copies out of the payload: the tensor is contiguous and can be written in place (no
    warning, no error) without changing the payload or a later decode, and none of its memory is the
    payload's buffer (a receive buffer may be reused): changing the buffer leaves it alone. 7 x 45
    values: a ragged 8-bit tail and a padded low-bit block."""
    x = (torch.randn(7, 45, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    encoded = codec.encode(x, name)
    assert encoded.codec == codec.effective_codec(dtype, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable buffer" UserWarning
        buffer = bytearray(encoded.payload)
        y = codec.decode(codec.EncodedTensor(encoded.codec, encoded.dtype, encoded.shape, buffer))
        assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
        decoded = y.clone()
        storage = y.untyped_storage()
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        buffer_lo = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        assert hi <= buffer_lo or lo >= buffer_lo + len(buffer)  # owned: no byte in the buffer
        buffer[:] = b"\xff" * len(buffer)
        assert torch.equal(y, decoded)
        y.add_(1)
        assert torch.equal(y, decoded + 1)

        sent = bytearray(encoded.payload)  # a copy: a tensor aliasing the payload would change the bytes
        z = codec.decode(encoded)
        z.mul_(2)  # writable: the write lands in the tensor and nowhere else
        assert torch.equal(z, decoded * 2)
        assert encoded.payload == sent
        assert torch.equal(codec.decode(encoded), decoded)  # a second decode is the first one


@pytest.mark.parametrize(
    "bad",
    [
        codec.EncodedTensor("8bit", "float32", (10,), b"\x00" * 13),
        codec.EncodedTensor("none", "float32", (10,), b"\x00" * 39),
        codec.EncodedTensor("8bit", "int64", (10,), b"\x00" * 14),
        codec.EncodedTensor("zip", "float32", (1,), b"\x00" * 4),
        codec.EncodedTensor("none", "complex64", (1,), b"\x00" * 8),
        codec.EncodedTensor("none", "float32", (-1, 2), b""),
    ],
)
def test_malformed_payloads_raise_codec_error(bad):
    with pytest.raises(codec.CodecError):
        codec.decode(bad)


def test_nonfinite_scales_are_rejected():
    good = codec.encode(torch.randn(10), "8bit")
    scale_nan = torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes()
    bad = codec.EncodedTensor("8bit", "float32", (10,), scale_nan + good.payload[4:])
    with pytest.raises(codec.CodecError):
        codec.decode(bad)


def test_fp32_equivalent_bytes():
    assert codec.encode(torch.randn(10, 10), "8bit").fp32_equivalent_bytes() == 400
    assert codec.encode(torch.zeros(10, dtype=torch.int64), "8bit").fp32_equivalent_bytes() == 80
    assert codec.encode(torch.zeros(10, dtype=torch.float16), "none").fp32_equivalent_bytes() == 40


def test_blockwise_codec_inside_hivemind_serialization():
    """The replicas' all-reduce sends pseudo-gradients through hivemind's serializer with this codec."""
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from swarmtrain.net.outer_averaging import _codec

    _codec("8bit")  # registers it for deserialization
    torch.manual_seed(0)
    x = torch.randn(3, 1024) * torch.logspace(-3, 1, 3).unsqueeze(
        1
    )  # rows (whole blocks) of very different scales
    wire = serialize_torch_tensor(x, runtime_pb2.CompressionType.BLOCKWISE_8BIT)
    y = deserialize_torch_tensor(wire)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert len(wire.buffer) == 3072 + 4 * 3072 // 256
    for row in range(3):  # per-block scales: the small row keeps its own precision
        assert (x[row] - y[row]).abs().max() <= x[row].abs().max() / 254 * 1.01


def test_an_all_reduce_part_with_non_finite_scales_decodes_to_nan_and_a_wrong_size_still_raises():
    """A replica's part whose 8-bit block scales are not finite (a byzantine or broken sender) decodes
    to NaN values, which the robust reducer drops (tests/unit/test_robust.py), instead of raising inside
    hivemind's all-reduce ("Future exception was never retrieved ... CodecError" in a replica's log)."""
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from swarmtrain.net.codec import CodecError
    from swarmtrain.net.outer_averaging import _codec

    _codec("8bit")
    wire = serialize_torch_tensor(torch.ones(2, 512), runtime_pb2.CompressionType.BLOCKWISE_8BIT)
    payload = bytearray(wire.buffer)
    payload[0:4] = struct.pack("<f", float("inf"))  # the first block's scale
    wire.buffer = bytes(payload)
    y = deserialize_torch_tensor(wire)
    assert y.shape == (2, 512) and bool(torch.isnan(y).all())
    wire.buffer = bytes(payload[:-1])
    with pytest.raises(CodecError, match="payload of"):
        deserialize_torch_tensor(wire)


def test_a_partial_all_reduce_is_recognised():
    """hivemind keeps a part local when its reducer's results never come, and raises nothing."""
    from swarmtrain.net.outer_averaging import unaveraged_fraction

    mine = [torch.tensor([1.0, 2.0, 0.0, 4.0]), torch.tensor([5.0, 6.0])]
    full = [torch.tensor([1.5, 2.5, 0.0, 3.0]), torch.tensor([4.0, 6.5])]
    assert unaveraged_fraction(mine, full) == 0.0  # the unused zero is not counted
    partial = [torch.tensor([1.5, 2.5, 0.0, 3.0]), torch.tensor([5.0, 6.0])]  # the second part stayed local
    assert unaveraged_fraction(mine, partial) == pytest.approx(2 / 5)


def test_a_partial_all_reduce_is_filled_from_another_members_mean():
    """Only the values that stayed local are taken from the other member's mean; the rest is ours."""
    from swarmtrain.net.outer_averaging import fill_unaveraged, unaveraged_fraction

    mine = [torch.tensor([1.0, 2.0, 0.0, 4.0]), torch.tensor([5.0, 6.0])]
    partial = [torch.tensor([1.5, 2.5, 0.0, 3.0]), torch.tensor([5.0, 6.0])]
    theirs = [torch.tensor([1.4, 2.6, 0.1, 3.1]), torch.tensor([4.0, 6.5])]  # their codec rounding differs
    filled = fill_unaveraged(mine, partial, theirs)
    torch.testing.assert_close(filled[0], torch.tensor([1.5, 2.5, 0.1, 3.0]))  # the unused zero: theirs
    torch.testing.assert_close(filled[1], torch.tensor([4.0, 6.5]))
    assert unaveraged_fraction(mine, filled) == 0.0


def test_values_both_members_kept_local_are_combined_alike_on_both():
    """A reducer that gave up on a late sender reduces its part from itself alone: both members hold
    their own values there. Each fills them with the same weighted mean (taking the other's value
    swapped them, and the replicas differed: CI), and the rest as before."""
    from swarmtrain.net.outer_averaging import fill_unaveraged

    a_sent, b_sent = [torch.tensor([1.0, 2.0, 3.0, 4.0])], [torch.tensor([5.0, 6.0, 7.0, 9.0])]
    # part 1 (values 0-1) reduced by a, part 2 (values 2-3) by b; a gave up on b's input for value 1,
    # whose result then never went back to b; b's results for value 3 never came back to a
    a_avg = [torch.tensor([3.0, 2.0, 5.0, 4.0])]
    b_avg = [torch.tensor([3.0, 6.0, 5.0, 6.5])]
    a_local, b_local = [a_avg[0] == a_sent[0]], [b_avg[0] == b_sent[0]]
    weights = (1.0, 3.0)  # a trained 1 sample for every 3 of b's
    a_filled = fill_unaveraged(a_sent, a_avg, b_avg, b_local, weights)
    b_filled = fill_unaveraged(b_sent, b_avg, a_avg, a_local, weights[::-1])
    torch.testing.assert_close(a_filled[0], torch.tensor([3.0, (2.0 + 3 * 6.0) / 4, 5.0, 6.5]))
    assert torch.equal(a_filled[0], b_filled[0])


def test_a_round_mean_says_where_it_is_the_members_own_value():
    """The `round_mean` reply's bits per value: packed 8 to a byte, and refused when they do not fit."""
    from swarmtrain.runtime.replica.round_repair import _pack_bits, _unpack_bits

    mask = torch.rand(3, 7) > 0.5
    packed = _pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    assert torch.equal(_unpack_bits(packed, mask.shape), mask)
    for bad in (packed[:2], packed.float(), packed.reshape(1, 3)):
        with pytest.raises(ValueError):
            _unpack_bits(bad, mask.shape)


@pytest.mark.parametrize("bad", [float("nan"), 1e3])
def test_a_mean_that_is_not_finite_or_implausibly_long_is_refused(bad):
    from swarmtrain.net.outer_averaging import fill_unaveraged

    mine, partial = [torch.tensor([1.0, 2.0])], [torch.tensor([1.5, 2.0])]
    with pytest.raises(ValueError):
        fill_unaveraged(mine, partial, [torch.tensor([1.4, bad])])
    # a value that was averaged is ours whatever the other member sends for it
    assert fill_unaveraged(mine, partial, [torch.tensor([bad, 2.2])])[0][0] == 1.5
