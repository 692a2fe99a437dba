"""The codecs on a compute device (net/codec.py, net/device_bytes.py) and the checks a server makes of
what it receives without decoding it on the host (net/protocol.checked_values).

Each device test runs once per entry of `DEVICES`: on CPU here (CI), and on CUDA in the `gpu` tier, where
it compares the device's results with the host's: deterministic codecs give the same bytes and the same
decoded values on both, stochastic rounding the same distribution (unbiased, the same fraction of values
rounded up within binomial noise).
"""

import dataclasses
import math

import pytest
import torch

from swarmtrain.net import codec, device_bytes, protocol
from swarmtrain.net.protocol import MAX_ABS_VALUE, ProtocolError, checked_values

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores, and
# the stochastic-rounding loops then ran ~3x slower
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FLOAT_CODECS = ["none", "float16", "8bit", "4bit", "3bit", "2bit", "4bit-rht", "2bit-rht"]


def activations(numel: int = 5000, seed: int = 0) -> torch.Tensor:
    """Values like a residual stream's: mostly unit scale, a few large outlier channels, a ragged tail."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    values[::97] *= 40.0
    return values


def test_reference_8bit_layout_is_unchanged():
    """The in-place encoder writes the documented format: fp32 scales absmax/127, then round(x * 127 / absmax)."""
    values = activations(1000)
    payload = codec.encode(values, "8bit").payload
    blocks = [values[i : i + codec.BLOCK_SIZE] for i in range(0, 1000, codec.BLOCK_SIZE)]
    absmax = torch.stack([b.abs().max() for b in blocks])
    scales = absmax / 127.0
    codes = torch.cat([(b * (127.0 / m)).round() for b, m in zip(blocks, absmax, strict=True)])
    expected = scales.numpy().tobytes() + codes.to(torch.int8).numpy().tobytes()
    assert payload == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_device_matches_host(device, name):
    """Deterministic encoding on the device gives the host's bytes; decoding them there, its values."""
    values = activations()
    on_host = codec.encode(values, name)
    on_device = codec.encode(values.to(device), name)
    assert on_device == on_host
    decoded = codec.decode(on_host, torch.device(device))
    assert decoded.device.type == device
    assert torch.equal(decoded.cpu(), codec.decode(on_host))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["4bit", "2bit", "4bit-rht"])
def test_stochastic_rounding_on_the_device_is_unbiased(device, name):
    """Gradients' stochastic rounding: the mean of many encodings converges to the values on every
    device, and the device rounds up as often as the host (same distribution)."""
    values = activations(2048, seed=1)
    runs = 200
    means, ups = {}, {}
    for where in ("cpu", device):
        decoded = [
            codec.decode(codec.encode(values.to(where), name, stochastic=True)).float() for _ in range(runs)
        ]
        stacked = torch.stack(decoded)
        means[where] = stacked.mean(0)
        ups[where] = float((stacked > values).float().mean())
    step = float(values.abs().max()) * 2 / (2 ** int(name[0]) - 1)
    for where, mean in means.items():
        # each value's mean over `runs` encodings is within a few standard errors of one rounding step
        assert float((mean - values).abs().mean()) < 0.1 * step, where
    # the share rounded up, over 2048 x 200 roundings: a difference beyond 1% is not binomial noise
    assert abs(ups["cpu"] - ups[device]) < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_bytes_round_trip_through_the_device(device):
    payload = bytes(range(256)) * 41 + b"tail"
    tensor = device_bytes.upload(payload, torch.device(device))
    assert tensor.device.type == device and tensor.dtype == torch.uint8
    assert device_bytes.download(tensor) == payload
    assert device_bytes.download(device_bytes.upload(b"", torch.device(device))) == b""
    for size in (10, 10_000, 5):  # the staging buffers grow and are reused
        data = bytes([size % 251]) * size
        assert device_bytes.download(device_bytes.upload(data, torch.device(device))) == data


