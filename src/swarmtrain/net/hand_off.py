"""Direct hand-off between stage servers: the `chain` message and the report a chain returns (what a
failed call means for accumulation is net/failures.py, which every retry loop shares).

A trainer sends a micro-batch (token ids, labels, the route: candidate peers for every later stage) to
a stage server as one `chain` request. The server runs its forward, calls the next stage of the route
itself (`chain` again, or `forward_backward` at the last stage) with its outputs and the labels, and
gets the gradient of its outputs back as that call's reply; it runs its backward on the inputs it kept
and answers its caller with its own input gradient (none at stage 0) and one report per stage it
reached (`hops`: the peer, the samples it accumulated, its timings). So activations and gradients cross
each boundary once, server to server; the trainer's link carries ids, labels, the route and reports.
Validation goes the same way (`evaluate_chain`: forward only, the last stage takes `evaluate`, the
reply is the loss), so a server that accepts no inbound connection validates as it trains.

Calls go strictly to higher stages and a handler awaits the next hop on the event loop (its compute
thread stays free), so chains cannot deadlock. Every hop keeps one accumulate flag per stage from
itself to the last: a failed call clears the flags of the stages that may have applied the micro-batch
(`flags_after`), so a stage applies each micro-batch at most once, whoever retries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from swarmtrain.net import codec
from swarmtrain.net.protocol import (
    MAX_ID_CHARS,
    Message,
    ProtocolError,
    StageIO,
    StageRequest,
    check_batch_shape,
    checked_label_shape,
)
from swarmtrain.net.token_ids import IDS, encode_token_ids, validate_stage_request, whole_first_inputs

CHAIN_KIND = "chain"
EVALUATE_CHAIN_KIND = "evaluate_chain"
MAX_CANDIDATES = 4  # per stage of a route: the chosen peer and its alternates


@dataclass
class ChainRequest:
    """A validated `chain`: this hop's forward, the labels for the last stage (relayed as received),
    the candidates of every later stage and one accumulate flag per later stage; with subspace
    boundaries the token ids every later stage takes (relayed as received, made at stage 0)."""

    forward: StageRequest
    labels: codec.EncodedTensor
    route: list[list[str]]
    accumulate_after: list[bool]
    ids: codec.EncodedTensor | None = None


def chain_message(
    mb: str,
    stage: int,
    digest: str,
    codec_name: str,
    inputs: codec.EncodedTensor,
    labels: codec.EncodedTensor,
    route: list[list[str]],
    accumulate: list[bool],
    ids: codec.EncodedTensor | None = None,
    **header,
) -> Message:
    """`accumulate[0]` is the receiving stage's flag, the rest belong to the stages of `route`; `ids`:
    the token ids a stage after a subspace boundary takes (net/token_ids.py)."""
    flags = {"accumulate": accumulate[0], "accumulate_after": list(accumulate[1:])}
    return _hand_off_message(
        CHAIN_KIND, mb, stage, digest, codec_name, inputs, labels, route, ids, **flags, **header
    )


def validate_chain(message: Message, io: StageIO, digest: str, num_stages: int) -> ChainRequest:
    """Check a `chain` against this stage (never the last: it takes `forward_backward`)."""
    forward, labels, route, ids = _validate_hand_off(message, "forward", io, digest, num_stages)
    flags, later = message.header.get("accumulate_after"), len(route)
    if not (isinstance(flags, list) and len(flags) == later and all(isinstance(f, bool) for f in flags)):
        raise ProtocolError(f"accumulate_after must be {later} true/false value(s)")
    return ChainRequest(forward, labels, route, flags, ids)


def _hand_off_message(
    kind: str, mb: str, stage: int, digest: str, codec_name: str, inputs, labels, route, ids=None, **header
) -> Message:
    body = {"mb": mb, "stage": stage, "digest": digest, "codec": codec_name, "route": route, **header}
    tensors = {"inputs": inputs, "labels": labels, **({IDS: ids} if ids is not None else {})}
    return Message(kind, body, tensors)


# A validation micro-batch handed along `route` (forward only, nothing kept); the reply is its loss. It
# carries what a `chain` does but the accumulate flags, so it is the shared builder with its kind fixed.
evaluate_chain_message = functools.partial(_hand_off_message, EVALUATE_CHAIN_KIND)


def validate_evaluate_chain(message: Message, io: StageIO, digest: str, num_stages: int) -> ChainRequest:
    """Check an `evaluate_chain` against this stage (never the last: it takes `evaluate`)."""
    forward, labels, route, ids = _validate_hand_off(message, "evaluate", io, digest, num_stages)
    return ChainRequest(forward, labels, route, [False] * len(route), ids)


def _validate_hand_off(
    message: Message, hop_kind: str, io: StageIO, digest: str, num_stages: int
) -> tuple[StageRequest, codec.EncodedTensor, list[list[str]], codec.EncodedTensor | None]:
    """What a chain of either kind carries: this hop's request (`hop_kind`), the labels, the route and
    (subspace boundaries) the later stages' token ids."""
    if io.is_last:
        raise ProtocolError(f"the last stage takes no {message.kind}")
    header = message.header
    names = {"inputs", "labels"} | ({IDS} if io.token_ids else set())
    if set(message.tensors) != names:
        raise ProtocolError(
            f"{message.kind} carries {', '.join(sorted(names))}, got {sorted(message.tensors)}"
        )
    labels = message.tensors["labels"]
    check_batch_shape("labels", labels.shape, 2, io)
    hop = {name: t for name, t in message.tensors.items() if name != "labels"}
    if io.is_first:  # the trainer sends stage 0's ids compact beside the labels (net/token_ids.py)
        hop["inputs"] = whole_first_inputs(hop["inputs"], labels, io.vocab_size)
    checked_label_shape(labels, tuple(hop["inputs"].shape[:2]))
    decoded = message.tensor("labels") if io.subspace else None
    forward = validate_stage_request(Message(hop_kind, header, hop), io, digest, decoded)
    ids = message.tensors.get(IDS)  # relayed as received; stage 0 writes the ids its inputs are
    if io.subspace and io.is_first:
        ids = encode_token_ids(forward.inputs, decoded, io.vocab_size)
    later = num_stages - io.stage - 1
    route = header.get("route")
    if not (isinstance(route, list) and len(route) == later):
        raise ProtocolError(f"route must list candidates for the {later} later stage(s)")
    for candidates in route:
        if not (isinstance(candidates, list) and 1 <= len(candidates) <= MAX_CANDIDATES):
            raise ProtocolError(f"each route entry lists 1 to {MAX_CANDIDATES} peers")
        if not all(isinstance(p, str) and 0 < len(p) <= MAX_ID_CHARS for p in candidates):
            raise ProtocolError("route entries are peer ids")
        if len(set(candidates)) != len(candidates):
            raise ProtocolError("a route entry names a peer twice")
    return forward, labels, route, ids


