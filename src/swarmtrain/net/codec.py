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

Integer and bool tensors are never compressed (token ids, labels): any codec sends them raw.
Everything is vectorized torch on the calling thread; no numpy round trips, no Python loops over
blocks. hivemind's own 8-bit codecs fail under numpy 2 and are ~10x slower (docs/DESIGN.md section 4).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarmtrain.config.run import COMPRESSION_CHOICES, LOWBIT_COMPRESSION

CODECS = COMPRESSION_CHOICES
BLOCK_SIZE = 256
_QMAX = 127.0
LOWBIT_BLOCK = 64
# codec name -> (bits per value, rotated)
LOWBIT: dict[str, tuple[int, bool]] = {
    name: (int(name[0]), name.endswith("-rht")) for name in LOWBIT_COMPRESSION
}

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


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor as sent: `codec` actually applied ('none' for integers), original dtype and shape."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload: bytes

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


def encode(tensor: torch.Tensor, codec: str, stochastic: bool = False) -> EncodedTensor:
    """Encode a CPU tensor (any layout) with `codec`; integer tensors are sent as they are.
    `stochastic`: unbiased stochastic rounding (for gradients) in the codecs below 8 bits."""
    if tensor.dtype not in DTYPE_NAMES:
        raise CodecError(f"unsupported dtype {tensor.dtype}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    applied = effective_codec(tensor.dtype, codec)
    flat = tensor.contiguous().view(-1)
    if applied == "none":
        payload = _to_bytes(flat)
    elif applied == "float16":
        payload = _to_bytes(flat.to(torch.float16))
    elif applied == "8bit":
        payload = _encode_8bit(flat)
    else:
        bits, rotated = LOWBIT[applied]
        payload = _encode_lowbit(flat, bits, rotated, stochastic)
    return EncodedTensor(applied, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), payload)


def decode(encoded: EncodedTensor) -> torch.Tensor:
    """Inverse of `encode`; raises CodecError when the payload size does not match the description."""
    if encoded.dtype not in DTYPES:
        raise CodecError(f"unknown dtype {encoded.dtype!r}")
    dtype = DTYPES[encoded.dtype]
    if encoded.codec not in CODECS:
        raise CodecError(f"unknown codec {encoded.codec!r}")
    if encoded.codec != effective_codec(dtype, encoded.codec):
        raise CodecError(f"codec {encoded.codec} cannot carry {encoded.dtype}")
    if any(d < 0 for d in encoded.shape):
        raise CodecError(f"negative dimension in shape {encoded.shape}")
    numel = encoded.numel
    expected = payload_size(encoded.codec, dtype, numel)
    if len(encoded.payload) != expected:
        raise CodecError(
            f"payload of {len(encoded.payload)} bytes, expected {expected} for {encoded.codec} "
            f"{encoded.dtype}{list(encoded.shape)}"
        )
    if numel == 0:
        return torch.empty(encoded.shape, dtype=dtype)
    if encoded.codec == "none":
        flat = _from_bytes(encoded.payload, dtype, numel).clone()  # own the memory: the buffer is read-only
    elif encoded.codec == "float16":
        flat = _from_bytes(encoded.payload, torch.float16, numel).to(dtype)
    elif encoded.codec == "8bit":
        flat = _decode_8bit(encoded.payload, numel, dtype)
    else:
        bits, rotated = LOWBIT[encoded.codec]
        flat = _decode_lowbit(encoded.payload, numel, bits, rotated).to(dtype)
    return flat.view(encoded.shape)


