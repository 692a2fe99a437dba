"""Tensor codecs for activations and gradients on the wire: none, float16, blockwise 8-bit, and
blockwise 4-, 3- and 2-bit, each of those plain or after a randomized Hadamard rotation (`-rht`).

Blockwise 8-bit (absmax per block): the flattened tensor is cut into blocks of `BLOCK_SIZE` values;
each block stores one fp32 scale (its absolute maximum / 127) and one int8 per value, rounded to
nearest. Worst-case error per value is half a quantization step, absmax_of_block / 254. An outlier
only costs precision inside its own block, which is why activations survive it (SWARM, Dettmers'
blockwise quantization). Payload: 1 byte per value + 4 bytes per block (~1.016 bytes at 256).

Below 8 bits (`{4,3,2}bit`, `{4,3,2}bit-rht`): blocks of `LOWBIT_BLOCK` = 64 values, one bf16 step per
block and `bits` per value, packed eight values to `bits` bytes. The 2^bits levels are spread evenly
over [-absmax, +absmax] of the block (mid-rise: both ends are levels, zero is not one, so all 2^bits
codes are used). Activations are rounded to the nearest level; gradients (`encode(..., stochastic=True)`)
to one of the two levels around them with probabilities that make the decoded value unbiased, so the
rounding error averages out over a step's micro-batches instead of adding up. `-rht` multiplies each
block by a fixed orthogonal matrix first (Hadamard x fixed random signs / 8; the same matrix on every
peer, so the name says everything a receiver needs) and by its transpose after decoding: one outlier
channel is spread over its block, whose values then look alike, so the block's step shrinks (QuaRot,
and the pipeline-compression papers built on it). Payload: 64 values in 2 + 8 * bits bytes, 4-bit
4.25 bits per value (7.5x fewer than fp32), 3-bit 3.25, 2-bit 2.25 (14.2x); a ragged tail is padded
to a whole block.

Integer and bool tensors are never rounded: any codec sends them raw. Token ids and labels may instead
go packed (`encode_ints`, codec `bits{N}`: N bits per non-negative value, net/bit_packing.py), which
loses nothing.
Everything is vectorized torch on the tensor's device (a stage server's GPU: net/device_bytes.py moves
only payload bytes between it and the host; on CUDA `decode` and `encode_behind` run on side streams,
overlapping the compute queued there); no numpy round trips, no Python loops over blocks.
hivemind's own 8-bit codecs fail under numpy 2 and are ~10x slower (docs/DESIGN.md section 4).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarmtrain.config.run import COMPRESSION_CHOICES, LOWBIT_COMPRESSION
from swarmtrain.net import bit_packing, device_bytes

CODECS = COMPRESSION_CHOICES
Buffer = bytes | bytearray | memoryview  # what a payload may be held in
BLOCK_SIZE = 256
_QMAX = 127.0
LOWBIT_BLOCK = 64
# codec name -> (bits per value, rotated)
LOWBIT: dict[str, tuple[int, bool]] = {
    name: (int(name[0]), name.endswith("-rht")) for name in LOWBIT_COMPRESSION
}
SCALED = ("8bit", *LOWBIT)  # the codecs whose payload starts with per-block scales
# lossless packing of non-negative integers at N bits each (`encode_ints`); a closed set of names
PACKED: dict[str, int] = {f"bits{n}": n for n in range(1, bit_packing.MAX_BITS + 1)}
WIRE_CODECS = (*CODECS, *PACKED)  # every codec a tensor on the wire may name

# dtype names on the wire; a closed set, so a peer cannot make us build an arbitrary dtype
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CodecError(ValueError):
    """A payload that does not match its description (size, dtype, codec)."""


class NonFiniteScales(CodecError):
    """A scaled codec's payload of the right size whose block scales (or steps) are not finite."""


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor as sent: `codec` actually applied ('none' for integers), original dtype and shape."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload: Buffer  # bytes, or for a large payload received a view of its message (net/protocol.py)

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    def fp32_equivalent_bytes(self) -> int:
        """Bytes this tensor would take with every float sent as fp32 (the benchmark's reference)."""
        dtype = DTYPES[self.dtype]
        return self.numel * (4 if dtype.is_floating_point else _itemsize(dtype))


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def effective_codec(dtype: torch.dtype, codec: str) -> str:
    """The codec actually used for a tensor of `dtype` when `codec` is requested."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r} (choose from {', '.join(CODECS)})")
    if not dtype.is_floating_point:
        return "none"
    if codec == "float16" and dtype in (torch.float16, torch.bfloat16):
        return "none"  # already 2 bytes per value
    return codec


@dataclass(frozen=True)
class PendingTensor:
    """An encoding whose payload is still being copied to the host (`encode_behind` on CUDA)."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    download: device_bytes.Download

    def result(self) -> EncodedTensor:
        """The encoding, once the payload's copy has run (waits for that copy alone)."""
        return EncodedTensor(self.codec, self.dtype, self.shape, self.download.result())


