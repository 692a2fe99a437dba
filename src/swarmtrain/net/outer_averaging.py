"""Averaging DiLoCo pseudo-gradients between whole-model replicas over hivemind's all-reduce.

hivemind's `DecentralizedAverager` does what a rare outer step needs: matchmaking among whoever is
at the round's end, a butterfly all-reduce weighted per peer (by samples), compression on the wire,
an all-gather of small metadata (each member's outer step and parameter fingerprint), and serving
the state to joiners (`StageAverager.download_state`). What this wrapper adds:
- the group size target follows the live replicas (hivemind fixes it at construction, in its
  child process): a group that has everyone starts at once instead of waiting out matchmaking;
- the 8-bit codec works under numpy 2 (hivemind's uniform 8-bit fails there: `int()` of a
  one-element array), registered before the averager forks so both sides use it;
- failures come back as `None` (the caller then applies its own pseudo-gradient alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import Float16Compression, NoCompression
from hivemind.compression.quantization import Uniform8BitQuantization
from hivemind.utils.mpfuture import MPFuture

from swarmtrain.net.averaging import StageAverager, StateProvider
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# bytes per element on the wire, for accounting (8-bit adds a 256-entry fp32 codebook per part)
WIRE_BYTES_PER_ELEMENT = {"none": 4.0, "float16": 2.0, "8bit": 1.0}
CHUNK_TIMEOUT_S = 15.0


class _Uniform8Bit(Uniform8BitQuantization):
    """hivemind's uniform 8-bit codec with the one line that numpy 2 rejects fixed."""

    def extract(self, serialized_tensor):
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(
            serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype
        )
        quantized = np.frombuffer(
            serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype
        )
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


def _codec(name: str):
    if name == "float16":
        return Float16Compression()
    if name == "8bit":
        from hivemind.compression import serialization

        # deserialization looks the codec up in this table by its type, in every process
        serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = _Uniform8Bit()
        return _Uniform8Bit()
    return NoCompression()


@dataclass(frozen=True)
class RoundResult:
    averaged: list[torch.Tensor]
    gathered: dict[str, dict]  # peer id -> the metadata it sent (outer step, fingerprint, samples)
    group_size: int


class OuterAverager(StageAverager):
    """All-reduces pseudo-gradients (weighted by samples) and shares the outer state with joiners."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        state_provider: StateProvider,
        compression: str,
        matchmaking_time_s: float,
        allreduce_timeout_s: float,
    ) -> None:
        codec = _codec(compression)
        super().__init__(
            tensors,
            dht,
            prefix=prefix,
            state_provider=state_provider,
            min_matchmaking_time_s=matchmaking_time_s,
            request_timeout_s=min(1.0, matchmaking_time_s / 2),
            allreduce_timeout_s=allreduce_timeout_s,
            compression=codec,
            state_compression=NoCompression(),
            # a whole model per round: parts take longer than a stage's small exchanges, and a chunk
            # timed out leaves that part un-averaged on some members (seen with 8-bit on 2 busy cores)
            next_chunk_timeout=CHUNK_TIMEOUT_S,
        )

    def set_group_target(self, size: int) -> None:
        """Form groups of up to `size` (the live replicas): a full group starts at once."""
        future = MPFuture()
        self._outer_pipe.send(("_set_group_target", [], dict(size=max(2, size), future=future)))
        future.result(timeout=10)

    async def _set_group_target(self, size: int, future: MPFuture) -> None:
        # runs in the averager's process, where the matchmaking object lives
        try:
            self._matchmaking.target_group_size = size
            self._matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)
        except Exception as exc:  # report to the caller, never kill the averager's loop
            future.set_exception(exc)

    def average(
        self, tensors: Sequence[torch.Tensor], weight: float, gather: dict, timeout_s: float
    ) -> RoundResult | None:
        """One round with whoever arrives within `timeout_s`; None when no group formed or it failed."""
        with self.get_tensors() as local:
            for buffer, tensor in zip(local, tensors, strict=True):
                buffer.copy_(tensor)
        try:
            gathered = self.step(weight=float(weight), gather=gather, timeout=timeout_s, allow_retries=False)
        except Exception as exc:  # matchmaking or all-reduce failures arrive as various exceptions
            logger.info("outer averaging round failed: %r", exc)
            return None
        if not gathered:
            return None
        with self.get_tensors() as local:
            averaged = [t.clone() for t in local]
        members = {str(peer): (data if isinstance(data, dict) else {}) for peer, data in gathered.items()}
        return RoundResult(averaged=averaged, gathered=members, group_size=len(members))
