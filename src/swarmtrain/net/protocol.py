"""Wire messages between trainers and stage servers, and the strict checks a server applies to them.

A message is one byte string: magic, a length-prefixed JSON header, then the tensor payloads.
The header names the message kind, the micro-batch id, the stage, the config digest, the protocol
version and one descriptor per tensor (name, codec, dtype, shape, payload bytes). The trainer and
the server share only this module (docs/DESIGN.md section 3).

Validation never trusts the sender: sizes are checked against the descriptors before anything is
allocated, shapes and dtypes against what the stage expects, token ids against the vocabulary and
floats for NaN/inf and magnitudes beyond `MAX_ABS_VALUE`. Every violation raises `ProtocolError` with
a message the server sends back as an error answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field

import torch

from swarmtrain.config import RunConfig
from swarmtrain.config.model import SUBSPACE, ModelConfig, StageSpec, token_id_bits, token_id_bytes
from swarmtrain.net import codec


def namespace(cfg: RunConfig) -> str:
    """RPC handler namespace: run and config digest, so runs never cross on a shared daemon (servers
    register under it, trainers and probes call it)."""
    return f"{cfg.swarm.run_id}_{cfg.digest()}"


# 2: requests carry their global step; 3: forward_backward, evaluate kinds (were flags on forward); 4:
# chain (net/hand_off.py); 5: bundle (net/bundle.py); 6: stage 0's ids int16, compact beside a chain's
# labels, which a server of 5 refuses (net/token_ids.py `whole_first_inputs`); 7: ids and labels packed
# at the vocabulary's width (codec `bits{N}`, net/bit_packing.py), an unknown codec to a peer of 6
PROTOCOL_VERSION = 7
MAGIC = b"SWT1"
MAX_HEADER_BYTES = 64 * 1024
MAX_ID_CHARS = 128
MAX_TENSORS = 1024  # info replies carry one tensor per parameter
# Largest |value| a stage accepts in hidden states or gradients. A healthy residual stream or gradient
# of this model family is many orders of magnitude below it, while a finite but absurd value (hidden
# states of 1e20, gradients of 3e38: finite in fp32) overflows inside the stage and made its parameters
# and replicas non-finite. It bounds decoded values: the 8-bit codec's fp32 block scales carry any
# finite fp32 magnitude, and only the float16 codec overflows (to inf, which the NaN/inf check catches)
# at 65504, so the wire format itself bounds nothing.
MAX_ABS_VALUE = 1e6


@dataclass(frozen=True)
class Kind:
    """What a message kind is: every set of kinds the code uses is derived from `KIND_TABLE`."""

    request: bool = True  # sent to a handler (False: an answer)
    stream: bool = False  # sent in chunks over a libp2p stream (large); else one unary call
    micro_batch: bool = False  # one micro-batch through one stage, sent by a trainer (`StageRequest`)
    trains: bool = False  # its samples count toward a step (the stage's CPU for them is capacity)
    accumulates: bool = False  # the call that accumulates the stage's gradients of a micro-batch
    hand_off: bool = False  # handed by a server to the next stage, alone or in a bundle
    direct: bool = False  # accepted on the data plane (net/data_plane.py): hand-offs and bundles


# forward/backward: a training micro-batch through a stage (not the last); forward_backward: through
# the last stage, loss and backward in one call; evaluate: forward only, any stage, nothing kept;
# chain: a micro-batch handed from server to server along a route (net/hand_off.py); evaluate_chain: a
# validation micro-batch handed along a route the same way, forward only (the last hop takes `evaluate`,
# so a server that accepts no inbound connection validates as it trains); bundle: several
# hand-off messages to one peer, and their answers, as one message (net/bundle.py); grads: one
# replica's gradient sums of a step, sent to its stage peers; step_means: a stage replica that missed
# a step asks a peer for the mean gradients it applied; round_mean: a whole-model replica asks a member
# of its last outer round for that round's mean (to fill what a partial all-reduce left out); info:
# counters and state for probes and monitors; ping: is the server's event loop alive (answered there at
# once, never queued behind the compute thread), which tells a frozen peer (SIGSTOP, a partition: its
# sockets stay open, nothing answers) from a busy one; close: a trainer tells a stage's replicas that a
# step's micro-batches are all done (and who accumulated them)
KIND_TABLE: dict[str, Kind] = {
    "forward": Kind(stream=True, micro_batch=True, trains=True),
    "backward": Kind(stream=True, micro_batch=True, trains=True, accumulates=True),
    "forward_backward": Kind(
        stream=True, micro_batch=True, trains=True, accumulates=True, hand_off=True, direct=True
    ),
    "evaluate": Kind(stream=True, micro_batch=True, hand_off=True, direct=True),
    "chain": Kind(stream=True, trains=True, hand_off=True, direct=True),
    "evaluate_chain": Kind(stream=True, hand_off=True, direct=True),
    "bundle": Kind(stream=True, direct=True),
    "grads": Kind(stream=True),
    "step_means": Kind(stream=True),
    "round_mean": Kind(stream=True),
    "info": Kind(),
    "ping": Kind(),
    "close": Kind(),
    "result": Kind(request=False),
    "error": Kind(request=False),
}


def kinds_where(**flags: bool) -> tuple[str, ...]:
    """The kinds of `KIND_TABLE` whose flags have the given values, in table order."""
    return tuple(
        name for name, kind in KIND_TABLE.items() if all(getattr(kind, f) == v for f, v in flags.items())
    )


KINDS = tuple(KIND_TABLE)
MICRO_BATCH_KINDS = kinds_where(micro_batch=True)  # forward, backward, forward_backward, evaluate
TRAINING_KINDS = kinds_where(trains=True)  # forward, backward, forward_backward, chain
ACCUMULATING_KINDS = kinds_where(accumulates=True)  # backward, forward_backward
HAND_OFF_KINDS = kinds_where(hand_off=True)  # what a bundle carries: forward_backward, chain and evaluations
DIRECT_KINDS = kinds_where(direct=True)  # the hand-off kinds and bundle
STREAM_KINDS = kinds_where(request=True, stream=True)
UNARY_KINDS = kinds_where(request=True, stream=False)  # info, ping, close
REPLY_KINDS = kinds_where(request=False)  # result, error
BUNDLE_KIND = "bundle"
MAX_STEP = 2**53
_LEN = struct.Struct("<I")
_VIEWED_BYTES = 1 << 16  # a received payload this large stays a view of its message's bytes


class ProtocolError(ValueError):
    """A malformed or unacceptable message; `code` is sent back with the error answer."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Message:
    kind: str
    header: dict = field(default_factory=dict)
    tensors: dict[str, codec.EncodedTensor] = field(default_factory=dict)

    def tensor(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        try:  # decoded on `device` (None: the host)
            return codec.decode(self.tensors[name], device)
        except codec.CodecError as exc:
            raise ProtocolError(f"tensor {name!r}: {exc}") from None

    def fp32_equivalent_bytes(self) -> int:
        """Size of this message if every float tensor were sent as fp32 (same header and descriptors)."""
        empty = {name: dataclasses.replace(t, payload=b"") for name, t in self.tensors.items()}
        return len(pack(Message(self.kind, self.header, empty))) + sum(
            t.fp32_equivalent_bytes() for t in self.tensors.values()
        )


# tensors that carry gradients back along the pipeline: stochastically rounded by the codecs below 8
# bits, so their rounding error averages out over a step's micro-batches instead of biasing it
GRADIENT_TENSORS = frozenset({"grad_inputs", "grad_outputs"})


def encode_tensor(name: str, tensor: torch.Tensor, codec_name: str) -> codec.EncodedTensor:
    return codec.encode(tensor, codec_name, stochastic=name in GRADIENT_TENSORS)


def make_message(
    kind: str, header: dict, tensors: dict[str, torch.Tensor], codec_name: str = "none"
) -> Message:
    encoded = {name: encode_tensor(name, t, codec_name) for name, t in tensors.items()}
    return Message(kind, dict(header), encoded)


def request_message(
    kind: str,
    micro_batch_id: str,
    stage: int,
    digest: str,
    codec_name: str,
    tensors: dict[str, torch.Tensor | codec.EncodedTensor],
    **extra,
) -> Message:
    """A forward/backward request. Already-encoded tensors (e.g. a previous stage's output) are
    relayed as they are: no decode/re-encode on the trainer, no double quantization."""
    encoded = {
        name: t if isinstance(t, codec.EncodedTensor) else encode_tensor(name, t, codec_name)
        for name, t in tensors.items()
    }
    header = {"mb": micro_batch_id, "stage": stage, "digest": digest, "codec": codec_name, **extra}
    return Message(kind, header, encoded)


def ping_message(stage: int, digest: str) -> Message:
    return Message("ping", {"stage": stage, "digest": digest})


def error_message(text: str, code: str = "bad_request") -> Message:
    return Message("error", {"error": text[:2000], "code": code})


# bytes <-> Message --------------------------------------------------------------------------------
def pack(message: Message) -> bytes:
    return b"".join(pack_parts(message))


def pack_parts(message: Message) -> list[codec.Buffer]:
    """`pack`'s bytes in their parts (the header, each payload), not joined: the data plane's seal reads
    them in turn (net/secure_link.py)."""
    descriptors = [
        [name, t.codec, t.dtype, list(t.shape), len(t.payload)] for name, t in message.tensors.items()
    ]
    header = dict(message.header, kind=message.kind, v=PROTOCOL_VERSION, tensors=descriptors)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + _LEN.pack(len(header_bytes)) + header_bytes
    return [head, *(t.payload for t in message.tensors.values())]


def unpack(data: codec.Buffer, max_bytes: int) -> Message:
    """Parse bytes into a Message; raises ProtocolError on anything malformed or over `max_bytes`. Large
    payloads are views of `data` (the data plane's frame buffer, owned by this message), small ones
    copies: a kept label or step number does not hold a frame's megabytes."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}", "too_large")
    if len(data) < len(MAGIC) + _LEN.size or data[: len(MAGIC)] != MAGIC:
        raise ProtocolError("not a swarmtrain message (bad magic)")
    (header_len,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if header_len > MAX_HEADER_BYTES or start + header_len > len(data):
        raise ProtocolError(f"bad header length {header_len}")
    try:
        header = json.loads(bytes(data[start : start + header_len]))
    except RecursionError:
        raise ProtocolError("header nests too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer beyond Python's 4,300-digit limit
        raise ProtocolError(f"header is not acceptable JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    if header.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version mismatch (this peer speaks {PROTOCOL_VERSION})", "version")
    kind = header.pop("kind", None)
    if not _one_of(kind, KINDS):
        raise ProtocolError(f"unknown message kind {kind!r}")
    tensors = _parse_tensors(header.pop("tensors", []), data, start + header_len)
    return Message(kind, header, tensors)


def _parse_tensors(descriptors, data: codec.Buffer, offset: int) -> dict[str, codec.EncodedTensor]:
    if not isinstance(descriptors, list) or len(descriptors) > MAX_TENSORS:
        raise ProtocolError(f"tensor descriptors must be a list of at most {MAX_TENSORS} entries")
    view = memoryview(data)
    tensors: dict[str, codec.EncodedTensor] = {}
    for entry in descriptors:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise ProtocolError("bad tensor descriptor")
        name, codec_name, dtype, shape, nbytes = entry
        if not isinstance(name, str) or name in tensors or not isinstance(nbytes, int) or nbytes < 0:
            raise ProtocolError(f"bad tensor descriptor {entry!r:.200}")
        if not (
            isinstance(shape, list) and len(shape) <= 8 and all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ProtocolError(f"tensor {name!r}: bad shape {shape!r:.200}")
        if not (_one_of(codec_name, codec.WIRE_CODECS) and _one_of(dtype, codec.DTYPES)):
            raise ProtocolError(f"tensor {name!r}: unknown codec {codec_name!r} or dtype {dtype!r}")
        expected = codec.payload_size(codec_name, codec.DTYPES[dtype], _numel(shape))
        if nbytes != expected:
            raise ProtocolError(f"tensor {name!r}: {nbytes} payload bytes, expected {expected}")
        if offset + nbytes > len(data):
            raise ProtocolError(f"tensor {name!r}: payload truncated")
        payload = view[offset : offset + nbytes]
        tensors[name] = codec.EncodedTensor(
            codec_name, dtype, tuple(shape), payload if nbytes >= _VIEWED_BYTES else bytes(payload)
        )
        offset += nbytes
    if offset != len(data):
        raise ProtocolError(f"{len(data) - offset} trailing bytes after the last tensor")
    return tensors


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


# what a stage accepts -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StageIO:
    """Shapes and dtypes one stage accepts; built from the run's model config and the stage spec."""

    stage: int
    is_first: bool
    is_last: bool
    wire_dim: int  # hidden values per token between stages: d_model, or boundary_dim with boundary layers
    seq_len: int
    vocab_size: int
    max_batch: int
    ignore_label: int = -100
    device: torch.device | None = None  # where float tensors are decoded (net/device_bytes.py); None: host
    subspace: bool = False  # subspace boundaries: hops to later stages carry token ids (net/token_ids.py)

    @classmethod
    def from_config(
        cls, model: ModelConfig, spec: StageSpec, max_batch: int, device: torch.device | None = None
    ) -> StageIO:
        return cls(spec.index, spec.is_first, spec.is_last, model.wire_dim, model.seq_len, model.vocab_size,
                   max_batch, model.pad_token_id, device, model.boundary == SUBSPACE)  # fmt: skip

    @property
    def token_ids(self) -> bool:
        """Whether this stage's requests carry token ids: after a subspace boundary."""
        return self.subspace and not self.is_first

    def max_message_bytes(self) -> int:
        """Largest legal request: fp32 input + fp32 grad + int64 labels (+ int32 token ids after a subspace
        boundary) of a full batch, plus slack."""
        values = self.max_batch * self.seq_len
        return values * (2 * 4 * self.wire_dim + 8 + 4 * self.token_ids) + MAX_HEADER_BYTES + 4096


@dataclass
class StageRequest:
    """A validated forward or backward request, tensors decoded (float ones on the stage's device)."""

    kind: str
    micro_batch_id: str
    codec: str
    inputs: torch.Tensor
    labels: torch.Tensor | None = None
    grad_outputs: torch.Tensor | None = None
    # False on a retry whose first attempt may have been applied by a replica that went silent: the
    # input gradient is returned but the parameter gradient is not accumulated (at most once per stage)
    accumulate: bool = True
    # the global step (optimizer step of every stage) this micro-batch's gradient belongs to; for an
    # evaluation, the step whose parameters it must see (None: the current ones)
    step: int | None = None
    origin: str = ""  # the trainer whose micro-batch it is ("": unknown; planner/step_decision.py)

    @property
    def num_samples(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def evaluate(self) -> bool:
        """Forward only: no cached graph, no gradient."""
        return self.kind == "evaluate"

    @property
    def fused_backward(self) -> bool:
        """The last stage's forward, loss and backward in one call."""
        return self.kind == "forward_backward"


def validate_request(message: Message, io: StageIO, digest: str) -> StageRequest:
    """Check a forward/backward request against this stage; raise ProtocolError with the reason."""
    header = message.header
    kind = message.kind
    if kind not in MICRO_BATCH_KINDS:
        raise ProtocolError(f"expected a micro-batch request ({', '.join(MICRO_BATCH_KINDS)}), got {kind!r}")
    if io.is_last and kind in ("forward", "backward"):
        raise ProtocolError(f"the last stage takes forward_backward (training) or evaluate, not {kind}")
    if not io.is_last and kind == "forward_backward":
        raise ProtocolError("forward_backward is for the last stage; this stage takes forward, then backward")
    if header.get("digest") != digest:
        raise ProtocolError(
            f"config digest mismatch: this server runs {digest}, the request has {header.get('digest')!r} "
            "(different model, stage cut, optimizer settings or codec below 8 bits); refusing",
            "digest_mismatch",
        )
    if not (_is_int(header.get("stage")) and header["stage"] == io.stage):
        raise ProtocolError(f"this server hosts stage {io.stage}, the request is for {header.get('stage')!r}")
    mb_id = header.get("mb")
    if not isinstance(mb_id, str) or not 0 < len(mb_id) <= MAX_ID_CHARS:
        raise ProtocolError("missing or bad micro-batch id")
    codec_name = header.get("codec", "none")
    if not _one_of(codec_name, codec.CODECS):
        raise ProtocolError(f"unknown codec {codec_name!r}")
    expected = {"inputs"} | ({"labels"} if io.is_last else set())
    expected |= {"grad_outputs"} if message.kind == "backward" else set()
    if set(message.tensors) != expected:
        raise ProtocolError(f"expected tensors {sorted(expected)}, got {sorted(message.tensors)}")
    inputs = _checked_inputs(message, io)
    batch, seq = inputs.shape[0], inputs.shape[1]
    evaluate = kind == "evaluate"
    request = StageRequest(
        kind,
        mb_id,
        codec_name,
        inputs,
        accumulate=header_flag(header, "accumulate", True),
        step=_checked_step(header, required=not evaluate),
    )
    if io.is_last:
        request.labels = _checked_labels(message, io, batch, seq)
    if message.kind == "backward":
        request.grad_outputs = _checked_float(message, "grad_outputs", (batch, seq, io.wire_dim), io.device)
    return request


def header_flag(header: dict, name: str, default: bool) -> bool:
    """A yes/no header field: JSON true or false only (read by truthiness, "no" would count as yes)."""
    value = header.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"header field {name!r} must be true or false, got {value!r:.40}")
    return value


def _checked_step(header: dict, required: bool) -> int | None:
    step = header.get("step")
    if step is None and not required:
        return None
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        raise ProtocolError(f"training requests carry the global step as an integer >= 0, got {step!r}")
    return step


def _checked_inputs(message: Message, io: StageIO) -> torch.Tensor:
    desc = message.tensors["inputs"]
    if io.is_first:
        check_batch_shape("inputs", desc.shape, 2, io)
        if desc.dtype not in LABEL_DTYPES:
            raise ProtocolError(f"stage 0 takes token ids ({'/'.join(LABEL_DTYPES)}), got {desc.dtype}")
        tokens = message.tensor("inputs").long()
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= io.vocab_size):
            raise ProtocolError(f"token ids must be in [0, {io.vocab_size})")
        return tokens
    check_batch_shape("inputs", desc.shape, 3, io)
    return _checked_float(message, "inputs", tuple(desc.shape), io.device)


