"""A micro-batch through every stage by direct hand-off (net/hand_off.py): the trainer picks the route
(one peer per later stage by the routers' IWRR, plus untouched alternates), sends token ids, labels and
the route to a stage-0 peer, and gets back the loss and one report per stage.

Retries follow the one call policy of the trainer (runtime/trainer/call_policy.py, with the relayed
path): the failed call's outcome says which stages may have applied the micro-batch (`flags_after`),
the retry asks those not to accumulate again, and while any stage may hold it the retry is persistent
(giving up would leave the stages disagreeing on the step's batch), as the relayed path's backward is. A stage-0 peer that is gone (or answers `digest_mismatch`) is banned; a chain whose
later hop failed is retried on a new route. A chain that runs past its stage-0 peer's usual time makes
the trainer ping every first-choice peer of its route; when one is silent (frozen), it is banned and the
chain is hedged on a new route that accumulates nothing, first answer wins (runtime/trainer/hedging.py).
"""

from __future__ import annotations

import asyncio
import time

from swarmtrain.net.codec import EncodedTensor
from swarmtrain.net.failures import FailureAction, Outcome, flags_after, on_request_failure
from swarmtrain.net.hand_off import (
    HopReport,
    chain_message,
    checked_loss,
    evaluate_chain_message,
    hop_service_times,
    validate_hops,
)
from swarmtrain.net.protocol import Message, ProtocolError
from swarmtrain.planner.deadlines import check_after_s, ping_timeout_s, silent_deadline_s
from swarmtrain.planner.routing import BACKWARD_WEIGHT, FORWARD_CHARGE, FORWARD_WEIGHT
from swarmtrain.runtime.trainer.call_policy import PERSISTENT_ATTEMPTS, Attempt, frozen_or, run_call
from swarmtrain.runtime.trainer.hedging import (
    SilentPastDeadline,
    first_success,
    silent_while,
    within_deadline,
)
from swarmtrain.runtime.trainer.stage_calls import StageCaller
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

ALTERNATES = 2  # peers after the chosen one in a route entry: a hop tries them when its next hop fails
HOP_WEIGHT = FORWARD_WEIGHT + BACKWARD_WEIGHT  # a hop's report covers its forward and its backward