@pytest.mark.parametrize("name", [n for n in FLOAT_CODECS if n in codec.SCALED])
def test_magnitude_bound_holds_for_every_scaled_codec(name):
    for scale in (1e-6, 1.0, 3e5):
        values = activations(seed=2) * scale
        encoded = codec.encode(values, name)
        bound = codec.magnitude_bound(encoded)
        assert bound is not None
        assert float(codec.decode(encoded).abs().max()) <= bound * (1 + 1e-6)
        # tight enough that an honest message settles on the scales: within 1.05x of the true largest
        # value (8x for the rotated codecs, whose bound is the block's length)
        slack = 8.0 if name.endswith("-rht") else 1.05
        assert bound <= slack * float(values.abs().max()) * (1 + 2**-6)
    assert codec.magnitude_bound(codec.encode(torch.ones(3), "none")) is None


def test_forged_8bit_codes_stay_within_the_bound():
    """-128 is a code no encoder writes: the bound (128 x scale) still covers it."""
    encoded = codec.encode(torch.ones(256), "8bit")
    forged = codec.EncodedTensor("8bit", "float32", (256,), encoded.payload[:4] + bytes([0x80]) * 256)
    assert float(codec.decode(forged).abs().max()) <= codec.magnitude_bound(forged)


def _checked(values: torch.Tensor, name: str) -> None:
    encoded = codec.encode(values, name)
    checked_values("inputs", encoded, codec.decode(encoded))


@pytest.mark.parametrize("name", FLOAT_CODECS)
def test_checks_refuse_what_the_old_checks_refused(name):
    """Finite values within the bound pass; beyond it, NaN and inf are refused (NaN and inf do not
    encode into a scaled codec: their block scale is not finite, which decoding refuses first; float16
    overflows to inf beyond 65504)."""
    _checked(activations(), name)
    beyond = "NaN or inf" if name == "float16" else "beyond the bound"
    with pytest.raises(ProtocolError, match=beyond):
        _checked(activations() * (3 * MAX_ABS_VALUE / 40), name)
    for bad in (math.nan, math.inf, -math.inf):
        values = activations()
        values[7] = bad
        if name in codec.SCALED:
            with pytest.raises(codec.CodecError, match="non-finite"):
                codec.decode(codec.encode(values, name))
        elif name == "none":
            with pytest.raises(ProtocolError, match="NaN or inf"):
                _checked(values, name)


def test_scaled_checks_read_no_values_when_the_scales_settle_them(monkeypatch):
    """An honest 8-bit message is settled by its block scales: the decoded values are never scanned."""
    encoded = codec.encode(activations(), "8bit")
    monkeypatch.setattr(protocol.torch, "aminmax", lambda *_: pytest.fail("values were scanned"))
    checked_values("inputs", encoded, codec.decode(encoded))


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_decodes_requests_on_its_device(device, tiny_cfg):
    """`StageIO.device`: a request's float tensors are decoded where the stage computes."""
    tiny_cfg = dataclasses.replace(tiny_cfg, swarm=dataclasses.replace(tiny_cfg.swarm, num_stages=3))
    spec = tiny_cfg.stages()[1]
    io = protocol.StageIO.from_config(tiny_cfg.model, spec, 8, torch.device(device))
    shape = (2, tiny_cfg.model.seq_len, tiny_cfg.model.wire_dim)
    message = protocol.request_message(
        "backward",
        "mb-1",
        1,
        tiny_cfg.digest(),
        "8bit",
        {"inputs": activations(math.prod(shape)).view(shape), "grad_outputs": torch.zeros(shape)},
        step=0,
    )
    request = protocol.validate_request(
        protocol.unpack(protocol.pack(message), 1 << 30), io, tiny_cfg.digest()
    )
    assert request.inputs.device.type == device and request.grad_outputs.device.type == device


@pytest.mark.gpu
def test_decoding_on_a_side_stream_is_ordered_before_later_work():
    """On CUDA a message is copied and decoded on a side stream while compute is queued on the current
    one; work queued after the decode sees the decoded values, and their memory outlives the side stream."""
    device = torch.device("cuda")
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(10):  # compute queued on the current stream, still running while the decode is issued
        busy = torch.tanh(busy @ busy)
    expected = []
    results = []
    for seed in range(8):
        encoded = codec.encode(activations(seed=seed), "8bit")
        expected.append(codec.decode(encoded) * 2)
        results.append(codec.decode(encoded, device) * 2)  # queued on the current stream
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got.cpu(), want)
    assert bool(torch.isfinite(busy).all())
