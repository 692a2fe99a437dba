"""A micro-batch through every stage by direct hand-off (net/hand_off.py): the trainer picks the route
(one peer per later stage by the routers' IWRR, plus untouched alternates), sends token ids, labels and
the route to a stage-0 peer, and gets back the loss and one report per stage.

Retries follow the one call policy of the trainer (runtime/trainer/call_policy.py, with the relayed
path; peers are chosen and their answers recorded through its `PeerChoice`): the failed call's outcome says which stages may have applied the micro-batch (`flags_after`),
the retry asks those not to accumulate again, and while any stage may hold it the retry is persistent
(giving up would leave the stages disagreeing on the step's batch), as the relayed path's backward is. A stage-0 peer that is gone (or answers `digest_mismatch`) is banned; a chain whose
later hop failed is retried on a new route. A chain that runs past its stage-0 peer's usual time makes
the trainer ping every first-choice peer of its route; when one is silent (frozen), it is banned and the
chain is hedged on a new route that accumulates nothing, first answer wins (runtime/trainer/hedging.py's
`Hedger`, as a relayed call is).
"""

from __future__ import annotations

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
from swarmtrain.net.token_ids import IDS
from swarmtrain.planner.routing import BACKWARD_WEIGHT, FORWARD_CHARGE, FORWARD_WEIGHT
from swarmtrain.runtime.trainer.call_policy import PERSISTENT_ATTEMPTS, Attempt, frozen_or, run_call
from swarmtrain.runtime.trainer.hedging import Copy, Pair, SilentPastDeadline
from swarmtrain.runtime.trainer.stage_calls import StageCaller
from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

ALTERNATES = 2  # peers after the chosen one in a route entry: a hop tries them when its next hop fails
HOP_WEIGHT = FORWARD_WEIGHT + BACKWARD_WEIGHT  # a hop's report covers its forward and its backward

ChainAnswer = tuple[float, list[HopReport], EncodedTensor | None]


