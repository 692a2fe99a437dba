"""How a stage server's results become messages: the sending half of the overlap with compute on CUDA.

On CPU a result is encoded where it is and its message is complete when the compute thread returns it,
as always. On CUDA a reply may leave the compute thread before its bytes exist: each tensor is encoded on
a side stream after an event recorded on the compute stream, and its payload's copy to a pinned host
buffer is started there (net/codec.encode_behind, net/device_bytes.py), so the compute thread takes its
next job at once instead of waiting for the download. Such a reply is a `PendingReply`; `finished()`
waits for each copy's event (that copy alone, never the whole device) and gives the `Message` to send,
byte for byte the one `make_message` makes. It runs on the stage's send thread (the compute thread's
`finish`, runtime/server/compute.py), before the reply's caller sees it. A `PendingReply` is not a
`Message`: packing one fails (its tensors have no payload yet) instead of sending a message without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swarmtrain.model.device import ComputeDevice
from swarmtrain.net import codec
from swarmtrain.net.protocol import GRADIENT_TENSORS, Message, make_message


@dataclass
class PendingReply:
    """A result whose tensors' payloads (`codec.PendingTensor`, in the message's order) are still being
    copied to the host."""

    kind: str
    header: dict
    tensors: dict[str, codec.EncodedTensor | codec.PendingTensor]

    def finished(self) -> Message:
        """The message to send, once every payload's copy has run (waits for those copies only)."""
        return Message(self.kind, self.header, {name: _done(t) for name, t in self.tensors.items()})


Reply = Message | PendingReply  # what the compute thread returns for a request


@dataclass(frozen=True)
class Replies:
    """A stage's results as messages: `compute.wire` of each tensor (fp32, where it was computed), then
    encoded in the request's codec. `overlap`: leave a CUDA result's payload copying (a `PendingReply`)
    for the send thread to finish; a stage server on CUDA sets it, together with its compute thread's
    `finish` (runtime/server/stage_service.py)."""

    compute: ComputeDevice
    overlap: bool = False

    def result(self, header: dict, tensors: dict[str, torch.Tensor], codec_name: str) -> Reply:
        wired = {name: self.compute.wire(t) for name, t in tensors.items()}
        if not self.overlap:
            return make_message("result", header, wired, codec_name)
        encoded = {
            name: codec.encode_behind(t, codec_name, stochastic=name in GRADIENT_TENSORS)
            for name, t in wired.items()
        }
        if any(isinstance(t, codec.PendingTensor) for t in encoded.values()):
            return PendingReply("result", dict(header), encoded)
        return Message("result", dict(header), {name: _done(t) for name, t in encoded.items()})


def finished(outcome: Any) -> Any:
    """A compute job's outcome as its caller gets it: a `PendingReply` finished, anything else as it is."""
    return outcome.finished() if isinstance(outcome, PendingReply) else outcome


def _done(tensor: codec.EncodedTensor | codec.PendingTensor) -> codec.EncodedTensor:
    return tensor.result() if isinstance(tensor, codec.PendingTensor) else tensor