def check_batch_shape(name: str, shape: tuple[int, ...], ndim: int, io: StageIO) -> None:
    """`name`'s shape from its descriptor, before anything decodes it (a packed width decodes to more
    memory than its bytes): `ndim` dimensions, (batch, sequence) within the stage's limits, wire width."""
    if len(shape) != ndim:
        raise ProtocolError(f"{name} must have {ndim} dimensions, got shape {list(shape)}")
    if not 1 <= shape[0] <= io.max_batch:
        raise ProtocolError(f"{name}: batch size {shape[0]} outside 1..{io.max_batch}")
    if not 1 <= shape[1] <= io.seq_len:
        raise ProtocolError(f"{name}: sequence length {shape[1]} outside 1..{io.seq_len}")
    if ndim == 3 and shape[2] != io.wire_dim:
        raise ProtocolError(f"hidden size {shape[2]} != {io.wire_dim} (values per token between stages)")


def _checked_float(
    message: Message, name: str, shape: tuple[int, ...], device: torch.device | None = None
) -> torch.Tensor:
    """A float tensor of `shape`, decoded on `device` (None: the host) and checked: finite, bounded."""
    desc = message.tensors[name]
    if tuple(desc.shape) != tuple(shape):
        raise ProtocolError(f"{name} must have shape {list(shape)}, got {list(desc.shape)}")
    if not codec.DTYPES[desc.dtype].is_floating_point:
        raise ProtocolError(f"{name} must be floating point, got {desc.dtype}")
    tensor = message.tensor(name, device).float()
    checked_values(name, desc, tensor)
    return tensor