def encode(tensor: torch.Tensor, codec: str, stochastic: bool = False) -> EncodedTensor:
    """Encode a tensor (any layout, on any device: the arithmetic runs where it is, only the payload's
    bytes come to the host) with `codec`; integer tensors are sent as they are. `stochastic`: unbiased
    stochastic rounding (for gradients) in the codecs below 8 bits."""
    applied, payload = _payload(tensor, codec, stochastic)
    return EncodedTensor(
        applied, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), device_bytes.download(payload)
    )


def encode_ints(tensor: torch.Tensor, bits: int) -> EncodedTensor:
    """An integer tensor packed at `bits` bits per value (codec `bits{N}`) when its values all lie in [0,
    2^bits), else (an ignored label, -100) as it is, as `encode` sends it. Its dtype is kept for the
    receiver, so `bits` must leave that dtype's sign bit clear."""
    name, limit = DTYPE_NAMES.get(tensor.dtype), _packable_bits(tensor.dtype)
    if name is None or not 1 <= bits <= limit:
        raise CodecError(f"{tensor.dtype} cannot be packed at {bits} bits (1..{limit})")
    flat = tensor.detach().contiguous().view(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 2**bits):
        return encode(tensor, "none")
    payload = bit_packing.pack_bits(flat, bits)
    return EncodedTensor(f"bits{bits}", name, tuple(tensor.shape), device_bytes.download(payload))


def _packable_bits(dtype: torch.dtype) -> int:
    """The widest packing whose values `dtype` holds as non-negative numbers (0: a float or bool)."""
    if dtype.is_floating_point or dtype == torch.bool:
        return 0
    width = _itemsize(dtype) * 8 - (0 if dtype == torch.uint8 else 1)
    return min(width, bit_packing.MAX_BITS)


def encode_behind(
    tensor: torch.Tensor, codec: str, stochastic: bool = False
) -> EncodedTensor | PendingTensor:
    """`encode`, overlapped with what the caller queues next on CUDA: the arithmetic and the payload's
    copy to the host run on a side stream, after the work queued so far on the current stream (the
    tensor's own computation included), and nothing waits for them here; the `PendingTensor`'s `result()`
    does (net/device_bytes.py, `behind_current`). `tensor` must not be written to afterwards. Off CUDA,
    and for an empty tensor (its payload is empty: no copy, no staging buffer): `encode`, the same code
    in the same order; the bytes are the same on every device."""
    if tensor.device.type != "cuda" or tensor.numel() == 0:
        return encode(tensor, codec, stochastic)
    with device_bytes.behind_current(tensor):
        applied, payload = _payload(tensor, codec, stochastic)
        download = device_bytes.start_download(payload)
    return PendingTensor(applied, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), download)


def _payload(tensor: torch.Tensor, codec: str, stochastic: bool) -> tuple[str, torch.Tensor]:
    """(the codec applied, the payload as a uint8 tensor beside `tensor`)."""
    if tensor.dtype not in DTYPE_NAMES:
        raise CodecError(f"unsupported dtype {tensor.dtype}")
    applied = effective_codec(tensor.dtype, codec)
    flat = tensor.detach().contiguous().view(-1)
    if flat.numel() == 0:
        return applied, torch.empty(0, dtype=torch.uint8, device=flat.device)
    if applied == "none":
        return applied, _as_bytes(flat)
    if applied == "float16":
        return applied, _as_bytes(flat.to(torch.float16))
    if applied == "8bit":
        return applied, _encode_8bit(flat)
    bits, rotated = LOWBIT[applied]
    return applied, _encode_lowbit(flat, bits, rotated, stochastic)


