"""A trainer's close is retried until it is delivered (`swarm_trainer.call_until_delivered`): a replica
that never gets its step's close cannot apply the step. A stage-1 server behind a NAT is reachable by the
trainer only once its relay is reserved, seconds after it announced itself; before, the one close of
step 0 was tried 3 times in about a second and the stage waited for good (tests/integration/test_nat.py)."""

import asyncio

import pytest

from swarmtrain.net.transport import RemoteError
from swarmtrain.runtime.trainer.swarm_trainer import call_until_delivered

pytestmark = pytest.mark.unit


class FlakyPeer:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures, self.calls = list(failures), 0

    async def call(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def _deliver(peer: FlakyPeer, retry_s: float = 5.0) -> tuple[int | None, list[tuple[str, int, bool]]]:
    heard: list[tuple[str, int, bool]] = []
    attempts = asyncio.run(
        call_until_delivered(
            peer.call, lambda exc, n, last: heard.append((type(exc).__name__, n, last)), retry_s
        )
    )
    return attempts, heard


def test_transport_failures_are_retried_until_the_close_is_delivered():
    peer = FlakyPeer([ConnectionError("failed to dial"), TimeoutError(), ConnectionError("no relay yet")])
    attempts, heard = _deliver(peer)
    assert attempts == 4 and peer.calls == 4
    assert heard == [("ConnectionError", 0, False), ("TimeoutError", 1, False), ("ConnectionError", 2, False)]


def test_an_error_answer_is_not_retried():
    peer = FlakyPeer([RemoteError("stale", "step 3 is applied here")])
    assert _deliver(peer) == (None, [("RemoteError", 0, True)])
    assert peer.calls == 1


def test_a_peer_that_stays_unreachable_is_given_up_on_after_the_retry_time():
    peer = FlakyPeer([ConnectionError()] * 100)
    attempts, heard = _deliver(peer, retry_s=1.0)
    # the trainer's backoff (0.1, 0.2, 0.4 s ..., with jitter): about 1 s of retries, then a last failure
    assert attempts is None and 2 <= peer.calls <= 5
    assert heard[-1][2] and not any(last for _, _, last in heard[:-1])