def checked_values(name: str, desc: codec.EncodedTensor, tensor: torch.Tensor) -> None:
    """Refuse NaN, inf and |values| over `MAX_ABS_VALUE` in `tensor`, the decoding of `desc`: settled by
    the block scales of a scaled codec (`codec.magnitude_bound`, on the host: nothing decoded or waited
    for), else by one pass on the values' device whose two extremes come back (NaN and inf show there)."""
    bound = codec.magnitude_bound(desc)
    if (bound is not None and bound <= MAX_ABS_VALUE) or tensor.numel() == 0:
        return
    low, high = (float(v) for v in torch.stack(torch.aminmax(tensor)).cpu())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ProtocolError(f"{name} contains NaN or inf")
    largest = max(-low, high)
    if largest > MAX_ABS_VALUE:
        raise ProtocolError(f"{name} has |value| up to {largest:.3g}, beyond the bound of {MAX_ABS_VALUE:g}")


def checked_grad_reply(
    reply: Message, batch_seq: tuple[int, int], wire_dim: int, device: torch.device | None = None
) -> torch.Tensor:
    """The gradient of a stage's outputs, as the next stage's reply carries it (a direct hand-off),
    decoded on `device`."""
    if "grad_inputs" not in reply.tensors:
        raise ProtocolError("the next stage's reply carries no grad_inputs")
    return _checked_float(reply, "grad_inputs", (*batch_seq, wire_dim), device)