class ChainCaller:
    def __init__(self, caller: StageCaller, num_stages: int, digest: str, codec: str) -> None:
        self.caller, self.num_stages, self.digest, self.codec = caller, num_stages, digest, codec
        self.table = caller.table

    async def run(
        self, mb: str, step: int, n: int, inputs: EncodedTensor, labels: EncodedTensor, first: int = 0
    ) -> tuple[float, list[HopReport], EncodedTensor | None]:
        """The micro-batch's loss, every stage's report from `first` on (the first stage's peer's first)
        and the gradient of `first`'s inputs (None at stage 0). `inputs`: what stage `first` takes (token
        ids at stage 0; the trainer relayed the stages before it)."""
        return await run_call(self.caller, _ChainPlan(self, mb, step, n, inputs, labels, first))

    async def evaluate(
        self, mb: str, n: int, inputs: EncodedTensor, labels: EncodedTensor, first: int, step
    ) -> float:
        """A validation micro-batch's loss, handed from stage `first` to the last along a route as training
        micro-batches are (`evaluate_chain`); `step`: the parameter version every stage must have."""
        return await run_call(self.caller, _EvaluationPlan(self, mb, n, inputs, labels, first, step))

    async def _attempt(
        self, message: Message, peer: str, route: list[list[str]], attempt: Attempt, n: int, first: int
    ):
        """One chain from `peer` (stage `first`) along `route`, hedged on a new route when a peer of it
        is silent: (loss, hop reports, input gradient) of whichever answers first. While the peers
        answer pings the chain is waited for up to `attempt.cap_s`; once one is silent, until the
        deadline (runtime/trainer/hedging.py)."""
        caller, start_s, wait_s = self.caller, time.monotonic(), attempt.wait_s
        call = asyncio.ensure_future(caller.client.call(peer, message, attempt.cap_s))
        times = caller.call_times.get((first, "chain", peer))
        # every peer of the route, alternates too: a hop that failed over to a frozen alternate keeps the
        # chain waiting while the peers we would otherwise ping answer, and the wait past the deadline
        # is only for chains whose peers all answer (the likely cause of a 46.9 s stall in netbed chaos,
        # seed 0, that ended when a frozen stage-1 replica was resumed; docs/LOG.md)
        waited_on = [(first, peer)] + [
            (stage, p) for stage, c in enumerate(route, start=first + 1) for p in c
        ]

        async def probe() -> list[tuple[int, str]]:
            return await caller.silent_peers(waited_on, ping_timeout_s(times))

        hedge = None
        silent = await silent_while(call, check_after_s(times, wait_s), probe)
        if silent:
            call = asyncio.ensure_future(within_deadline(call, start_s + silent_deadline_s(times, wait_s)))
            hedge = self._hedge(message, n, wait_s, silent, first)
        if hedge is None:
            return self._finished(await call, [[peer], *route], n, time.monotonic() - start_s, first)
        copy, candidates, hedge_start_s = hedge
        hedge_won, reply = await first_success(call, copy)
        caller.hedges_won += hedge_won
        logger.info(
            "chain of %s: hedged after a silent peer; %s won",
            message.header["mb"],
            "the copy" if hedge_won else "the original",
        )
        if hedge_won:
            return self._finished(
                reply, candidates, n, time.monotonic() - hedge_start_s, first, observe=False
            )
        return self._finished(reply, [[peer], *route], n, time.monotonic() - start_s, first)

    def _hedge(self, message: Message, n: int, wait_s: float, silent: list[tuple[int, str]], first: int):
        """A copy of the chain that accumulates nothing, on a route around the silent peers (then
        treated as frozen); None when some stage has no other live peer (the original is waited for)."""
        route = [
            self.table.choose(stage, n, 0.0, exclude={p for s, p in silent if s == stage})
            for stage in range(first, self.num_stages)
        ]
        if any(peer is None for peer in route):
            return None
        self.caller.treat_as_frozen(silent)
        head, rest = route[0], [[peer] for peer in route[1:]]
        copy_message = chain_message(
            message.header["mb"],
            first,
            self.digest,
            self.codec,
            message.tensors["inputs"],
            message.tensors["labels"],
            rest,
            [False] * len(route),
            step=message.header.get("step"),
            timeout_s=message.header.get("timeout_s"),
        )
        self.caller.hedges += 1
        copy = asyncio.ensure_future(self.caller.client.call(head, copy_message, wait_s))
        return copy, [[head], *rest], time.monotonic()

    async def _route(self, n: int, first: int, head: str, charge: float = FORWARD_CHARGE) -> list[list[str]]:
        """For every stage after `first` (whose peer is `head`): the peer IWRR picks (charged `charge` for
        the micro-batch), then alternates in the order IWRR would pick them next (not charged). Peers the
        previous stage's chosen peer cannot hand off to (both behind NATs) are left out while another
        is available."""
        route, before = [], head
        for stage in range(first + 1, self.num_stages):
            unreachable = self._unreachable_from(stage, before)
            chosen = [await self.caller._pick(stage, n, charge, unreachable)]
            while len(chosen) <= ALTERNATES:
                other = self.table.choose(stage, n, 0.0, exclude=unreachable | set(chosen))
                if other is None:
                    break
                chosen.append(other)
            route.append(chosen)
            before = chosen[0]
        return route

    def _unreachable_from(self, stage: int, before: str) -> set[str]:
        """The available peers of `stage` that `before` (of the stage ahead) cannot hand off to, while
        some peer of `stage` can be reached; else none (a chain that cannot cross fails and is retried,
        and the trainer relays such boundaries when it plans a route: swarm_trainer `_direct_from`)."""
        if not self.table.behind_nat(stage - 1, before):  # the usual case: nothing to look up
            return set()
        available = set(self.table.available(stage))
        unreachable = {p for p in available if not self.table.can_hand_off(stage - 1, before, p)}
        return unreachable if available - unreachable else set()

    def _finished(
        self, reply, candidates: list[list[str]], n: int, call_s: float, first: int, observe: bool = True
    ):
        hops = validate_hops(reply.header, first, self.num_stages, candidates, n)
        loss = checked_loss(reply)
        for hop, service_s in zip(hops, hop_service_times(call_s, hops), strict=True):
            self.table.report(hop.stage, hop.peer, n, service_s, HOP_WEIGHT)
        head = hops[0]
        if observe:  # a hedge started late: its time is nobody's usual time
            self.caller.observe(first, "chain", head.peer, call_s)
        self.caller._time(first, "chain", call_s, {"server_s": head.server_s, "compute_s": head.compute_s})
        return loss, hops, reply.tensors.get("grad_inputs")