def micro_batch_origin(header: dict, caller: str) -> str:
    """Whose micro-batch a request is (`StageRequest.origin`): the trainer named by `origin`, which a
    stage server handing a micro-batch off sets from its own request's origin, else the authenticated
    `caller` itself (a trainer: at stage 0, and at any stage it calls itself on the relayed path).
    A replica counts a trainer's close for its samples only when their origin is that trainer
    (planner/step_decision.py), so a forger's close counts for none. An older server's hand-off has no
    `origin`: its samples are that server's, which never closes a step, so such steps decide at the
    lenient fallback (a close timeout later: slower, never on a forger's count)."""
    origin = header.get("origin")
    if origin is None:
        return caller
    if not (isinstance(origin, str) and 0 < len(origin) <= MAX_ID_CHARS):
        raise ProtocolError(f"origin must be a peer id, got {origin!r:.40}")
    return origin


def checked_loss(reply: Message) -> float:
    """The loss of a chain's reply (training or evaluation); ProtocolError when it is not a number."""
    loss = reply.header.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise ProtocolError(f"a chain reply carries a bad loss {loss!r:.40}")
    return float(loss)


# reports --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopReport:
    """One stage of a chain as the stage itself reports it: the peer, the samples it accumulated
    (0 or the micro-batch's), its time from request to reply (`server_s`), of which `compute_s` on its
    compute thread, `step_wait_s` waiting for the previous step and `child_s` in the call to the next
    stage (its caller measured the call to it the same way). On a CUDA server `compute_s` leaves out its
    replies' encoding and copy to the host (runtime/server/stage_replies.py): they are in `server_s`."""

    stage: int
    peer: str
    acc: int
    server_s: float
    compute_s: float
    step_wait_s: float
    child_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "peer": self.peer,
            "acc": self.acc,
            "server_s": round(self.server_s, 6),
            "compute_s": round(self.compute_s, 6),
            "step_wait_s": round(self.step_wait_s, 6),
            "child_s": round(self.child_s, 6),
        }

    def own_s(self) -> float:
        """Time this stage itself took: queue and compute, without the previous step and the next stage."""
        return max(0.0, self.server_s - self.step_wait_s - self.child_s)


def last_hop(stage: int, peer: str, reply: Message) -> HopReport:
    """The report of a last stage, read from its `forward_backward` reply."""
    header = reply.header
    return HopReport(
        stage,
        peer,
        _count(header.get("acc")),
        _seconds(header.get("server_s")),
        _seconds(header.get("compute_s")),
        _seconds(header.get("step_wait_s")),
    )


def validate_hops(
    header: dict, first_stage: int, num_stages: int, candidates: list[list[str]], num_samples: int
) -> list[HopReport]:
    """The `hops` of a chain reply: one per stage from `first_stage` to the last, in order, each peer
    one of that stage's candidates, each accumulation 0 or the whole micro-batch."""
    hops = header.get("hops")
    if not (isinstance(hops, list) and len(hops) == num_stages - first_stage):
        raise ProtocolError(f"a chain reply reports {num_stages - first_stage} hop(s)")
    reports = []
    for offset, hop in enumerate(hops):
        stage = first_stage + offset
        if (
            not isinstance(hop, dict)
            or hop.get("stage") != stage
            or hop.get("peer") not in candidates[offset]
        ):
            raise ProtocolError(f"hop {offset} of a chain reply is not a candidate of stage {stage}")
        acc = hop.get("acc")
        if acc not in (0, num_samples) or isinstance(acc, bool):
            raise ProtocolError(f"stage {stage} reports {acc!r} samples accumulated of {num_samples}")
        timings = [_seconds(hop.get(k)) for k in ("server_s", "compute_s", "step_wait_s", "child_s")]
        reports.append(HopReport(stage, hop["peer"], acc, *timings))
    return reports


def _seconds(value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        return 0.0
    return float(value)


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def hop_service_times(call_s: float, hops: list[HopReport]) -> list[float]:
    """Each hop's share of a chain's time, as a router charges a peer for a micro-batch: its own queue
    and compute plus the transfer into it (the caller's wait for it less the time it reported)."""
    waits = [call_s] + [hop.child_s for hop in hops[:-1]]
    return [hop.own_s() + max(0.0, wait - hop.server_s) for hop, wait in zip(hops, waits, strict=True)]