LABEL_DTYPES = ("int16", "int32", "int64")


def encode_labels(labels: torch.Tensor, vocab_size: int) -> codec.EncodedTensor:
    """Labels or token ids as sent (they cross every boundary of a hand-off): `token_id_bits` each, packed
    in int16 (int32 for a vocabulary over 32,767), which an ignored label (-100) makes go unpacked."""
    narrow = labels.to(torch.int16 if token_id_bytes(vocab_size) == 2 else torch.int32)
    return codec.encode_ints(narrow, token_id_bits(vocab_size))


def checked_label_shape(desc: codec.EncodedTensor, shape: tuple[int, ...]) -> None:
    if desc.dtype not in LABEL_DTYPES or tuple(desc.shape) != shape:
        raise ProtocolError(
            f"labels must be {'/'.join(LABEL_DTYPES)} of shape {list(shape)}, got {desc.dtype}{list(desc.shape)}"
        )


def _checked_labels(message: Message, io: StageIO, batch: int, seq: int) -> torch.Tensor:
    checked_label_shape(message.tensors["labels"], (batch, seq))
    labels = message.tensor("labels").long()
    valid = (labels == io.ignore_label) | ((labels >= 0) & (labels < io.vocab_size))
    if not bool(valid.all()):
        raise ProtocolError(f"labels must be in [0, {io.vocab_size}) or {io.ignore_label}")
    return labels


