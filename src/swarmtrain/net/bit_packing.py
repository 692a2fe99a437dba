"""Non-negative integers packed at a given width: the lossless `bits{N}` codec of net/codec.py, which
token ids and labels cross stage boundaries in (11 bits for a 2,048-token vocabulary instead of int16's
16, 17 for Llama 3's 128,256 instead of int32's 32).

Value i of a tensor occupies bits [i N, (i + 1) N) of one bit stream, least significant bit first, and
bit j of the stream is bit j mod 8 of byte j div 8; the last byte is padded with zero bits. Vectorized
torch on the values' device, no Python loop over values.
"""

from __future__ import annotations

import torch

MAX_BITS = 32  # the widest value packed (a vocabulary of up to 2^32 tokens)


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` values of `bits` bits take."""
    return -(-count * bits // 8)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat integer `values`, each in [0, 2^bits) (the caller checks), as uint8 bytes of the bit stream."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.view(-1, 1).to(torch.int64) >> shifts) & 1).to(torch.uint8).view(-1)
    stream = torch.cat((stream, stream.new_zeros(-stream.numel() % 8)))
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=values.device)
    return (stream.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(payload: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values of `bits` bits of a uint8 bit stream, as int64."""
    shifts = torch.arange(8, device=payload.device, dtype=torch.uint8)
    stream = ((payload.view(-1, 1) >> shifts) & 1).view(-1)[: count * bits]
    weights = torch.arange(bits, device=payload.device)
    return (stream.view(count, bits).to(torch.int64) << weights).sum(dim=1)