class ChainCaller:
    """Chains, through the relayed calls' client, counters, peer choice and hedging (`StageCaller`)."""

    def __init__(self, caller: StageCaller, num_stages: int, digest: str, codec: str) -> None:
        self.caller, self.num_stages, self.digest, self.codec = caller, num_stages, digest, codec
        self.client, self.peers, self.stats = caller.client, caller.peers, caller.stats
        self.hedger, self.table = caller.hedger, caller.table

    async def run(
        self,
        mb: str,
        step: int,
        n: int,
        inputs: EncodedTensor,
        labels: EncodedTensor,
        first: int = 0,
        ids: EncodedTensor | None = None,
    ) -> ChainAnswer:
        """The micro-batch's loss, every stage's report from `first` on (the first stage's peer's first)
        and the gradient of `first`'s inputs (None at stage 0). `inputs`: what stage `first` takes (token
        ids at stage 0; the trainer relayed the stages before it); `ids`: the token ids a stage after a
        subspace boundary takes beside them (net/token_ids.py)."""
        plan = _ChainPlan(self, mb, step, n, inputs, (labels, ids), first)
        return await run_call(self.peers, self.stats, plan)

    async def evaluate(
        self,
        mb: str,
        n: int,
        inputs: EncodedTensor,
        labels: EncodedTensor,
        first: int,
        step,
        ids: EncodedTensor | None = None,
    ) -> float:
        """A validation micro-batch's loss, handed from stage `first` to the last along a route as training
        micro-batches are (`evaluate_chain`); `step`: the parameter version every stage must have."""
        plan = _EvaluationPlan(self, mb, n, inputs, (labels, ids), first, step)
        return await run_call(self.peers, self.stats, plan)

    async def _attempt(
        self, message: Message, peer: str, route: list[list[str]], attempt: Attempt, n: int, first: int
    ) -> ChainAnswer:
        """One chain from `peer` (stage `first`) along `route`, hedged on a new route when a peer of it
        is silent (`Hedger`): (loss, hop reports, input gradient) of whichever answers first."""
        start_s = time.monotonic()
        # every peer of the route, alternates too: a hop that failed over to a frozen alternate keeps the
        # chain waiting while the peers we would otherwise ping answer, and the wait past the deadline
        # is only for chains whose peers all answer
        waited_on = [(first, peer)] + [
            (stage, p) for stage, c in enumerate(route, start=first + 1) for p in c
        ]
        hedge: list[tuple[list[list[str]], float]] = []  # the copy's route and when it was sent

        def copy_around(silent: list[Pair]) -> Copy[Message] | None:
            made = self._copy(message, n, attempt.wait_s, silent, first)
            if made is None:
                return None
            hedge.append((made[1], time.monotonic()))
            return made[0]

        copy, reply = await self.hedger.call(
            self.client.call(peer, message, attempt.cap_s),
            attempt,
            self.peers.times(first, "chain", peer),
            waited_on,
            copy_around,
            f"chain of {message.header['mb']}",
        )
        if copy is not None:  # a hedge started late: its time is nobody's usual time
            candidates, sent_s = hedge[0]
            return self._finished(reply, candidates, n, time.monotonic() - sent_s, first, observe=False)
        return self._finished(reply, [[peer], *route], n, time.monotonic() - start_s, first)

    def _copy(
        self, message: Message, n: int, wait_s: float, silent: list[Pair], first: int
    ) -> tuple[Copy[Message], list[list[str]]] | None:
        """A copy of the chain that accumulates nothing, on a route around the silent peers, and that
        route (its first peer's entry first); None when some stage has no other live peer (the original
        is waited for)."""
        route = [
            self.peers.spare(stage, n, 0.0, {p for s, p in silent if s == stage})
            for stage in range(first, self.num_stages)
        ]
        if any(peer is None for peer in route):
            return None
        head, rest = str(route[0]), [[str(peer)] for peer in route[1:]]
        copy_message = chain_message(
            message.header["mb"],
            first,
            self.digest,
            self.codec,
            message.tensors["inputs"],
            message.tensors["labels"],
            rest,
            [False] * len(route),
            ids=message.tensors.get(IDS),
            step=message.header.get("step"),
            timeout_s=message.header.get("timeout_s"),
        )
        return Copy(head, self.client.call(head, copy_message, wait_s)), [[head], *rest]

    async def _route(self, n: int, first: int, head: str, charge: float = FORWARD_CHARGE) -> list[list[str]]:
        """For every stage after `first` (whose peer is `head`): the peer IWRR picks (charged `charge` for
        the micro-batch), then alternates in the order IWRR would pick them next (not charged). Peers the
        previous stage's chosen peer cannot hand off to (both behind NATs) are left out while another
        is available."""
        route, before = [], head
        for stage in range(first + 1, self.num_stages):
            unreachable = self._unreachable_from(stage, before)
            chosen = [await self.peers.pick(stage, n, charge, unreachable)]
            while len(chosen) <= ALTERNATES:
                other = self.peers.spare(stage, n, 0.0, unreachable | set(chosen))
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
        self,
        reply: Message,
        candidates: list[list[str]],
        n: int,
        call_s: float,
        first: int,
        observe: bool = True,
    ) -> ChainAnswer:
        hops = validate_hops(reply.header, first, self.num_stages, candidates, n)
        loss = checked_loss(reply)
        for hop, service_s in zip(hops, hop_service_times(call_s, hops), strict=True):
            self.peers.report(hop.stage, hop.peer, n, service_s, HOP_WEIGHT)
        head = hops[0]
        if observe:  # a hedge started late: its time is nobody's usual time
            self.peers.observe(first, "chain", head.peer, call_s)
        self.peers.record_timing(
            first, "chain", call_s, {"server_s": head.server_s, "compute_s": head.compute_s}
        )
        return loss, hops, reply.tensors.get("grad_inputs")