# messages between a trainer and a stage's replicas about a step ------------------------------------
MAX_REPLICAS = 4096


def close_message(step: int, stage: int, digest: str, shard: int, shard_count: int, members, participants):
    header = {
        "step": step,
        "stage": stage,
        "digest": digest,
        "shard": shard,
        "shards": shard_count,
        "members": dict(members),
        "participants": sorted(participants),
    }
    return Message("close", header)


def validate_close(message: Message, stage: int, digest: str) -> dict:
    """A trainer's `close` of a step: keyword arguments for `StepInbox.on_close`. Its fields only:
    whether the step, the members and their counts agree with the stage is for the step coordinator
    (runtime/server/stage_steps.py), which knows the stage's state and live replicas."""
    header = _checked_step_header(message, stage, digest)
    shard, shards = header.get("shard"), header.get("shards")
    if not (_is_int(shard) and _is_int(shards) and 0 <= shard < shards <= MAX_REPLICAS):
        raise ProtocolError(f"bad shard {shard!r} of {shards!r}")
    members, participants = header.get("members"), header.get("participants")
    if not isinstance(members, dict) or len(members) > MAX_REPLICAS:
        raise ProtocolError("members must be an object of peer id -> samples")
    if not all(_is_peer_id(p) and _is_int(n) and 0 <= n < MAX_STEP for p, n in members.items()):
        raise ProtocolError("members must map peer ids to sample counts >= 0")
    if not isinstance(participants, list) or len(participants) > MAX_REPLICAS:
        raise ProtocolError("participants must be a list of peer ids")
    if not all(_is_peer_id(p) for p in participants):
        raise ProtocolError("participants must be a list of peer ids")
    return dict(
        step=header["step"], shard=shard, shard_count=shards, members=members, participants=participants
    )


