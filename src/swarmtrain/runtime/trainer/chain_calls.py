"""A micro-batch through every stage by direct hand-off (net/hand_off.py): the trainer picks the route
(one peer per later stage by the routers' IWRR, plus untouched alternates), sends token ids, labels and
the route to a stage-0 peer, and gets back the loss and one report per stage.

Retries are a short loop around `on_request_failure` (net/failures.py, the table the relayed path
uses too): the failed call's outcome says which stages may have applied the micro-batch
(`flags_after`), the retry asks those not to accumulate again, and while any stage may hold it the
retry is persistent (giving up would leave the stages disagreeing on the step's batch), as the relayed
path's backward is. A stage-0 peer that is gone (or answers `digest_mismatch`) is banned; a chain whose
later hop failed is retried on a new route. A chain that runs past its stage-0 peer's usual time makes
the trainer ping every first-choice peer of its route; when one is silent (frozen), it is banned and the
chain is hedged on a new route that accumulates nothing, first answer wins (runtime/trainer/hedging.py).
"""

from __future__ import annotations

import asyncio
import math
import time

from swarmtrain.net.codec import EncodedTensor
from swarmtrain.net.failures import FailureAction, Outcome, flags_after, on_request_failure
from swarmtrain.net.hand_off import HopReport, chain_message, hop_service_times, validate_hops
from swarmtrain.net.protocol import Message, ProtocolError
from swarmtrain.planner.deadlines import check_after_s, ping_timeout_s
from swarmtrain.planner.routing import BACKWARD_WEIGHT, FORWARD_CHARGE, FORWARD_WEIGHT
from swarmtrain.runtime.trainer.hedging import first_success, silent_while
from swarmtrain.runtime.trainer.stage_calls import (
    PERSISTENT_ATTEMPTS,
    MicroBatchFailed,
    StageCaller,
    frozen_or,
    retry_delay_s,
)
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
        caller, flags = self.caller, [True] * (self.num_stages - first)
        budget_s = caller.swarm.request_timeout_s * len(flags)  # every hop waits on the next
        attempt, excluded, stale_from = 0, set[str](), set[str]()
        while True:
            peer = await caller._pick(first, n, FORWARD_CHARGE, excluded)
            route = await self._route(n, first, peer)
            message = chain_message(
                mb,
                first,
                self.digest,
                self.codec,
                inputs,
                labels,
                route,
                flags,
                step=step,
                timeout_s=budget_s,
            )
            wait_s = caller.deadline_s(first, "chain", peer, budget_s)  # a frozen peer: given up on early
            try:
                return await self._attempt(message, peer, route, wait_s, n, first)
            except ProtocolError as exc:  # a malformed report: the chain may have run
                failure, reason, error = FailureAction(Outcome.MAYBE_APPLIED), str(exc), exc
            except Exception as exc:
                failure, reason = frozen_or(on_request_failure(exc), wait_s < budget_s), f"{exc!r:.160}"
                error = exc
            self._count(failure, first, peer, n, budget_s)
            outcome = failure.outcome
            if outcome is Outcome.FATAL:
                raise MicroBatchFailed(f"stage {first} peer {peer} refused the chain of {mb}: {reason}")
            if caller.stale_everywhere(first, peer, error, stale_from):
                raise MicroBatchFailed(f"stage {first} applied the step of {mb} without it: {reason}")
            if outcome is not Outcome.NEXT_FAILED:
                excluded.add(peer)
            new_flags = flags_after(flags, outcome)
            caller.not_accumulated += sum(a and not b for a, b in zip(flags, new_flags, strict=True))
            flags, attempt = new_flags, attempt + 1
            # while a stage may hold the micro-batch, stopping would leave the stages disagreeing
            if attempt > (PERSISTENT_ATTEMPTS if not all(flags) else caller.swarm.max_retries):
                raise MicroBatchFailed(f"chain of {mb}: {attempt} attempts failed, last: {reason}")
            caller.retries += 1
            logger.info("chain of %s via %s failed (%s); retry %d", mb, peer[-8:], reason, attempt)
            await asyncio.sleep(retry_delay_s(attempt))

    async def _attempt(
        self, message: Message, peer: str, route: list[list[str]], wait_s: float, n: int, first: int
    ):
        """One chain from `peer` (stage `first`) along `route`, hedged on a new route when a peer of it
        is silent: (loss, hop reports, input gradient) of whichever answers first."""
        caller, start_s = self.caller, time.monotonic()
        call = asyncio.ensure_future(caller.client.call(peer, message, wait_s))
        times = caller.call_times.get((first, "chain", peer))
        waited_on = [(first, peer)] + [(stage, c[0]) for stage, c in enumerate(route, start=first + 1)]

        async def probe() -> list[tuple[int, str]]:
            return await caller.silent_peers(waited_on, ping_timeout_s(times))

        hedge = None
        silent = await silent_while(call, check_after_s(times, wait_s), probe)
        if silent:
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

    async def _route(self, n: int, first: int, head: str) -> list[list[str]]:
        """For every stage after `first` (whose peer is `head`): the peer IWRR picks (charged for the
        micro-batch), then alternates in the order IWRR would pick them next (not charged). Peers the
        previous stage's chosen peer cannot hand off to (both behind NATs) are left out while another
        is available."""
        route, before = [], head
        for stage in range(first + 1, self.num_stages):
            unreachable = self._unreachable_from(stage, before)
            chosen = [await self.caller._pick(stage, n, FORWARD_CHARGE, unreachable)]
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
        loss = reply.header.get("loss")
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise ProtocolError(f"a chain reply carries a bad loss {loss!r:.40}")
        for hop, service_s in zip(hops, hop_service_times(call_s, hops), strict=True):
            self.table.report(hop.stage, hop.peer, n, service_s, HOP_WEIGHT)
        head = hops[0]
        if observe:  # a hedge started late: its time is nobody's usual time
            self.caller.observe(first, "chain", head.peer, call_s)
        self.caller._time(first, "chain", call_s, {"server_s": head.server_s, "compute_s": head.compute_s})
        return float(loss), hops, reply.tensors.get("grad_inputs")

    def _count(self, failure: FailureAction, stage: int, peer: str, n: int, budget_s: float) -> None:
        """A gone first peer (or one serving another run) is banned; a silent one is charged the time
        it kept us waiting."""
        caller = self.caller
        if failure.outcome is Outcome.GONE:
            caller.connection_errors += 1
        if failure.ban:
            self.table.ban(stage, peer)
        if failure.timed_out:
            caller.timeouts += 1
            self.table.report(stage, peer, n, budget_s, HOP_WEIGHT)