class _ChainPlan:
    """A chain (`ChainCaller.run`) for `run_call`: one stage-0 peer (or stage `first`'s) and a route
    chosen anew for every attempt. A failure's outcome says which stages may have applied the
    micro-batch (`flags_after`): the retry asks those not to accumulate again, and while any may hold
    it the retry is persistent; a chain whose later hop failed keeps its first peer."""

    log_every_retry = True

    def __init__(
        self,
        chain: ChainCaller,
        mb: str,
        step: int,
        n: int,
        inputs: EncodedTensor,
        tokens: tuple[EncodedTensor, EncodedTensor | None],
        first: int,
    ) -> None:
        """`tokens`: the labels, and the token ids a stage after a subspace boundary takes (or None)."""
        self.chain, self.mb, self.step, self.inputs = chain, mb, step, inputs
        self.labels, self.ids = tokens
        self.stage, self.num_samples, self.weight, self.what = first, n, HOP_WEIGHT, f"chain of {mb}"
        self.flags = [True] * (chain.num_stages - first)
        self.budget_s = chain.caller.swarm.request_timeout_s * len(self.flags)  # every hop waits on the next
        self.route: list[list[str]] = []
        self.message: Message | None = None

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        chain, first = self.chain, self.stage
        peer = await chain.peers.pick(first, self.num_samples, FORWARD_CHARGE, excluded)
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
            ids=self.ids,
            step=self.step,
            timeout_s=self.budget_s,
        )
        wait_s = chain.peers.deadline_s(first, "chain", peer, self.budget_s)  # a frozen peer: given up early
        return Attempt(peer, wait_s, self.budget_s)

    async def send(self, attempt: Attempt) -> ChainAnswer:
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
        self.chain.stats.not_accumulated += sum(a and not b for a, b in zip(self.flags, flags, strict=True))
        self.flags = flags

    def excludes(self, failure: FailureAction) -> bool:
        return failure.outcome is not Outcome.NEXT_FAILED

    def out_of_retries(self, attempt: int, delay_s: float) -> bool:
        # while a stage may hold the micro-batch, stopping would leave the stages disagreeing
        return attempt > (PERSISTENT_ATTEMPTS if not all(self.flags) else self.chain.caller.swarm.max_retries)


class _EvaluationPlan:
    """A validation chain (`ChainCaller.evaluate`) for `run_call`: a stage peer and a route chosen anew
    for every attempt. Nothing accumulates, so any failure is retried as it is, on another first peer
    unless a later hop failed."""

    log_every_retry = True

    def __init__(
        self,
        chain: ChainCaller,
        mb: str,
        n: int,
        inputs: EncodedTensor,
        tokens: tuple[EncodedTensor, EncodedTensor | None],
        first: int,
        step,
    ) -> None:
        """`tokens`: the labels, and the token ids a stage after a subspace boundary takes (or None)."""
        self.chain, self.mb, self.inputs, self.step = chain, mb, inputs, step
        self.labels, self.ids = tokens
        self.stage, self.num_samples, self.weight, self.what = first, n, FORWARD_WEIGHT, f"evaluation of {mb}"
        self.budget_s = chain.caller.swarm.request_timeout_s * (chain.num_stages - first)
        self.route: list[list[str]] = []

    async def choose(self, attempt: int, excluded: set[str]) -> Attempt:
        chain, first = self.chain, self.stage
        # charged as the relayed evaluation's calls are: a forward at every stage
        peer = await chain.peers.pick(first, self.num_samples, FORWARD_WEIGHT, excluded)
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
            ids=self.ids,
            step=self.step,
            timeout_s=self.budget_s,
        )
        return checked_loss(await chain.client.call(attempt.peer, message, attempt.wait_s))

    def classify(self, exc: BaseException, attempt: Attempt) -> FailureAction:
        if isinstance(exc, ProtocolError):  # a malformed reply: nothing was kept, ask again
            return FailureAction(Outcome.NEVER_RAN)
        return on_request_failure(exc)  # raises bugs

    def retry_with(self, failure: FailureAction) -> None:
        pass  # an evaluation is asked for again as it was

    def excludes(self, failure: FailureAction) -> bool:
        return failure.outcome is not Outcome.NEXT_FAILED

    def out_of_retries(self, attempt: int, delay_s: float) -> bool:
        return attempt > self.chain.caller.swarm.max_retries
