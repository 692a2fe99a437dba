"""Token ids beside a stage's coordinates: what crosses a subspace boundary (model/subspace.py) besides the
k coordinates per token, and how a server reads a request that carries them.

Every request to a stage after the first of a subspace run carries an `ids` tensor next to `inputs`
(forward, backward, forward_backward, evaluate, and the hand-offs `chain` and `evaluate_chain`): the
receiver rebuilds each position's hidden state from E0[its token] and the coordinates, so it needs the
ids of the micro-batch's tokens. They go as labels do (net/protocol.py `encode_labels`): packed at the
fewest bits that hold the vocabulary (11 for 2,048 tokens), which loses nothing.

Compact form (`encode_token_ids` with the labels): samples are windows of one token stream
(data/packing.py), so the token at position t > 0 is the label at t - 1. Where a message also carries the
labels (every hand-off, the last stage's requests) and they name every id but the first, `ids` holds only
position 0 of each sample, (batch, 1), and the receiver reads the rest from the labels: one id per
sample instead of one per token. Otherwise (an ignored label, a relayed forward to a middle stage, which gets
no labels) the whole (batch, seq) goes. Either way the receiver gets exactly the sender's ids.

A server hands its model the coordinates and the ids as one float tensor (batch, seq, k + 1), the ids in
the last column (`pack_token_ids`; exact in fp32 below `config.model.MAX_SUBSPACE_VOCAB`), so request
batching, the graph cache and recomputes treat it as any input; model/subspace.py splits it.
"""

from __future__ import annotations

import torch

from swarmtrain.net import codec
from swarmtrain.net.protocol import (
    LABEL_DTYPES,
    Message,
    ProtocolError,
    StageIO,
    StageRequest,
    checked_label_shape,
    encode_labels,
    validate_request,
)

IDS = "ids"  # the tensor's name in a message


def encode_token_ids(
    token_ids: torch.Tensor, labels: torch.Tensor | None, vocab_size: int
) -> codec.EncodedTensor:
    """The ids of a micro-batch (batch, seq) as sent: position 0 only when `labels` (sent in the same
    message) name the others, else all of them; packed as labels are (`encode_labels`)."""
    token_ids = token_ids.cpu()
    if labels is not None and token_ids.shape[-1] > 1 and torch.equal(token_ids[:, 1:], labels.cpu()[:, :-1]):
        token_ids = token_ids[:, :1]
    return encode_labels(token_ids.contiguous(), vocab_size)


def checked_token_ids(
    desc: codec.EncodedTensor, batch: int, seq: int, vocab_size: int, labels: torch.Tensor | None
) -> torch.Tensor:
    """The (batch, seq) int64 ids a message's `ids` stand for: as they are, or the compact form read
    back with `labels`; every id in [0, vocab_size)."""
    if desc.dtype not in LABEL_DTYPES or len(desc.shape) != 2 or desc.shape[0] != batch:
        raise ProtocolError(
            f"ids must be {'/'.join(LABEL_DTYPES)} of shape [{batch}, {seq}] or [{batch}, 1], got "
            f"{desc.dtype}{list(desc.shape)}"
        )
    if desc.shape[1] != seq and (desc.shape[1] != 1 or labels is None):  # checked before decoding
        raise ProtocolError(f"ids of shape {list(desc.shape)} need shape [{batch}, {seq}] here")
    try:
        ids = codec.decode(desc).long()
    except codec.CodecError as exc:
        raise ProtocolError(f"tensor 'ids': {exc}") from None
    if labels is not None and desc.shape[1] != seq:
        ids = torch.cat((ids, labels.cpu()[:, :-1].long()), dim=1)  # the labels name positions 1..seq-1
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ProtocolError(f"token ids must be in [0, {vocab_size})")
    return ids


def whole_first_inputs(
    inputs: codec.EncodedTensor, labels: codec.EncodedTensor, vocab_size: int
) -> codec.EncodedTensor:
    """Stage 0's inputs as a hand-off carries them beside its labels: the token ids whole, as they are,
    or compact (batch, 1) and returned whole (int64) from the labels, so stage 0 reads them as any other
    request's. A shape that is neither is returned as it is, for the request's own check to refuse. The
    caller has bounded the labels' shape (net/hand_off.py), so decoding them costs what a request may."""
    if len(inputs.shape) != 2 or len(labels.shape) != 2 or inputs.shape[1] != 1 or labels.shape[1] <= 1:
        return inputs
    batch, seq = labels.shape
    checked_label_shape(labels, (inputs.shape[0], seq))
    try:
        decoded = codec.decode(labels).long()
    except codec.CodecError as exc:
        raise ProtocolError(f"tensor 'labels': {exc}") from None
    return codec.encode(checked_token_ids(inputs, batch, seq, vocab_size, decoded), "none")


def pack_token_ids(coords: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq, k) coordinates and (batch, seq) ids -> the (batch, seq, k + 1) inputs a stage's
    model takes after a subspace boundary (model/subspace.split_inputs is the inverse)."""
    return torch.cat((coords, token_ids.to(coords.device, coords.dtype).unsqueeze(-1)), dim=-1)


def ids_of_inputs(inputs: torch.Tensor, is_first: bool) -> torch.Tensor:
    """The token ids of a stage's model inputs: stage 0's inputs themselves, a later stage's last column."""
    return inputs if is_first else inputs[..., -1].long()


def validate_stage_request(
    message: Message, io: StageIO, digest: str, labels: torch.Tensor | None = None
) -> StageRequest:
    """`protocol.validate_request`, and where the stage takes token ids (`io.token_ids`) their check,
    packed into the request's inputs. `labels`: what a hand-off carries on to the last stage, which a
    compact `ids` is read against (the last stage's own requests carry theirs)."""
    if not io.token_ids:
        return validate_request(message, io, digest)
    if IDS not in message.tensors:
        raise ProtocolError(f"a stage after a subspace boundary takes {IDS!r} beside its inputs")
    tensors = {name: t for name, t in message.tensors.items() if name != IDS}
    request = validate_request(Message(message.kind, message.header, tensors), io, digest)
    batch, seq = request.inputs.shape[0], request.inputs.shape[1]
    labels = request.labels if labels is None else labels
    ids = checked_token_ids(message.tensors[IDS], batch, seq, io.vocab_size, labels)
    request.inputs = pack_token_ids(request.inputs, ids)
    return request
