"""Codecs below 8 bits: payload sizes, error bounds per block, the rotation's effect on an outlier
channel, unbiased stochastic rounding for gradients, bit packing, malformed payloads."""

import pytest
import torch

from swarmtrain.net import codec, protocol

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores, and
# the stochastic-rounding loops then ran ~3x slower
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

LOWBIT = sorted(codec.LOWBIT)
BLOCK = codec.LOWBIT_BLOCK


def _data(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.linspace(0.01, 100, numel)


@pytest.mark.parametrize("name", LOWBIT)
@pytest.mark.parametrize("numel", [1, 7, BLOCK - 1, BLOCK, 3 * BLOCK + 5, 10_000])
def test_error_is_within_half_a_step_of_each_block(name, numel):
    """Unrotated: each value is within half a step (2 absmax / (2^bits - 1)) of its block. Rotated: the
    same bound holds in the rotated basis, so the block's error vector is at most sqrt(64) half-steps
    long (the rotation is orthogonal and keeps lengths)."""
    bits, rotated = codec.LOWBIT[name]
    x = _data(numel, numel)
    encoded = codec.encode(x, name)
    assert len(encoded.payload) == codec.payload_size(name, torch.float32, numel)
    assert len(encoded.payload) == -(-numel // BLOCK) * (2 + 8 * bits)
    y = codec.decode(encoded)
    assert y.shape == x.shape and y.dtype == torch.float32
    pad = -numel % BLOCK
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, BLOCK)
    error = torch.cat([y - x, x.new_zeros(pad)]).view(-1, BLOCK)
    if not rotated:
        half_step = blocks.abs().amax(dim=1, keepdim=True) / (2**bits - 1) * (1 + 2**-6) + 1e-6
        assert bool((error.abs() <= half_step).all())
        return
    rotation = codec._ROTATION
    assert torch.allclose(rotation @ rotation.T, torch.eye(BLOCK), atol=1e-5)
    half_step = (blocks @ rotation.T).abs().amax(dim=1) / (2**bits - 1) * (1 + 2**-6) + 1e-6
    # a ragged tail's padding decodes to values that are dropped: that only shortens the error vector
    assert bool((error.norm(dim=1) <= BLOCK**0.5 * half_step).all())


def test_the_rotation_spreads_an_outlier_channel():
    """One channel 30x larger than the rest (what transformer activations look like): without the
    rotation it sets the step of every block it is in; with it, its energy is shared by the block."""
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(1))
    x[:, 5] *= 30
    errors = {}
    for name in ("4bit", "4bit-rht", "2bit", "2bit-rht"):
        y = codec.decode(codec.encode(x, name))
        rest = torch.ones(256, dtype=torch.bool)
        rest[5] = False
        errors[name] = float((y - x)[:, rest].norm() / x[:, rest].norm())
    assert errors["4bit-rht"] < errors["4bit"] / 2
    assert errors["2bit-rht"] < errors["2bit"] / 2


@pytest.mark.parametrize("name", ["4bit-rht", "2bit"])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(name):
    """A value between two levels: nearest rounding always lands on the same level (a bias every
    micro-batch repeats); stochastic rounding averages to the value."""
    torch.manual_seed(0)
    x = torch.randn(4 * BLOCK)
    repeats = 400
    nearest = codec.decode(codec.encode(x, name))
    assert torch.equal(nearest, codec.decode(codec.encode(x, name)))
    mean = sum(codec.decode(codec.encode(x, name, stochastic=True)) for _ in range(repeats)) / repeats
    bias_nearest = float((nearest - x).norm() / x.norm())
    bias_stochastic = float((mean - x).norm() / x.norm())
    # the mean's error is the codec's noise / sqrt(repeats): well under a fifth of nearest's bias
    assert bias_stochastic < bias_nearest / 5


def test_stochastic_rounding_leaves_torchs_global_generator_alone():
    """Servers seed torch's generator (initial weights, dropout): encoding gradients must not move it."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    codec.encode(torch.randn(1000, generator=torch.Generator()), "4bit-rht", stochastic=True)
    assert torch.equal(torch.get_rng_state(), state)


def test_gradients_are_rounded_stochastically_activations_to_nearest():
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    grads = [protocol.make_message("result", {}, {"grad_inputs": x}, "2bit-rht") for _ in range(2)]
    outputs = [protocol.make_message("result", {}, {"outputs": x}, "2bit-rht") for _ in range(2)]
    assert grads[0].tensors["grad_inputs"].payload != grads[1].tensors["grad_inputs"].payload
    assert outputs[0].tensors["outputs"].payload == outputs[1].tensors["outputs"].payload


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packing_round_trips_every_code(bits):
    codes = torch.arange(2**bits, dtype=torch.uint8).repeat(8 * 5)[: 8 * 5 * 2**bits]
    codes = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(bits))]
    packed = codec._pack(codes, bits)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(codec._unpack(packed, bits), codes)


@pytest.mark.parametrize("name", LOWBIT)
def test_zeros_and_bf16_inputs(name):
    assert torch.equal(codec.decode(codec.encode(torch.zeros(100), name)), torch.zeros(100))
    x = torch.randn(300).to(torch.bfloat16)
    y = codec.decode(codec.encode(x, name))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_tiny_gradients_keep_their_scale():
    """The block step is bf16, which has fp32's range: gradients of 1e-9 do not underflow (fp16 would)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 1e-9
    y = codec.decode(codec.encode(x, "4bit"))
    assert float((y - x).norm() / x.norm()) < 0.2


@pytest.mark.parametrize("name", LOWBIT)
def test_malformed_lowbit_payloads_raise_codec_error(name):
    good = codec.encode(torch.randn(100), name)
    with pytest.raises(codec.CodecError):
        codec.decode(codec.EncodedTensor(name, "float32", (100,), good.payload[:-1]))
    nan_step = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(codec.CodecError):
        codec.decode(codec.EncodedTensor(name, "float32", (100,), nan_step + good.payload[2:]))


def test_a_lowbit_codec_is_part_of_the_digest_and_8bit_is_not():
    import dataclasses

    from swarmtrain.config import get_preset

    cfg = get_preset("tiny")

    def with_codec(name):
        return cfg.replace(swarm=dataclasses.replace(cfg.swarm, compression=name))

    assert with_codec("none").digest() == with_codec("8bit").digest() == cfg.digest()
    assert with_codec("4bit-rht").digest() not in (cfg.digest(), with_codec("4bit").digest())