def decode(encoded: EncodedTensor, device: torch.device | None = None) -> torch.Tensor:
    """Inverse of `encode`, computed on `device` (None: the host), where only the payload's bytes are
    copied; raises CodecError when the payload does not match its description or its block scales are
    not finite (checked on the host bytes before anything is copied)."""
    dtype = _checked_description(encoded)
    numel = encoded.numel
    if numel == 0:
        return torch.empty(encoded.shape, dtype=dtype, device=device)
    if encoded.codec in SCALED:
        _checked_scales(encoded)
    with device_bytes.side_stream(device) as hand_over:  # overlaps the compute queued on a GPU
        return hand_over(_decoded(encoded, dtype, device))


def _decoded(encoded: EncodedTensor, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    numel = encoded.numel
    payload = device_bytes.upload(encoded.payload, device)
    if encoded.codec == "none":
        flat = _view(payload, dtype, numel)
        if payload.device.type == "cpu":
            flat = flat.clone()  # own the memory: the host view is read-only
    elif encoded.codec == "float16":
        flat = _view(payload, torch.float16, numel).to(dtype)
    elif encoded.codec == "8bit":
        flat = _decode_8bit(payload, numel, dtype)
    elif encoded.codec in PACKED:
        flat = bit_packing.unpack_bits(payload, PACKED[encoded.codec], numel).to(dtype)
    else:
        bits, rotated = LOWBIT[encoded.codec]
        flat = _decode_lowbit(payload, numel, bits, rotated).to(dtype)
    return flat.view(encoded.shape)


def _checked_description(encoded: EncodedTensor) -> torch.dtype:
    if encoded.dtype not in DTYPES:
        raise CodecError(f"unknown dtype {encoded.dtype!r}")
    dtype = DTYPES[encoded.dtype]
    if encoded.codec not in WIRE_CODECS:
        raise CodecError(f"unknown codec {encoded.codec!r}")
    if encoded.codec in PACKED:
        fits = PACKED[encoded.codec] <= _packable_bits(dtype)
    else:
        fits = encoded.codec == effective_codec(dtype, encoded.codec)
    if not fits:
        raise CodecError(f"codec {encoded.codec} cannot carry {encoded.dtype}")
    if any(d < 0 for d in encoded.shape):
        raise CodecError(f"negative dimension in shape {encoded.shape}")
    expected = payload_size(encoded.codec, dtype, encoded.numel)
    if len(encoded.payload) != expected:
        raise CodecError(
            f"payload of {len(encoded.payload)} bytes, expected {expected} for {encoded.codec} "
            f"{encoded.dtype}{list(encoded.shape)}"
        )
    return dtype


# block scales, read on the host ----------------------------------------------------------------
def _host_scales(encoded: EncodedTensor) -> torch.Tensor:
    """A scaled codec's per-block scales (8-bit) or steps (below 8 bits) as fp32, from the host bytes:
    one value per 64 or 256, so reading them costs next to nothing and needs no device."""
    payload = device_bytes.host_view(encoded.payload)
    if encoded.codec == "8bit":
        return _view(payload, torch.float32, -(-encoded.numel // BLOCK_SIZE))
    return _view(payload, torch.int16, -(-encoded.numel // LOWBIT_BLOCK)).view(torch.bfloat16).float()


def _checked_scales(encoded: EncodedTensor) -> None:
    if not bool(torch.isfinite(_host_scales(encoded)).all()):
        kind = "block scales" if encoded.codec == "8bit" else "block steps"
        raise NonFiniteScales(f"{encoded.codec} payload has non-finite {kind}")


def magnitude_bound(encoded: EncodedTensor) -> float | None:
    """An upper bound on every |value| the payload decodes to, read from its block scales on the host
    (no decoding; nan or inf when a scale is not finite); None for the codecs without scales (`none`,
    `float16`), whose values must be looked at. 8-bit: codes lie in [-128, 127], so 128 x the largest
    scale (an encoder's codes stop at 127: honest values reach 127/128 of the bound). Below 8 bits:
    codes centred on (2^bits - 1) / 2, times the step; `-rht` rotates each block of 64 back by an
    orthogonal matrix, which moves a value at most to the block's length, sqrt(64) x its largest."""
    if encoded.codec not in SCALED or encoded.numel == 0:
        return None if encoded.codec not in SCALED else 0.0
    largest = float(_host_scales(encoded).abs().max())
    if encoded.codec == "8bit":
        return 128.0 * largest
    bits, rotated = LOWBIT[encoded.codec]
    return largest * (2**bits - 1) / 2 * (LOWBIT_BLOCK**0.5 if rotated else 1.0)


def payload_size(codec: str, dtype: torch.dtype, numel: int) -> int:
    if codec == "none":
        return numel * _itemsize(dtype)
    if codec == "float16":
        return numel * 2
    if codec in PACKED:
        return bit_packing.packed_size(numel, PACKED[codec])
    if codec in LOWBIT:
        return -(-numel // LOWBIT_BLOCK) * (2 + 8 * LOWBIT[codec][0])
    num_blocks = -(-numel // BLOCK_SIZE)
    return num_blocks * 4 + numel


# 8-bit ------------------------------------------------------------------------------------------
def _encode_8bit(flat: torch.Tensor) -> torch.Tensor:
    """The payload as a uint8 tensor beside `flat`: fp32 block scales, then one int8 code per value,
    each written in place (no concatenation copy)."""
    numel = flat.numel()
    if flat.dtype != torch.float32:
        flat = flat.float()
    num_blocks = -(-numel // BLOCK_SIZE)
    out = torch.empty(4 * num_blocks + numel, dtype=torch.uint8, device=flat.device)
    scales, codes = out[: 4 * num_blocks].view(torch.float32), out[4 * num_blocks :].view(torch.int8)
    full = numel - numel % BLOCK_SIZE
    if full:
        _quantize_blocks(flat[:full].view(-1, BLOCK_SIZE), codes[:full], scales[: full // BLOCK_SIZE])
    if full < numel:  # the ragged tail is its own (short) block: no padding copy of the whole tensor
        _quantize_blocks(flat[full:].view(1, -1), codes[full:], scales[-1:])
    return out


def _quantize_blocks(blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """blocks: (num_blocks, block) fp32 -> `codes` (int8, flat) and `scales` (fp32, num_blocks)."""
    absmax = blocks.abs().amax(dim=1)  # measured 4x faster than aminmax(dim=1) on one core
    # divided by a tensor, not by a Python number: CUDA divides by a host scalar as a multiplication by
    # its reciprocal, one ulp off the host's division, and the payload must be the same bytes anywhere
    torch.div(absmax, torch.full_like(absmax, _QMAX), out=scales)
    # a zero block has scale 0: multiply by 0 instead of dividing by it
    inverse = torch.where(absmax > 0, _QMAX / absmax, torch.zeros_like(absmax))
    scaled = blocks * inverse.unsqueeze(1)
    codes.view(blocks.shape).copy_(scaled.round_())  # integral already: the cast is exact


def _decode_8bit(payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    num_blocks = -(-numel // BLOCK_SIZE)
    scales = _view(payload, torch.float32, num_blocks)
    codes = _view(payload, torch.int8, numel, offset=num_blocks * 4)
    full = numel - numel % BLOCK_SIZE
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if full:
        # int8 * fp32 promotes to fp32 inside one kernel: no separate int->float pass
        torch.mul(
            codes[:full].view(-1, BLOCK_SIZE),
            scales[: full // BLOCK_SIZE].unsqueeze(1),
            out=out[:full].view(-1, BLOCK_SIZE),
        )
    if full < numel:
        torch.mul(codes[full:], scales[-1], out=out[full:])
    return out if dtype == torch.float32 else out.to(dtype)


# below 8 bits -------------------------------------------------------------------------------------
def _rotation() -> torch.Tensor:
    """The fixed orthogonal matrix of the `-rht` codecs: Sylvester's Hadamard matrix times a diagonal of
    random signs (a fixed seed: every peer builds the same one), scaled by 1/sqrt(64)."""
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < LOWBIT_BLOCK:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    signs = torch.randint(0, 2, (LOWBIT_BLOCK,), generator=torch.Generator().manual_seed(20261125)) * 2 - 1
    return (hadamard * signs.float()).div_(LOWBIT_BLOCK**0.5).contiguous()


_ROTATION = _rotation()  # rows are orthonormal: x @ R.T rotates a block, y @ R rotates it back
_random = threading.local()  # generators per thread: stochastic rounding never touches torch's global RNG
_constants: dict[tuple[str, torch.device], torch.Tensor] = {}  # the tables below, copied to each device once


def _on(name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant table on `device` (a copy made once per device)."""
    if device.type == "cpu":
        return table
    key = (name, device)
    if key not in _constants:
        _constants[key] = table.to(device)
    return _constants[key]


def _generator(device: torch.device) -> torch.Generator:
    """This thread's generator for `device`, seeded from the operating system's entropy."""
    generators = getattr(_random, "generators", None)
    if generators is None:
        generators = _random.generators = {}
    if device not in generators:
        generator = torch.Generator(device=device)
        generator.seed()
        generators[device] = generator
    return generators[device]


def _encode_lowbit(flat: torch.Tensor, bits: int, rotated: bool, stochastic: bool) -> torch.Tensor:
    """The payload as a uint8 tensor beside `flat`: bf16 block steps, then the packed codes."""
    device = flat.device
    blocks = _padded_blocks(flat.float())
    if rotated:
        blocks = blocks @ _on("rotation", _ROTATION, device).T
    top = float(2**bits - 1)
    # the step is rounded up to bf16 (2 bytes, fp32's range: a gradient's 1e-9 does not underflow as in
    # fp16) before the codes are computed, so the codes are exact for the step the receiver decodes with
    step = (blocks.abs().amax(dim=1) * (2.0 * (1 + 2**-7) / top)).to(torch.bfloat16)
    step_fp32 = step.float()
    inverse = torch.where(step_fp32 > 0, 1.0 / step_fp32, torch.zeros_like(step_fp32))
    half = torch.full((), top / 2, device=device)
    scaled = torch.addcmul(half, blocks, inverse.unsqueeze(1))  # in [0, top]
    if stochastic:
        scaled.add_(torch.rand(scaled.shape, generator=_generator(device), device=device)).floor_()
    else:
        scaled.round_()
    codes = scaled.clamp_(0, top).to(torch.uint8)
    return torch.cat([step.view(torch.uint8), _pack(codes.view(-1), bits)])


def _padded_blocks(flat: torch.Tensor) -> torch.Tensor:
    tail = -flat.numel() % LOWBIT_BLOCK
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    return flat.view(-1, LOWBIT_BLOCK)


def _decode_lowbit(payload: torch.Tensor, numel: int, bits: int, rotated: bool) -> torch.Tensor:
    num_blocks = -(-numel // LOWBIT_BLOCK)
    step = _view(payload, torch.int16, num_blocks).view(torch.bfloat16).float()
    codes = _unpack(_view(payload, torch.uint8, num_blocks * 8 * bits, offset=2 * num_blocks), bits)
    centred = codes.view(num_blocks, LOWBIT_BLOCK).float().sub_((2**bits - 1) / 2)
    blocks = centred.mul_(step.unsqueeze(1))
    if rotated:
        blocks = blocks @ _on("rotation", _ROTATION, payload.device)
    return blocks.view(-1)[:numel]


_SHIFTS = {bits: torch.arange(8, dtype=torch.int64) * bits for bits in (2, 3, 4)}
_BYTE_SHIFTS = {bits: torch.arange(bits, dtype=torch.int64) * 8 for bits in (2, 3, 4)}


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8 < 2^bits, a multiple of 8 of them) -> `bits` bytes per 8 codes, little-endian."""
    if bits == 4:  # two per byte: the common case, without 64-bit words
        pairs = codes.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    shifts = _on(f"shifts{bits}", _SHIFTS[bits], codes.device)
    byte_shifts = _on(f"byte_shifts{bits}", _BYTE_SHIFTS[bits], codes.device)
    words = (codes.view(-1, 8).to(torch.int64) << shifts).sum(dim=1)
    return ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
    shifts = _on(f"shifts{bits}", _SHIFTS[bits], packed.device)
    byte_shifts = _on(f"byte_shifts{bits}", _BYTE_SHIFTS[bits], packed.device)
    words = (packed.view(-1, bits).to(torch.int64) << byte_shifts).sum(dim=1)
    return ((words.unsqueeze(1) >> shifts) & (2**bits - 1)).to(torch.uint8).view(-1)


# raw bytes ----------------------------------------------------------------------------------------
def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as uint8 (a view: no copy)."""
    return flat.contiguous().view(-1).view(torch.uint8)


def _view(payload: torch.Tensor, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """`count` values of `dtype` at byte `offset` of a uint8 payload, as a view (on its device)."""
    size = _itemsize(dtype)
    return payload[offset : offset + count * size].view(dtype)
