"""Non-negative integers packed at a given width: the lossless `bits{N}` codec of net/codec.py, which
token ids and labels cross stage boundaries in (11 bits for a 2,048-token vocabulary instead of int16's
16, 17 for Llama 3's 128,256 instead of int32's 32).

Value i of a tensor occupies bits [i N, (i + 1) N) of one bit stream, least significant bit first, and
bit j of the stream is bit j mod 8 of byte j div 8; the last byte is padded with zero bits. Vectorized
torch on the values' device: a loop over bit positions, none over values.
"""

from __future__ import annotations

import torch

MAX_BITS = 32  # the widest value packed (a vocabulary of up to 2^32 tokens)


def packed_size(count: int, bits: int) -> int:
    """Bytes that `count` values of `bits` bits take."""
    return -(-count * bits // 8)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat integer `values`, each in [0, 2^bits) (the caller checks), as uint8 bytes of the bit stream.
    One pass per bit position, so the working memory is a byte per bit of the stream."""
    flat = values.view(-1).to(torch.int64)
    stream = torch.zeros(flat.numel() * bits + 7, dtype=torch.uint8, device=values.device)
    for bit in range(bits):
        stream[bit : flat.numel() * bits : bits] = (flat >> bit) & 1
    packed = torch.zeros(len(stream) // 8, dtype=torch.uint8, device=values.device)
    for bit in range(8):
        packed |= stream[bit : len(packed) * 8 : 8] << bit
    return packed


def unpack_bits(payload: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values of `bits` bits of a uint8 bit stream, as int64. One pass per bit
    position: besides the result, a byte per bit of the stream (a peer's payload is not multiplied
    by 64, as whole int64 bit planes would)."""
    stream = torch.empty(payload.numel() * 8, dtype=torch.uint8, device=payload.device)
    for bit in range(8):
        stream[bit::8] = (payload >> bit) & 1
    values = torch.zeros(count, dtype=torch.int64, device=payload.device)
    for bit in range(bits):
        values |= stream[bit : count * bits : bits].to(torch.int64) << bit
    return values
