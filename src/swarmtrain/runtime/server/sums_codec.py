"""A step's gradient sums as a replica sends them to its stage peers (`swarm.exchange_compression`), and
as it counts them itself.

Every replica of a stage must add exactly the same tensors, or their parameters drift apart and the
fingerprint check resyncs one of them (runtime/server/stage_sync.py). A compressed exchange keeps that:
a replica encodes its sums once, sends those bytes to every peer, and counts its own contribution as
the decoding of the same bytes, which is what every peer decodes. Rounding is to nearest (never
stochastic), so the decoding depends on the bytes alone.

What the rounding drops is not lost: it is kept here and added to the next step's sums before they are
encoded (error feedback, as 1-bit SGD and PowerSGD do), so over a run the sums a replica contributed
add up to its true sums to within one step's rounding. The kept part belongs to this replica alone (a
resync that replaces its parameters keeps it: it is a gradient not yet sent, not state); a replica with
another codec, or none, still adds what every other adds.

Why: on a slow link the exchange is the stage's bottleneck. `tiny`'s stage of two blocks sends
~1 MB of fp32 sums to each peer per step, ~2 s at 4 Mbit/s; blockwise 8-bit sends ~0.26 MB (docs/LOG.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from swarmtrain.config.run import EXCHANGE_COMPRESSION_CHOICES
from swarmtrain.net import codec


class WireSums:
    """One step's sums: `tensors` what every replica counts (the decoding of `encoded`), `encoded`
    what goes on the wire. Iterating gives `tensors`. Uncompressed sums are encoded when first sent:
    a replica alone in its stage sends nothing, and a big stage's fp32 bytes are a copy of its
    gradients."""

    def __init__(self, tensors: list[torch.Tensor], encoded: list[codec.EncodedTensor] | None = None) -> None:
        self.tensors = tensors
        self._encoded = encoded

    @property
    def encoded(self) -> list[codec.EncodedTensor]:
        if self._encoded is None:
            self._encoded = [codec.encode(t, "none") for t in self.tensors]
        return self._encoded

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class SumsCodec:
    """Encodes a replica's sums for its stage peers, keeping what the rounding dropped for the next."""

    def __init__(self, codec_name: str = "none") -> None:
        if codec_name not in EXCHANGE_COMPRESSION_CHOICES:
            raise ValueError(
                f"exchange compression must be one of {', '.join(EXCHANGE_COMPRESSION_CHOICES)}, "
                f"got {codec_name!r}"
            )
        self.codec_name = codec_name
        self.residual: list[torch.Tensor] | None = None  # what the last encodings dropped

    def encode(self, sums: list[torch.Tensor]) -> WireSums:
        """The sums plus what earlier encodings dropped, encoded; keeps what this encoding drops."""
        if self.codec_name == "none":
            return WireSums(list(sums))
        if self.residual is not None and _same_shapes(self.residual, sums):
            corrected = [t + r for t, r in zip(sums, self.residual, strict=True)]
        else:
            corrected = list(sums)
        encoded = [codec.encode(t, self.codec_name if _finite(t) else "none") for t in corrected]
        # decoded where the sums are (the compute device): what the peers decode, the same values
        decoded = [codec.decode(e, t.device) for e, t in zip(encoded, corrected, strict=True)]
        # a non-finite sum (a faulty step) goes as it is, so every replica sees it and skips the step
        # alike (runtime/server/stage_worker.py); nothing of it is carried forward
        self.residual = [
            torch.nan_to_num(c - d, nan=0.0, posinf=0.0, neginf=0.0)
            for c, d in zip(corrected, decoded, strict=True)
        ]
        return WireSums(decoded, encoded)


def _same_shapes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b, strict=True))


def _finite(tensor: torch.Tensor) -> bool:
    """8-bit blocks of a non-finite tensor carry non-finite scales, which a peer refuses to decode."""
    return bool(torch.isfinite(tensor).all())