class _ChainPlan:
    """A chain (`ChainCaller.run`) for `run_call`: one stage-0 peer (or stage `first`'s) and a route
    chosen anew for every attempt. A failure's outcome says which stages may have applied the
    micro-batch (`flags_after`): the retry asks those not to accumulate again, and while any may hold
    it the retry is persistent; a chain whose later hop failed keeps its first peer."""

    def __init__(
        self,
        chain: ChainCaller,
        mb: str,
        step: int,
        n: int,
        inputs: EncodedTensor,
        labels: EncodedTensor,
        first: int,
    ) -> None:
        self.chain, self.mb, self.step, self.inputs, self.labels = chain, mb, step, inputs, labels
        self.stage, self.num_samples, self.weight, self.what = first, n, HOP_WEIGHT, f"chain of {mb}"
        self.flags = [True] * (chain.num_stages - first)
        self.budget_s = chain.caller.swarm.request_timeout_s * len(self.flags)  # every hop waits on the next
        self.route: list[list[str]] = []
        self.message: Message | None = None

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        chain, first = self.chain, self.stage
        peer = await chain.caller._pick(first, self.num_samples, FORWARD_CHARGE, excluded)
        self.route = await chain._route(self.num_samples, first, peer)
        self.message = chain_message(
            self.mb,
            first,
            chain.digest,
            chain.codec,
            self.inputs,
            self.labels,
            self.route,
            self.flags,
            step=self.step,
            timeout_s=self.budget_s,
        )
        wait_s = chain.caller.deadline_s(first, "chain", peer, self.budget_s)  # a frozen peer: given up early
        return Attempt(peer, wait_s, self.budget_s)

    async def send(self, attempt: Attempt) -> tuple[float, list[HopReport], EncodedTensor | None]:
        assert self.message is not None  # `choose` made it
        return await self.chain._attempt(
            self.message, attempt.peer, self.route, attempt, self.num_samples, self.stage
        )

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction:
        if isinstance(exc, ProtocolError):  # a malformed report: the chain may have run
            return FailureAction(Outcome.MAYBE_APPLIED)
        return frozen_or(on_request_failure(exc), isinstance(exc, SilentPastDeadline))  # raises bugs

    def retry_with(self, failure: FailureAction) -> None:
        flags = flags_after(self.flags, failure.outcome)
        self.chain.caller.not_accumulated += sum(a and not b for a, b in zip(self.flags, flags, strict=True))
        self.flags = flags

    def excludes(self, failure: FailureAction) -> bool:
        return failure.outcome is not Outcome.NEXT_FAILED

    def max_attempts(self) -> int:
        # while a stage may hold the micro-batch, stopping would leave the stages disagreeing
        return PERSISTENT_ATTEMPTS if not all(self.flags) else self.chain.caller.swarm.max_retries


class _EvaluationPlan:
    """A validation chain (`ChainCaller.evaluate`) for `run_call`: a stage peer and a route chosen anew
    for every attempt. Nothing accumulates, so any failure is retried as it is, on another first peer
    unless a later hop failed."""

    def __init__(
        self,
        chain: ChainCaller,
        mb: str,
        n: int,
        inputs: EncodedTensor,
        labels: EncodedTensor,
        first: int,
        step,
    ) -> None:
        self.chain, self.mb, self.inputs, self.labels, self.step = chain, mb, inputs, labels, step
        self.stage, self.num_samples, self.weight, self.what = first, n, FORWARD_WEIGHT, f"evaluation of {mb}"
        self.budget_s = chain.caller.swarm.request_timeout_s * (chain.num_stages - first)
        self.route: list[list[str]] = []

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        chain, first = self.chain, self.stage
        # charged as the relayed evaluation's calls are: a forward at every stage
        peer = await chain.caller._pick(first, self.num_samples, FORWARD_WEIGHT, excluded)
        self.route = await chain._route(self.num_samples, first, peer, charge=FORWARD_WEIGHT)
        return Attempt(peer, self.budget_s, self.budget_s)

    async def send(self, attempt: Attempt) -> float:
        chain = self.chain
        message = evaluate_chain_message(
            self.mb,
            self.stage,
            chain.digest,
            chain.codec,
            self.inputs,
            self.labels,
            self.route,
            step=self.step,
            timeout_s=self.budget_s,
        )
        return checked_loss(await chain.caller.client.call(attempt.peer, message, attempt.wait_s))

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction:
        if isinstance(exc, ProtocolError):  # a malformed reply: nothing was kept, ask again
            return FailureAction(Outcome.NEVER_RAN)
        return on_request_failure(exc)  # raises bugs

    def retry_with(self, failure: FailureAction) -> None:
        pass  # an evaluation is asked for again as it was

    def excludes(self, failure: FailureAction) -> bool:
        return failure.outcome is not Outcome.NEXT_FAILED

    def max_attempts(self) -> int:
        return self.chain.caller.swarm.max_retries