def payload_size(codec: str, dtype: torch.dtype, numel: int) -> int:
    if codec == "none":
        return numel * _itemsize(dtype)
    if codec == "float16":
        return numel * 2
    if codec in LOWBIT:
        return -(-numel // LOWBIT_BLOCK) * (2 + 8 * LOWBIT[codec][0])
    num_blocks = -(-numel // BLOCK_SIZE)
    return num_blocks * 4 + numel


# 8-bit ------------------------------------------------------------------------------------------
def _encode_8bit(flat: torch.Tensor) -> bytes:
    numel = flat.numel()
    if numel == 0:
        return b""
    if flat.dtype != torch.float32:
        flat = flat.float()
    full = numel - numel % BLOCK_SIZE
    parts_q, parts_scale = [], []
    if full:
        q, scale = _quantize_blocks(flat[:full].view(-1, BLOCK_SIZE))
        parts_q.append(q.view(-1))
        parts_scale.append(scale)
    if full < numel:  # the ragged tail is its own (short) block: no padding copy of the whole tensor
        q, scale = _quantize_blocks(flat[full:].view(1, -1))
        parts_q.append(q.view(-1))
        parts_scale.append(scale)
    scales = parts_scale[0] if len(parts_scale) == 1 else torch.cat(parts_scale)
    codes = parts_q[0] if len(parts_q) == 1 else torch.cat(parts_q)
    return _to_bytes(scales) + _to_bytes(codes)


def _quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks: (num_blocks, block) fp32 -> int8 codes of the same shape and fp32 scales (num_blocks,)."""
    absmax = blocks.abs().amax(dim=1)  # measured 4x faster than aminmax(dim=1) on one core
    scale = absmax / _QMAX
    # a zero block has scale 0: multiply by 0 instead of dividing by it
    inverse = torch.where(absmax > 0, _QMAX / absmax, torch.zeros_like(absmax))
    scaled = blocks * inverse.unsqueeze(1)
    codes = scaled.round_().to(torch.int8)
    return codes, scale


def _decode_8bit(payload: bytes, numel: int, dtype: torch.dtype) -> torch.Tensor:
    num_blocks = -(-numel // BLOCK_SIZE)
    scales = _from_bytes(payload, torch.float32, num_blocks)
    codes = _from_bytes(payload, torch.int8, numel, offset=num_blocks * 4)
    if not bool(torch.isfinite(scales).all()):
        raise CodecError("8-bit payload has non-finite block scales")
    full = numel - numel % BLOCK_SIZE
    out = torch.empty(numel, dtype=torch.float32)
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
_random = threading.local()  # a generator per thread: stochastic rounding never touches torch's global RNG


def _generator() -> torch.Generator:
    generator = getattr(_random, "generator", None)
    if generator is None:
        generator = _random.generator = torch.Generator()
        generator.seed()
    return generator


def _encode_lowbit(flat: torch.Tensor, bits: int, rotated: bool, stochastic: bool) -> bytes:
    numel = flat.numel()
    if numel == 0:
        return b""
    blocks = _padded_blocks(flat.float())
    if rotated:
        blocks = blocks @ _ROTATION.T
    top = float(2**bits - 1)
    # the step is rounded up to bf16 (2 bytes, fp32's range: a gradient's 1e-9 does not underflow as in
    # fp16) before the codes are computed, so the codes are exact for the step the receiver decodes with
    step = (blocks.abs().amax(dim=1) * (2.0 * (1 + 2**-7) / top)).to(torch.bfloat16)
    step_fp32 = step.float()
    inverse = torch.where(step_fp32 > 0, 1.0 / step_fp32, torch.zeros_like(step_fp32))
    scaled = torch.addcmul(torch.full((), top / 2), blocks, inverse.unsqueeze(1))  # in [0, top]
    if stochastic:
        scaled.add_(torch.rand(scaled.shape, generator=_generator())).floor_()
    else:
        scaled.round_()
    codes = scaled.clamp_(0, top).to(torch.uint8)
    return _to_bytes(step.view(torch.int16)) + _to_bytes(_pack(codes.view(-1), bits))


def _padded_blocks(flat: torch.Tensor) -> torch.Tensor:
    tail = -flat.numel() % LOWBIT_BLOCK
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    return flat.view(-1, LOWBIT_BLOCK)


def _decode_lowbit(payload: bytes, numel: int, bits: int, rotated: bool) -> torch.Tensor:
    num_blocks = -(-numel // LOWBIT_BLOCK)
    step = _from_bytes(payload, torch.int16, num_blocks).view(torch.bfloat16).float()
    if not bool(torch.isfinite(step).all()):
        raise CodecError(f"{bits}-bit payload has non-finite block steps")
    codes = _unpack(_from_bytes(payload, torch.uint8, num_blocks * 8 * bits, offset=2 * num_blocks), bits)
    centred = codes.view(num_blocks, LOWBIT_BLOCK).float().sub_((2**bits - 1) / 2)
    blocks = centred.mul_(step.unsqueeze(1))
    if rotated:
        blocks = blocks @ _ROTATION
    return blocks.view(-1)[:numel]


_SHIFTS = {bits: torch.arange(8, dtype=torch.int64) * bits for bits in (2, 3, 4)}
_BYTE_SHIFTS = {bits: torch.arange(bits, dtype=torch.int64) * 8 for bits in (2, 3, 4)}


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8 < 2^bits, a multiple of 8 of them) -> `bits` bytes per 8 codes, little-endian."""
    if bits == 4:  # two per byte: the common case, without 64-bit words
        pairs = codes.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    words = (codes.view(-1, 8).to(torch.int64) << _SHIFTS[bits]).sum(dim=1)
    return ((words.unsqueeze(1) >> _BYTE_SHIFTS[bits]) & 0xFF).to(torch.uint8).view(-1)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)
    words = (packed.view(-1, bits).to(torch.int64) << _BYTE_SHIFTS[bits]).sum(dim=1)
    return ((words.unsqueeze(1) >> _SHIFTS[bits]) & (2**bits - 1)).to(torch.uint8).view(-1)


# raw bytes ----------------------------------------------------------------------------------------
def _to_bytes(flat: torch.Tensor) -> bytes:
    if flat.numel() == 0:
        return b""
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def _from_bytes(buffer: bytes, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A read-only view of `count` values at `offset`: callers must not write into it."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    view = memoryview(buffer)[offset : offset + count * _itemsize(dtype)]
    return _frombuffer(view, dtype)


def _frombuffer(view: memoryview, dtype: torch.dtype) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; every caller copies or computes a new tensor
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype)