def max_grads_message_bytes(num_values: int, num_tensors: int) -> int:
    """Largest legal `grads` message: fp32 sums, the header (bounded) and per-tensor descriptors."""
    return 4 * num_values + MAX_HEADER_BYTES + 4096 * (1 + num_tensors // 64)


def validate_grads(
    message: Message, stage: int, digest: str, names: list[str], shapes: list[tuple[int, ...]]
) -> tuple[int, int, list[torch.Tensor]]:
    """A stage peer's gradient sums of a step: (step, samples, sums in parameter order)."""
    header = _checked_step_header(message, stage, digest)
    samples = header.get("samples")
    if not _is_int(samples) or not 0 < samples < MAX_STEP:
        raise ProtocolError(f"grads need a positive sample count, got {samples!r}")
    if set(message.tensors) != set(names):
        raise ProtocolError("grads must carry exactly this stage's parameters")
    sums = [_checked_float(message, name, shape) for name, shape in zip(names, shapes, strict=True)]
    return header["step"], samples, sums


def validate_step_means_request(message: Message, stage: int, digest: str) -> int:
    """The step whose mean gradients a stage peer asks for."""
    return _checked_step_header(message, stage, digest)["step"]


def validate_step_means(
    message: Message, names: list[str], shapes: list[tuple[int, ...]]
) -> tuple[int, list[torch.Tensor] | None]:
    """A peer's answer: (samples, mean gradients in parameter order; None for a step with no samples)."""
    samples = message.header.get("samples")
    if not _is_int(samples) or not 0 <= samples < MAX_STEP:
        raise ProtocolError(f"step means need a sample count, got {samples!r}")
    if not message.tensors and message.header.get("empty") is True:
        return samples, None
    if set(message.tensors) != set(names):
        raise ProtocolError("step means must carry exactly this stage's parameters")
    return samples, [_checked_float(message, name, shape) for name, shape in zip(names, shapes, strict=True)]


def _checked_step_header(message: Message, stage: int, digest: str) -> dict:
    header = message.header
    if header.get("digest") != digest:
        raise ProtocolError(
            f"config digest mismatch ({header.get('digest')!r} vs {digest})", "digest_mismatch"
        )
    if not (_is_int(header.get("stage")) and header["stage"] == stage):
        raise ProtocolError(f"this server hosts stage {stage}, the message is for {header.get('stage')!r}")
    _checked_step(header, required=True)
    return header


def _one_of(value, names) -> bool:
    """`value in names` for a name table, safe for any JSON value (a list is unhashable)."""
    return isinstance(value, str) and value in names


def _is_peer_id(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
