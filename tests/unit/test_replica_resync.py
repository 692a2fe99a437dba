"""A replica that must resync after an outer round waits for the round's reference to publish the next
outer step (it may still be applying the round), and a replica at the run's end stays while another is
still behind its last round, so that one can download from it. Both gaps left the NAT client-mode
replica test on two models (2 of 20 runs): the resync gave up at once, and the donor had already left.

The peer's records, download and clocks are stubbed; the decisions are `ReplicaPeer`'s own code."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from swarmtrain.planner.download_deadline import DownloadRule
from swarmtrain.runtime.replica import replica_peer
from swarmtrain.runtime.replica.download_set_aside import DownloadSetAside
from swarmtrain.runtime.replica.replica_peer import ReplicaOptions, ReplicaPeer, ReplicaSummary

pytestmark = pytest.mark.unit


class StubPeer(ReplicaPeer):
    """`_resync` and `_serve_the_last_round` over scripted records: `timeline` is what `_others` returns
    on each call (its last entry from then on); a download succeeds from a record past our step."""

    def __init__(self, outer_step: int, timeline: list[dict[str, dict]]) -> None:  # no super(): no swarm
        self.outer = SimpleNamespace(outer_step=outer_step, anchor=[torch.zeros(4)])
        self.options, self.state_params = ReplicaOptions(), 4
        self.summary = ReplicaSummary(replica_id="me", shard="1/2")
        self.round_samples = 0
        self.timeline, self.calls, self.downloads, self.lefts = timeline, 0, 0, []
        self.set_aside = DownloadSetAside()

    def _others(self) -> dict[str, dict]:
        others = self.timeline[min(self.calls, len(self.timeline) - 1)]
        self.calls += 1
        return others

    def _download(self, reason: str, retry: bool = False, left_s: float = float("inf")) -> str:
        self.lefts.append(left_s)
        ahead = [v["outer_step"] for v in self.timeline[min(self.calls, len(self.timeline)) - 1].values()]
        if not any(step > self.outer.outer_step for step in ahead):
            return "failed"
        self.downloads += 1
        self.outer.outer_step = max(ahead)
        return "done"

    def _adopt_position(self, others) -> None:
        pass

    def _advertise_state(self) -> None:
        pass

    def publish(self) -> None:
        pass


def at(step: int) -> dict:
    return {"outer_step": step, "inner_step": 20 * step}


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(replica_peer, "PEER_POLL_S", 0.01)
    real_sleep = time.sleep
    monkeypatch.setattr(replica_peer.time, "sleep", lambda s: real_sleep(min(s, 0.01)))


def test_a_resync_waits_for_the_reference_still_applying_the_round():
    # the reference publishes outer step 2 only after applying round 1: three polls at 1 first
    peer = StubPeer(1, [{"ref": at(1)}] * 3 + [{"ref": at(2)}])
    peer._resync(1, "started outer step 1 from other weights than the group")
    assert peer.downloads == 1 and peer.outer.outer_step == 2
    assert peer.summary.round_outcomes == {"1": "resynced"}


def test_a_resync_with_nobody_at_or_past_the_round_goes_on_at_once():
    peer = StubPeer(1, [{"left_behind": at(0)}])
    start_s = time.monotonic()
    peer._resync(1, "the others are past outer step 1")
    assert peer.downloads == 0 and peer.outer.outer_step == 1
    assert peer.calls == 2  # one poll, then the position it trains on from
    assert time.monotonic() - start_s < 5.0  # not the download deadline


def test_a_resync_whose_downloads_keep_failing_ends_at_the_download_deadline():
    """A replica ahead that never delivers (its downloads fail) holds a resync only until the deadline
    of planner/download_deadline.py, under the replica's own rule (--state-download-base-s,
    --state-download-min-mbit: here 0.5 s in all), and each try is told the time left to it."""
    peer = StubPeer(1, [{"ahead": at(3)}])
    peer.options = ReplicaOptions(
        download_rule=DownloadRule(base_s=0.25, min_rate_bytes_per_s=1e12, max_donors=2)
    )
    peer._download = lambda reason, retry=False, left_s=float("inf"): peer.lefts.append(left_s) or "failed"
    start_s = time.monotonic()
    peer._resync(1, "started outer step 1 from other weights than the group")
    took_s = time.monotonic() - start_s
    assert 0.5 <= took_s < 0.5 + 0.2, took_s  # the deadline, plus one poll (0.01 s here) and the stubs
    assert peer.lefts and all(0 < left <= 0.5 for left in peer.lefts)
    assert peer.lefts == sorted(peer.lefts, reverse=True)


def test_a_resync_whose_donor_serves_a_state_it_refuses_goes_on_at_once():
    """The byzantine DiLoCo test's honest replica refused its only donor's state ("the donor's weights have
    norm 2.16e+04, ours 26.4") 144 times in a minute: hivemind serves the state of the highest sharing
    priority, the same donor's at every try. A refused state now ends the resync: it trains on."""
    peer = StubPeer(1, [{"byzantine": at(3)}])
    peer._download = lambda reason, retry=False, left_s=float("inf"): peer.lefts.append(left_s) or "refused"
    peer._resync(1, "started outer step 1 from other weights than the group")
    assert len(peer.lefts) == 1 and peer.outer.outer_step == 1
    assert peer.summary.round_outcomes == {"1": "resynced"}
    # every later round's resync asked once more (57 downloads in one run): the next 2 go on without a
    # download, then one tries, is refused again, and the next 4 go on without; a state loaded resets it
    downloads = []
    for k in range(2, 10):
        peer._resync(k, "the others are past")
        downloads.append(len(peer.lefts))
    assert downloads == [1, 1, 2, 2, 2, 2, 2, 3]
    peer._download = StubPeer._download.__get__(peer)
    assert peer.set_aside == DownloadSetAside(left=8, next_skip=16)
    peer.set_aside.left = 0
    peer._resync(10, "the others are past")
    assert peer.outer.outer_step == 3 and peer.set_aside == DownloadSetAside()


def test_the_last_rounds_reference_stays_until_the_replica_behind_caught_up():
    peer = StubPeer(2, [{"behind": at(1)}] * 4 + [{"behind": at(2)}])
    peer._serve_the_last_round(threading.Event())
    assert peer.calls == 5  # it left on the first poll that showed nobody behind


def test_a_replica_with_nobody_behind_leaves_at_once_and_a_stop_is_not_delayed(monkeypatch):
    peer = StubPeer(2, [{"equal": at(2)}])
    peer._serve_the_last_round(threading.Event())
    assert peer.calls == 1
    monkeypatch.setattr(replica_peer, "LINGER_S", 0.2)
    stalled = StubPeer(2, [{"behind": at(1)}])
    start_s = time.monotonic()
    stalled._serve_the_last_round(threading.Event())  # bounded by LINGER_S
    assert time.monotonic() - start_s < 5.0
    stopped, stop = StubPeer(2, [{"behind": at(1)}]), threading.Event()
    stop.set()
    stopped._serve_the_last_round(stop)
    assert stopped.calls == 0
