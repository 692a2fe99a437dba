"""Deterministic fault injection (in the style of torchft's FailureInjector): schedule a failure at a
named point and assert what the real code does about it, without sleeps, sockets or SIGKILL.

    faults = FailureInjector()
    faults.fail_call("backward", mb="t.0-3", peer=A, error="timeout")  # micro-batch 3's backward on A
    faults.lose_grads(step=5, sender=A)                                # A's sums of step 5 never arrive
    caller = StageCaller(faults.wrap_client(client), ...)               # the trainer's real retry logic
    coordinator = StepCoordinator(..., faults.wrap_sender(A, send), ...)  # the stage's real exchange

Rules fire in order of registration, each `times` times (default once); `fired` lists what fired.
The client wrapper raises exactly what the transport raises for that failure, so the caller cannot
tell an injected fault from a real one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmtrain.runtime.server.sums_codec import WireSums

ERRORS = ("timeout", "connection", "refused", "truncated", "cut_after")


@dataclass
class _CallRule:
    kind: str
    peer: str | None
    mb: str | None
    step: int | None
    error: str
    times: int

    def matches(self, kind: str, peer: str, header: dict) -> bool:
        return (
            self.times > 0
            and self.kind == kind
            and self.peer in (None, peer)
            and self.mb in (None, header.get("mb"))
            and self.step in (None, header.get("step"))
        )


@dataclass
class _GradsRule:
    step: int
    sender: str
    receiver: str | None
    times: int


class FailureInjector:
    def __init__(self) -> None:
        self._calls: list[_CallRule] = []
        self._grads: list[_GradsRule] = []
        self.fired: list[tuple] = []

    # scheduling ---------------------------------------------------------------------------------
    def fail_call(
        self,
        kind: str,
        *,
        peer: str | None = None,
        mb: str | None = None,
        step: int | None = None,
        error: str = "timeout",
        times: int = 1,
    ) -> FailureInjector:
        """The next `times` RPCs of `kind` (to `peer`, for micro-batch `mb`, of `step`; None: any)
        fail with `error`: "timeout" (no answer in time), "connection" (the peer is gone), "refused"
        (the peer answers with an error), "truncated" (the reply is cut off before the peer got the
        request) or "cut_after" (the peer got the request and did its work; its reply is cut off)."""
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        self._calls.append(_CallRule(kind, peer, mb, step, error, times))
        return self

    def lose_grads(
        self, step: int, sender: str, receiver: str | None = None, times: int = 1
    ) -> FailureInjector:
        """`sender`'s gradient sums of `step` do not reach `receiver` (None: any replica), as when the
        member dies or its link breaks during the exchange."""
        self._grads.append(_GradsRule(step, sender, receiver, times))
        return self

    # wrappers -----------------------------------------------------------------------------------
    def wrap_client(self, client) -> _InjectedClient:
        """A StageClient whose `call` fails where a rule says, and otherwise calls `client`."""
        return _InjectedClient(self, client)

    def wrap_sender(
        self, me: str, send: Callable[[str, int, int, WireSums], Awaitable[bool]]
    ) -> Callable[[str, int, int, WireSums], Awaitable[bool]]:
        """A StepCoordinator `send_grads` that reports a lost send (False) where a rule says."""

        async def injected(peer: str, step: int, samples: int, sums: WireSums) -> bool:
            for rule in self._grads:
                if (
                    rule.times > 0
                    and rule.step == step
                    and rule.sender == me
                    and rule.receiver in (None, peer)
                ):
                    rule.times -= 1
                    self.fired.append(("lose_grads", step, me, peer))
                    return False
            return await send(peer, step, samples, sums)

        return injected

    def _call_failure(self, kind: str, peer: str, header: dict) -> tuple[Exception, bool] | None:
        """The exception a matching rule raises, and whether the call reaches the peer first."""
        for rule in self._calls:
            if rule.matches(kind, peer, header):
                rule.times -= 1
                self.fired.append(("fail_call", kind, peer, header.get("mb"), rule.error))
                return _exception(rule.error, kind, peer), rule.error == "cut_after"
        return None


def _exception(error: str, kind: str, peer: str) -> Exception:
    from swarmtrain.net.transport import RemoteError, TruncatedReply

    if error == "timeout":
        return TimeoutError(f"injected: {kind} to {peer} timed out")
    if error == "connection":
        return ConnectionRefusedError(f"injected: {peer} is gone")
    if error == "refused":
        return RemoteError("internal", f"injected: {peer} failed the {kind}")
    return TruncatedReply(f"injected: the reply of {peer} to {kind} was cut off")


class _InjectedClient:
    def __init__(self, injector: FailureInjector, client) -> None:
        self._injector, self._client = injector, client

    async def call(self, peer: str, message, timeout_s: float):
        failure = self._injector._call_failure(message.kind, peer, message.header)
        if failure is None:
            return await self._client.call(peer, message, timeout_s)
        exc, after = failure
        if after:  # the peer does the work; its reply is lost
            await self._client.call(peer, message, timeout_s)
        raise exc

    def __getattr__(self, name: str):  # connect, stats, ...: the real client's
        return getattr(self._client, name)
