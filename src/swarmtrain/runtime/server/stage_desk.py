"""A stage replica's micro-batch desk: the handlers of every micro-batch kind (`forward`, `backward`,
`forward_backward`, `evaluate`, `chain`, `evaluate_chain`, `bundle`), their admission and their compute.

`Admission` is the serving and draining state a micro-batch is admitted under: refused while the
replica downloads the stage state or drains, counted while it runs (a drain waits for those). The
`MicroBatchDesk` is built when the stage starts serving, complete: its hop to the next stage (none at
the last stage) is given to it. A request is validated (net/protocol.py), is refused at once while
this replica trails its stage by more than a close can (`StageCatchUp.trailing`: the caller tries
another replica), waits for the parameters of its step (`StepCoordinator.versions`,
runtime/server/step_versions.py), then runs on the compute thread, alone or batched with
others (stage_batches.py); a chain goes on to the next stage through `ChainHop`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from swarmtrain.config import RunConfig
from swarmtrain.config.model import StageSpec
from swarmtrain.net.bundle import bundle_message, split_bundle
from swarmtrain.net.hand_off import micro_batch_origin, validate_chain, validate_evaluate_chain
from swarmtrain.net.protocol import (
    BUNDLE_KIND,
    HAND_OFF_KINDS,
    Message,
    ProtocolError,
    StageIO,
    StageRequest,
    error_message,
)
from swarmtrain.net.token_ids import validate_stage_request
from swarmtrain.net.transport import Handler  # the one alias: transport's servicer calls handlers
from swarmtrain.runtime.server.chain_hop import Admitted, ChainHop
from swarmtrain.runtime.server.compute import (
    PRIORITY_BACKWARD,
    PRIORITY_EVAL,
    PRIORITY_FORWARD,
    ComputeWorker,
    DeadlineExpired,
)
from swarmtrain.runtime.server.stage_batches import batch_item
from swarmtrain.runtime.server.stage_catch_up import StageCatchUp
from swarmtrain.runtime.server.stage_steps import StepCoordinator
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

# (request, how many arrived together, whose micro-batch it is: `micro_batch_origin`) -> answer
Run = Callable[[Message, int, str], Awaitable[Message]]


class Admission:
    """Whether the stage takes micro-batches, and how many it is serving: `serving()` is False while
    the replica downloads the stage state; `draining` once it leaves the stage."""

    def __init__(self, serving: Callable[[], bool]) -> None:
        self.serving = serving
        self.draining = False  # no new micro-batch is taken
        self.running = 0  # micro-batches being served (a drain waits for them)
        self.samples_done = 0  # samples whose backward ran here (counted with their CPU for capacity)
        self.received = 0  # micro-batch requests that reached the desk, refused ones too (activity)

    def refusal(self) -> Message | None:
        """The answer that refuses a new micro-batch now, or None."""
        if not self.serving():
            return error_message("this replica is downloading the stage state; try another", "unavailable")
        if self.draining:
            return leaving_answer()
        return None


class MicroBatchDesk:
    def __init__(
        self,
        cfg: RunConfig,
        spec: StageSpec,
        io: StageIO,
        digest: str,
        worker: StageWorker,
        compute: ComputeWorker,
        steps: StepCoordinator,
        catch_up: StageCatchUp,
        admission: Admission,
        hop: ChainHop | None,
    ) -> None:
        """`catch_up`: whether a request's step is one this replica trails its stage by; `hop`: this
        stage's hand-offs to the next one (None at the last stage)."""
        self.cfg, self.spec, self.io, self.digest = cfg, spec, io, digest
        self.worker, self.compute, self.steps, self.catch_up = worker, compute, steps, catch_up
        self.admission, self.hop = admission, hop
        self.handlers: dict[str, Handler] = {
            "forward": self._on_forward,
            "backward": self._on_backward,
            "forward_backward": self._on_forward_backward,
            "evaluate": self._on_evaluate,
            "chain": self._on_chain,
            "evaluate_chain": self._on_evaluate_chain,
            BUNDLE_KIND: self._on_bundle,
        }

    # one handler per kind -------------------------------------------------------------------------
    async def _on_forward(self, message: Message, context) -> Message:
        return await self._serve(message, self._compute_forward, caller=caller_of(context))

    async def _on_backward(self, message: Message, context) -> Message:
        return await self._serve(message, self._compute_backward, caller=caller_of(context))

    async def _on_forward_backward(self, message: Message, context) -> Message:
        return await self._serve(message, self._compute_forward_backward, caller=caller_of(context))

    async def _on_evaluate(self, message: Message, context) -> Message:
        return await self._serve(message, self._compute_evaluation, caller=caller_of(context))

    async def _on_chain(self, message: Message, context) -> Message:
        return await self._serve(message, self._run_chain, caller=caller_of(context))

    async def _on_evaluate_chain(self, message: Message, context) -> Message:
        return await self._serve(message, self._run_evaluate_chain, caller=caller_of(context))

    async def _on_bundle(self, message: Message, context) -> Message:
        """Each item answered by the handler of its kind, all at once (so they may share a compute call),
        and the answers bundled in order."""
        items = split_bundle(message, HAND_OFF_KINDS)
        runs: dict[str, Run] = {
            "forward_backward": self._compute_forward_backward,
            "chain": self._run_chain,
            "evaluate": self._compute_evaluation,
            "evaluate_chain": self._run_evaluate_chain,
        }
        # each item's compute knows how many came with it: they wait for each other to share a call
        answers = await asyncio.gather(
            *(self._serve(item, runs[item.kind], len(items), caller_of(context)) for item in items),
            return_exceptions=True,
        )
        return bundle_message([_answer_of(a) for a in answers], self.spec.index)

    async def _serve(self, message: Message, run: Run, together: int = 1, caller: str = "") -> Message:
        """Admission common to every micro-batch: refused while downloading or draining; counted while
        it runs, so a drain waits for it. `together`: requests that arrived with it (a bundle's items);
        `caller`: the authenticated peer that sent it."""
        self.admission.received += 1
        refusal = self.admission.refusal()
        if refusal is not None:
            return refusal
        origin = micro_batch_origin(message.header, caller)
        self.admission.running += 1
        try:
            return await run(message, together, origin)
        finally:
            self.admission.running -= 1

    # compute -----------------------------------------------------------------------------------
    async def _compute_forward(self, message: Message, together: int, origin: str) -> Message:
        request = validate_stage_request(message, self.io, self.digest)
        return await self._compute(request, message.header, PRIORITY_FORWARD, together)

    async def _compute_evaluation(self, message: Message, together: int, origin: str) -> Message:
        request = validate_stage_request(message, self.io, self.digest)
        return await self._compute(request, message.header, PRIORITY_EVAL, together)

    async def _compute_backward(self, message: Message, together: int, origin: str) -> Message:
        request = validate_stage_request(message, self.io, self.digest)
        request.origin = origin
        reply = await self._compute(request, message.header, PRIORITY_BACKWARD, together)
        self._count_done(request, reply)
        return reply

    async def _compute_forward_backward(self, message: Message, together: int, origin: str) -> Message:
        request = validate_stage_request(message, self.io, self.digest)
        request.origin = origin
        # the last stage's fused forward and backward: the worker's forward runs both
        reply = await self._compute(request, message.header, PRIORITY_FORWARD, together)
        self._count_done(request, reply)
        return reply

    def _count_done(self, request: StageRequest, reply: Message) -> None:
        """A backward ran: the samples' work is done (and its CPU counted)."""
        if reply.kind == "result":
            self.admission.samples_done += request.num_samples

    async def _run_chain(self, message: Message, together: int, origin: str) -> Message:
        chain = validate_chain(message, self.io, self.digest, self.cfg.swarm.num_stages)  # not the last stage
        chain.forward.origin = origin  # accumulated here and handed on with the micro-batch
        if self.hop is None:  # the last stage: no next stage to hand off to
            return error_message("the last stage takes no chain", "bad_request")
        # the chain's time includes every later stage's: each may take up to a request timeout
        later_stages = self.cfg.swarm.num_stages - self.spec.index
        admitted = await self._admit(chain.forward, message.header, later_stages)
        if isinstance(admitted, Message):
            return admitted
        try:
            reply = await self.hop.run(chain, admitted, together)
        except DeadlineExpired as exc:
            return error_message(str(exc), "timeout")
        self._count_done(chain.forward, reply)
        return reply

    async def _run_evaluate_chain(self, message: Message, together: int, _origin: str) -> Message:
        chain = validate_evaluate_chain(message, self.io, self.digest, self.cfg.swarm.num_stages)
        if self.hop is None:
            return error_message("the last stage takes no evaluate_chain", "bad_request")
        later_stages = self.cfg.swarm.num_stages - self.spec.index
        admitted = await self._admit(chain.forward, message.header, later_stages)
        if isinstance(admitted, Message):
            return admitted
        try:
            return await self.hop.evaluate(chain, admitted, together)
        except DeadlineExpired as exc:
            return error_message(str(exc), "timeout")

    async def _compute(self, request: StageRequest, header: dict, priority: int, together: int) -> Message:
        """The worker's work for the request's kind (stage_batches.py), alone or batched with others."""
        admitted = await self._admit(request, header)
        if isinstance(admitted, Message):
            return admitted
        try:
            reply, compute_s = await self.compute.run_batchable(
                batch_item(self.worker, request, together), priority, admitted.deadline_s
            )
        except DeadlineExpired as exc:
            return error_message(str(exc), "timeout")
        except ProtocolError as exc:
            return error_message(str(exc), exc.code)
        # queue wait + compute: the caller subtracts it from its round trip to see the transport's share.
        # On CUDA `compute_s` (the compute thread's time) leaves out the reply's encoding and its copy to
        # the host (a side stream, runtime/server/stage_replies.py); `server_s` includes waiting for them
        reply.header["server_s"] = round(time.monotonic() - admitted.arrived_s, 6)
        reply.header["compute_s"] = round(compute_s, 6)
        # waiting for the previous step is the step's pace, not this peer's speed: routers leave it out
        reply.header["step_wait_s"] = round(admitted.step_wait_s, 6)
        return reply

    async def _admit(self, request: StageRequest, header: dict, timeouts: int = 1) -> Admitted | Message:
        """The request's deadline once it may run (the parameters of its step are here), or the answer
        that refuses it (already applied, not ready in time, leaving)."""
        timeout_s = self.cfg.swarm.request_timeout_s * timeouts
        requested = header.get("timeout_s")
        if isinstance(requested, (int, float)) and 0 < requested < timeout_s:
            timeout_s = float(requested)
        arrived_s = time.monotonic()
        deadline_s = arrived_s + timeout_s
        if request.step is None:
            return Admitted(arrived_s, deadline_s, 0.0)
        # a training micro-batch of step k runs on the parameters after step k - max_staleness
        # (synchronous by default: after step k - 1); an evaluation names the step it must see
        need = request.step if request.evaluate else request.step - self.cfg.training.max_staleness
        if not request.evaluate and self.worker.epoch > request.step:
            return error_message(
                f"step {request.step} is already applied here (at {self.worker.epoch})", "stale"
            )
        draining, step = self.admission, request.step

        def trailing() -> Message | None:
            reason = None if request.evaluate else self.catch_up.trailing(step)
            return None if reason is None else error_message(reason, "unavailable")

        if (refused := trailing()) is not None:
            return refused
        held = lambda: draining.draining or trailing() is not None  # noqa: E731
        if not await self.steps.versions.wait(need, deadline_s, held, counted=not request.evaluate):
            if draining.draining:
                return leaving_answer()
            if (refused := trailing()) is not None:
                return refused
            return error_message(f"parameters of step {need} not ready in time", "timeout")
        return Admitted(arrived_s, deadline_s, time.monotonic() - arrived_s)


def _answer_of(outcome: Message | BaseException) -> Message:
    """A bundle item's answer: its reply, or the error a lone request would have been answered with."""
    if isinstance(outcome, ProtocolError):
        return error_message(str(outcome), outcome.code)
    if isinstance(outcome, BaseException):
        logger.error("a bundled request failed: %r", outcome)  # one line; the traceback at debug level
        logger.debug("a bundled request failed", exc_info=outcome)
        return error_message(f"internal error: {outcome!r}", "internal")
    return outcome


def caller_of(context) -> str:
    """The authenticated peer a request came from (libp2p or the data plane's handshake)."""
    return context.remote_id.to_base58()


def leaving_answer() -> Message:
    return error_message("this replica is leaving the stage; try another", "unavailable")
