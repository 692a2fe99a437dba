"""The network half of a stage's step exchange: what a replica sends its stage peers
(`StagePeerLink`: gradient sums, pings, requests for a missed step's means) and the handlers of what
they and the trainers send it (`StepExchange`: `close`, `grads`, `step_means`, `ping`).

The decisions (which close, whose sums) are `StepCoordinator`'s (runtime/server/stage_steps.py) and
planner/step_decision.py's; the coordinator reaches the network only through the `StagePeerLink` it
is given. The link exists from the stage's start (the coordinator is built with it) and is attached
to the process's client when the stage starts serving: before that it can ask nobody (a peer's ping
counts as answered, a send fails).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from swarmtrain.config.model import StageSpec
from swarmtrain.net.failures import Outcome, on_request_failure
from swarmtrain.net.protocol import (
    Message,
    error_message,
    make_message,
    ping_message,
    validate_close,
    validate_grads,
    validate_step_means,
    validate_step_means_request,
)
from swarmtrain.planner.deadlines import (
    EXCHANGE_PING_RATIO,
    CallTimes,
    exchange_ping_timeout_s,
    reply_ping_timeout_s,
)
from swarmtrain.runtime.faults import FaultHooks, nan_like
from swarmtrain.runtime.server.stage_steps import StepCoordinator
from swarmtrain.runtime.server.stage_worker import StageWorker, all_finite
from swarmtrain.runtime.server.sums_codec import SumsCodec, WireSums
from swarmtrain.utils.logging import get_logger
from swarmtrain.utils.silence import PeerSilent, silent_while

if TYPE_CHECKING:  # hivemind is imported only once the process has prepared its environment
    from swarmtrain.net.transport import Handler, StageClient

logger = get_logger(__name__)

GRADS_ATTEMPTS = 3  # a cut-off stream is retried; a dead peer is not waited for
MAX_TIMED_PEERS = 64  # stage peers whose exchange times are kept


class StagePeerLink:
    """A replica's calls to the other replicas of its stage."""

    def __init__(
        self,
        spec: StageSpec,
        digest: str,
        worker: StageWorker,
        faults: FaultHooks,
        averaging_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.spec, self.digest, self.worker, self.faults = spec, digest, worker, faults
        self.averaging_timeout_s, self.request_timeout_s = averaging_timeout_s, request_timeout_s
        self.param_shapes = [tuple(p.shape) for p in worker.params]
        self.means_bytes = 4 * sum(p.numel() for p in worker.params)  # a step's means go as fp32
        self.client: StageClient | None = None  # the process's, once the stage serves
        # by peer, most recent last: how long sending it our sums took (a ping's timeout, below)
        self._exchange_times: OrderedDict[str, CallTimes] = OrderedDict()
        self._sums_bytes = 0  # the size of the last sums we sent: a ping's timeout before any is timed

    def attach(self, client: StageClient) -> None:
        self.client = client

    async def answers_ping(self, peer: str) -> bool:
        """Does a stage peer's event loop answer at once? A frozen peer does not; a busy one does."""
        if self.client is None:
            return True  # not serving yet: nobody to ask with, wait as before
        return await self._ping_reply(peer) is not None

    async def is_stage_replica(self, peer: str) -> bool:
        """Does `peer` answer a ping as a replica of this stage of this run (same stage, same digest)? A
        peer that does not answer, answers with an error, or serves something else is not one."""
        return await self._replica_reply(peer) is not None

    async def epoch_of(self, peer: str) -> int | None:
        """The epoch `peer` answers a stage ping with as a replica of this stage; None when it is none."""
        reply = await self._replica_reply(peer)
        epoch = None if reply is None else reply.header.get("epoch")
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None

    async def _replica_reply(self, peer: str) -> Message | None:
        if self.client is None:
            return None
        reply = await self._ping_reply(peer)
        if reply is None or (reply.header.get("stage"), reply.header.get("digest")) != (
            self.spec.index,
            self.digest,
        ):
            return None
        return reply

    async def _ping_reply(self, peer: str) -> Message | None:
        """A stage peer's answer to our stage ping within what our exchanges with it take
        (planner/deadlines.py), or None (no answer, or not a peer id)."""
        assert self.client is not None  # checked by the callers
        message = ping_message(self.spec.index, self.digest)
        timeout_s = exchange_ping_timeout_s(self._exchange_times.get(peer), self._sums_bytes)
        # a ping queues behind an exchange each way, and an exchange longer than the averaging timeout
        # fails anyway: beyond that (a large stage never timed), a catch-up's ask waited minutes on a
        # frozen peer
        cap_s = EXCHANGE_PING_RATIO * self.averaging_timeout_s
        return await self.client.ping_reply(peer, message, min(timeout_s, cap_s))

    def _observe_exchange(self, peer: str, took_s: float) -> None:
        times = self._exchange_times.pop(peer, CallTimes()).observed(took_s)
        self._exchange_times[peer] = times
        while len(self._exchange_times) > MAX_TIMED_PEERS:  # peers come and go over a long run
            self._exchange_times.popitem(last=False)

    async def send_grads(self, peer: str, step: int, samples: int, sums: WireSums) -> bool:
        """One replica's gradient sums of a step to a stage peer, as encoded once for every peer; False if
        the peer is gone or refuses."""
        from swarmtrain.net.transport import RemoteError

        if self.client is None:
            return False  # steps run only while serving
        header = {"step": step, "samples": samples, "stage": self.spec.index, "digest": self.digest}
        if self.faults.sends_nan(step):  # a faulty replica (tests); its scaling is in the accumulation
            sums = SumsCodec().encode(nan_like(sums.tensors))
        message = Message("grads", header, dict(zip(self.worker.names, sums.encoded, strict=True)))
        self._sums_bytes = sum(len(t.payload) for t in message.tensors.values())
        for attempt in range(GRADS_ATTEMPTS):
            try:
                start_s = time.monotonic()
                await self.client.call(peer, message, timeout_s=self.averaging_timeout_s)
                if attempt == 0:  # a retry's time says how long the peer was away (frozen, cut off), not
                    # what the link takes: timed, a peer that froze once was given 22 s pings for good
                    self._observe_exchange(peer, time.monotonic() - start_s)
                return True
            except Exception as exc:  # the trainer's failure table (net/failures.py); a bug is raised
                failure = on_request_failure(exc)
                if isinstance(exc, RemoteError):  # alive but refusing (digest, shape): retrying cannot help
                    logger.warning("step %d: stage peer %s refused our gradients: %s", step, peer[-8:], exc)
                    return False
                if failure.outcome is Outcome.GONE:
                    logger.warning("step %d: stage peer %s unreachable: %r", step, peer[-8:], exc)
                    return False
                logger.info(
                    "step %d: sending gradients to %s failed (%r), attempt %d", step, peer, exc, attempt
                )
        return False

    async def step_means(self, peer: str, step: int) -> tuple[int, list[torch.Tensor] | None]:
        """(samples, mean gradients) `peer` applied at `step` (None: a step without any); raises what
        the call raises, ProtocolError for a malformed answer, PeerSilent when the peer stops answering
        pings while it sends them."""
        if self.client is None:
            raise ConnectionError("this stage does not serve yet")
        request = Message("step_means", {"step": step, "stage": self.spec.index, "digest": self.digest})
        call = asyncio.ensure_future(self.client.call(peer, request, self.request_timeout_s))
        try:
            # a donor that froze is given up within seconds, not at the request timeout: the replica
            # decides again meanwhile (another donor, or adopting the step), the trainers held by it
            times = self._exchange_times.get(peer)
            # beyond the call's own timeout the call ends first
            check_s = min(
                reply_ping_timeout_s(times, self._sums_bytes, self.means_bytes), self.request_timeout_s
            )
            if await silent_while(call, check_s, lambda: self._silent(peer, check_s)):
                raise PeerSilent(f"{peer[-8:]} stopped answering pings while sending step {step}'s means")
            reply = await call
        finally:
            call.cancel()  # nothing when it is done
        return validate_step_means(reply, self.worker.names, self.param_shapes)

    async def _silent(self, peer: str, timeout_s: float) -> list[str]:
        assert self.client is not None  # checked by the caller
        reply = await self.client.ping_reply(peer, ping_message(self.spec.index, self.digest), timeout_s)
        return [] if reply is not None else [peer]


class StepExchange:
    """The handlers of the step exchange's messages, one per kind."""

    def __init__(
        self, spec: StageSpec, digest: str, worker: StageWorker, steps: StepCoordinator, link: StagePeerLink
    ) -> None:
        self.spec, self.digest, self.worker, self.steps, self.link = spec, digest, worker, steps, link
        self.handlers: dict[str, Handler] = {
            "ping": self._on_ping,
            "close": self._on_close,
            "grads": self._on_grads,
            "step_means": self._on_step_means,
        }

    async def _on_ping(self, _message: Message, _context) -> Message:
        """Answered on the event loop, never behind the compute thread: a busy server answers at once,
        a frozen one not at all (callers tell the two apart with it). The stage and digest say what it
        serves (a stage peer checks a replica the DHT has not shown it yet with them)."""
        return Message(
            "result", {"epoch": self.worker.epoch, "stage": self.spec.index, "digest": self.digest}
        )

    async def _on_close(self, message: Message, context) -> Message:
        """Kept as a candidate or ignored (runtime/server/stage_steps.py checks it against this replica's
        state and the stage's live replicas); either way the sender is only told it arrived."""
        close = validate_close(message, self.spec.index, self.digest)
        self.steps.inbox.on_close(**close, sender=sender_of(context))
        return Message("result", {"ok": True})

    async def _on_grads(self, message: Message, context) -> Message:
        step, samples, sums = validate_grads(
            message, self.spec.index, self.digest, self.worker.names, self.link.param_shapes
        )
        self.steps.inbox.on_grads(sender_of(context), step, samples, sums)
        return Message("result", {"ok": True})

    async def _on_step_means(self, message: Message, _context) -> Message:
        step = validate_step_means_request(message, self.spec.index, self.digest)
        kept = self.steps.means_of(step)
        if kept is None:
            return error_message(f"the means of step {step} are not kept here", "unavailable")
        samples, means = kept
        header = {"step": step, "samples": samples}
        if means is None or not all_finite(means):
            return Message("result", {**header, "empty": True})  # skipped alike on every replica
        return make_message("result", header, dict(zip(self.worker.names, means, strict=True)), "none")


def sender_of(context) -> str:
    """The authenticated peer id a message came from (libp2p)."""
    return context.remote_id.to_base58()
