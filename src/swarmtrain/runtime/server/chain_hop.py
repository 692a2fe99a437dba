"""A stage server's part of a direct hand-off (net/hand_off.py): forward, call the next stage of the
route with the outputs, backward on the gradient its reply brings, report.

`StagePeers` is the server's view of a neighbouring stage: the peers announced there with this run's
digest. For the stage after it, connected once; a route may name only those, so a caller cannot make a
server stream activations to an arbitrary peer. A server behind a NAT also keeps connections open to
the stage before it (`redial`): libp2p streams go both ways on a connection whoever opened it, and
nobody can dial this server except through a circuit relay, which hivemind's p2pd resets after ~128 KiB
in a direction (docs/LOG.md), far less than a stage's activations. The previous stage's hand-offs
then come in over the connections this server opened (measured: tests/integration/test_nat.py).

`ChainHop.run` holds the forward's inputs while it awaits the next hop (on the event loop: the compute
thread serves other requests meanwhile); the backward finds the graph in the worker's cache, or
recomputes it when the cache dropped it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial

from torch import Tensor

from swarmtrain.net.data_plane import Address, DataPlaneClient, dial_address
from swarmtrain.net.dht_records import RunRecords, StageView
from swarmtrain.net.failures import (
    NEXT_HOP_FAILED,
    FailureAction,
    Outcome,
    classify_failure,
    flags_after,
    on_request_failure,
    resend_once,
)
from swarmtrain.net.hand_off import (
    ChainRequest,
    HopReport,
    chain_message,
    checked_loss,
    evaluate_chain_message,
    last_hop,
    validate_hops,
)
from swarmtrain.net.protocol import (
    Message,
    ProtocolError,
    StageIO,
    StageRequest,
    checked_grad_reply,
    error_message,
    request_message,
)
from swarmtrain.net.token_ids import IDS
from swarmtrain.net.transport import StageClient
from swarmtrain.runtime.server.compute import (
    PRIORITY_BACKWARD,
    PRIORITY_EVAL,
    PRIORITY_FORWARD,
    ComputeWorker,
)
from swarmtrain.runtime.server.hop_uploads import DirectRoute, PeerUploads
from swarmtrain.runtime.server.stage_batches import (
    backwards_left,
    batch_item,
)
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.utils.logging import get_logger, log_repeated

logger = get_logger(__name__)


class StagePeers:
    """Peers of stage `stage` announced with our digest; refreshed by the server every announce period.
    Each is connected to once, or at every refresh with `redial` (a connection the peer uses to call a
    server behind a NAT: if it closed, the peer could reach the server only through a relay again)."""

    def __init__(
        self, records: RunRecords, stage: int, digest: str, client: StageClient, redial: bool = False
    ) -> None:
        self.records, self.stage, self.digest, self.client = records, stage, digest, client
        self.redial = redial
        self.peers: set[str] = set()
        self.data_addresses: dict[str, Address] = {}  # of the peers with a data plane
        self._connected: set[str] = set()
        # a peer whose record lapsed stays a candidate for a while (its stores may fail as it serves)
        self._view = StageView(usable=lambda announcement: announcement.state != "offline")

    async def refresh(self) -> None:
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, partial(self.records.stage_peers, self.stage, True))
        ours = {p: a for p, a in found.items() if a.config_digest == self.digest}
        live = self._view.update(ours, time.monotonic())
        for peer, ann in live.items():
            if self.redial or peer not in self._connected:
                await self.client.connect(peer, ann.addresses, timeout_s=2.0)
                self._connected.add(peer)
        self.peers = set(live)
        addresses = {p: dial_address(a.addresses, a.data_port) for p, a in live.items()}
        self.data_addresses = {p: a for p, a in addresses.items() if a is not None}

    async def usable(self, candidates: list[str]) -> list[str]:
        """The candidates announced at the next stage (reading the DHT again if one is not known yet)."""
        if any(p not in self.peers for p in candidates):
            await self.refresh()
        return [p for p in candidates if p in self.peers]


@dataclass(frozen=True)
class HopClients:
    """How a server calls the next stage: libp2p, and the direct data plane where the peer has one."""

    libp2p: StageClient
    data: DataPlaneClient | None = None


class NextHopFailed(Exception):
    """No candidate of the next stage completed the micro-batch; `code` goes back to the caller."""

    def __init__(self, text: str, code: str = NEXT_HOP_FAILED) -> None:
        super().__init__(text)
        self.code = code


@dataclass
class Admitted:
    """When the request arrived, until when it may run, how long it waited for the previous step."""

    arrived_s: float
    deadline_s: float
    step_wait_s: float


class ChainHop:
    def __init__(
        self,
        worker: StageWorker,
        compute: ComputeWorker,
        clients: HopClients,
        next_stage: StagePeers,
        io: StageIO,
        digest: str,
        num_stages: int,
        peer_id: str,
    ) -> None:
        self.worker, self.compute, self.clients, self.next_stage = worker, compute, clients, next_stage
        self.io, self.digest, self.num_stages, self.peer_id = io, digest, num_stages, peer_id
        self.retries = 0  # calls to the next stage that failed and went to another candidate
        self._uploads: dict[str, PeerUploads] = {}  # per next-stage peer

    async def run(self, chain: ChainRequest, admitted: Admitted, together: int = 1) -> Message:
        """`together`: requests that arrived with this one (a bundle's items: their forwards may share
        a compute call)."""
        forward = chain.forward
        reply, forward_s = await self.compute.run_batchable(
            batch_item(self.worker, forward, together),
            PRIORITY_FORWARD,
            admitted.deadline_s,
        )
        child_start_s = time.monotonic()
        try:
            child, hops, grad = await self._call_next(chain, reply.tensors["outputs"], admitted.deadline_s)
        except NextHopFailed as exc:
            return error_message(str(exc), exc.code)
        child_s = time.monotonic() - child_start_s
        backward = StageRequest(
            "backward",
            forward.micro_batch_id,
            forward.codec,
            forward.inputs,
            grad_outputs=grad,
            accumulate=forward.accumulate,
            step=forward.step,
            origin=forward.origin,
        )
        # no deadline: the later stages have run their backward, so this stage runs its own whatever
        # the time, or the stages would disagree on the step's batch
        result, backward_s = await self.compute.run_batchable(
            batch_item(self.worker, backward, backwards_left(self.worker, forward.micro_batch_id)),
            PRIORITY_BACKWARD,
        )
        own = HopReport(
            self.io.stage,
            self.peer_id,
            int(result.header.get("acc", 0)),
            time.monotonic() - admitted.arrived_s,
            forward_s + backward_s,
            admitted.step_wait_s,
            child_s,
        )
        header = {"mb": forward.micro_batch_id, "loss": child.header.get("loss"), "hops": [own.to_dict()]}
        header["hops"] += [hop.to_dict() for hop in hops]
        return Message("result", header, dict(result.tensors))

    async def evaluate(self, chain: ChainRequest, admitted: Admitted, together: int = 1) -> Message:
        """A validation micro-batch: our forward (nothing kept), then the next stage of the route, whose
        loss is the answer. Nothing accumulates anywhere, so any candidate may be tried after another."""
        forward = chain.forward
        reply, _ = await self.compute.run_batchable(
            batch_item(self.worker, forward, together), PRIORITY_EVAL, admitted.deadline_s
        )
        outputs, stage = reply.tensors["outputs"], self.io.stage + 1
        candidates = await self.next_stage.usable(chain.route[0])
        last_reason = f"no candidate of stage {stage} in the route is a live peer of it"
        for peer in candidates:
            timeout_s = admitted.deadline_s - time.monotonic()
            if timeout_s <= 0:
                break
            message = self._next_message(chain, outputs, timeout_s)
            try:
                tokens = int(forward.inputs.shape[0] * forward.inputs.shape[1])
                child = await self._uploads_to(peer).call(message, tokens, timeout_s)
                loss = checked_loss(child)
                return Message("result", {"mb": forward.micro_batch_id, "loss": loss})
            except ProtocolError as exc:  # a malformed reply: evaluations change nothing, try the next
                last_reason = str(exc)
            except Exception as exc:
                last_reason = f"{exc!r:.200}"
                if classify_failure(exc) is Outcome.FATAL:  # re-raises what is a bug
                    return error_message(f"stage {stage} peer {peer} refused: {last_reason}", "bad_request")
            self.retries += 1
        return error_message(f"stage {stage}: no candidate evaluated, last: {last_reason}", NEXT_HOP_FAILED)

    async def _call_next(
        self, chain: ChainRequest, outputs, deadline_s: float
    ) -> tuple[Message, list, Tensor]:
        """The next stage's reply, its hop reports and the gradient of our outputs, trying the route's
        candidates in order."""
        forward, stage = chain.forward, self.io.stage + 1
        candidates = await self.next_stage.usable(chain.route[0])
        if not candidates:
            raise NextHopFailed(f"no candidate of stage {stage} in the route is a live peer of it")
        flags = list(chain.accumulate_after)
        last_reason, resent = "", set[str]()
        tries = list(candidates)
        while tries:
            peer = tries.pop(0)
            # the next stage gets what is left but a share for our own backward (one per stage from here)
            timeout_s = (deadline_s - time.monotonic()) * (1 - 1 / (self.num_stages - self.io.stage))
            if timeout_s <= 0:
                break
            message = self._next_message(chain, outputs, timeout_s, flags)
            try:
                tokens = int(forward.inputs.shape[0] * forward.inputs.shape[1])
                reply = await self._uploads_to(peer).call(message, tokens, timeout_s)
                grad = checked_grad_reply(
                    reply, tuple(forward.inputs.shape[:2]), self.io.wire_dim, self.io.device
                )
                return reply, self._hops(chain, peer, reply), grad
            except ProtocolError as exc:  # a malformed reply: it may have applied, like a cut-off one
                failure, last_reason = FailureAction(Outcome.MAYBE_APPLIED), str(exc)
            except Exception as exc:
                failure, last_reason = on_request_failure(exc), f"{exc!r:.200}"
            if failure.outcome is Outcome.FATAL:
                raise NextHopFailed(f"stage {stage} peer {peer} refused: {last_reason}", "bad_request")
            if resend_once(failure, peer, resent):  # a cut reply: the same hand-off once more
                tries.insert(0, peer)
            else:
                flags = flags_after(flags, failure.outcome)
            self.retries += 1
            log_repeated(  # while the next stage's replica catches up, every hand-off to it fails
                logger,
                logging.INFO,
                "chain %s: stage %d peer %s failed (%s)",
                *(forward.micro_batch_id, stage, peer[-8:], last_reason),
                key=stage,
            )
        raise NextHopFailed(f"stage {stage}: every candidate failed, last: {last_reason}")

    def _uploads_to(self, peer: str) -> PeerUploads:
        if peer not in self._uploads:
            max_tokens = self.compute.max_batch_tokens
            self._uploads[peer] = PeerUploads(
                self.clients.libp2p,
                peer,
                self.io.stage + 1,
                max_tokens,
                DirectRoute(self.clients.data, lambda: self.next_stage.data_addresses.get(peer))
                if self.clients.data is not None
                else None,
            )
        return self._uploads[peer]

    @property
    def bundles(self) -> int:
        """Uploads to the next stage that carried several micro-batches."""
        return sum(u.bundles for u in self._uploads.values())

    def _next_message(
        self, chain: ChainRequest, outputs, timeout_s: float, flags: list[bool] | None = None
    ) -> Message:
        """The call to the next stage: a training hand-off with the later stages' accumulate `flags`, an
        evaluation without (`forward_backward` or `evaluate` at the last stage)."""
        forward, stage = chain.forward, self.io.stage + 1
        sent: dict = {"timeout_s": timeout_s, "step": forward.step}
        if flags is not None and forward.origin:  # whose micro-batch it is: the next replica counts it so
            sent["origin"] = forward.origin
        if stage == self.num_stages - 1:
            kind = "evaluate" if flags is None else "forward_backward"
            if flags is not None:
                sent["accumulate"] = flags[0]
            tensors = {"inputs": outputs, "labels": chain.labels}
            if chain.ids is not None:  # subspace boundaries: the last stage rebuilds its inputs from them
                tensors[IDS] = chain.ids
            return request_message(
                kind, forward.micro_batch_id, stage, self.digest, forward.codec, tensors, **sent
            )
        route = (
            forward.micro_batch_id,
            stage,
            self.digest,
            forward.codec,
            outputs,
            chain.labels,
            chain.route[1:],
        )
        if flags is None:
            return evaluate_chain_message(*route, ids=chain.ids, **sent)
        return chain_message(*route, flags, ids=chain.ids, **sent)

    def _hops(self, chain: ChainRequest, peer: str, reply: Message) -> list[HopReport]:
        stage, n = self.io.stage + 1, chain.forward.num_samples
        if stage == self.num_stages - 1:
            return [last_hop(stage, peer, reply)]
        candidates = [[peer], *chain.route[1:]]
        return validate_hops(reply.header, stage, self.num_stages, candidates, n)
