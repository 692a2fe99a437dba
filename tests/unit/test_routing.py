from collections import Counter

import pytest

from swarmtrain.planner.routing import BACKWARD_WEIGHT, StageRouter, can_hand_off, direct_from

pytestmark = pytest.mark.unit


def _dispatch(router, count, now_s=0.0, **kw):
    return Counter(router.choose(now_s, **kw) for _ in range(count))


def test_twice_as_fast_gets_twice_the_work():
    router = StageRouter()
    router.add_peer("fast", 20.0)
    router.add_peer("slow", 10.0)
    counts = _dispatch(router, 300)
    assert counts["fast"] == pytest.approx(200, abs=2) and counts["slow"] == pytest.approx(100, abs=2)


def test_measured_throughput_shifts_the_split():
    router = StageRouter(ema_alpha=1.0)
    router.add_peer("a", 10.0)
    router.add_peer("b", 10.0)
    router.report("b", num_samples=30, duration_s=1.0)  # b turns out 3x faster
    router.report("a", num_samples=10, duration_s=1.0)
    counts = _dispatch(router, 400)
    assert counts["b"] / counts["a"] == pytest.approx(3.0, rel=0.05)


def test_a_peer_that_announces_less_than_its_reports_show_gets_no_more_than_it_announced():
    """A hop's report times the peer's own work, not the slow link its activations crossed: a
    link-limited peer (announced 10 samples/s) reports like a fast one, and gets work by its capacity."""
    router = StageRouter(ema_alpha=1.0)
    for peer in ("fast", "behind_a_slow_link"):
        router.add_peer(peer, 100.0)
        router.report(peer, 8, 8 / 100.0, 3.0)  # forward and backward of 8 samples at 100 per s
    router.set_capacity("fast", 100.0)
    router.set_capacity("behind_a_slow_link", 10.0)
    counts = Counter(router.choose(0.0, 8, 3.0) for _ in range(110))
    assert counts == {"fast": 100, "behind_a_slow_link": 10}
    router.set_capacity("behind_a_slow_link", 0.0)  # no figure: the cap stands
    assert router.throughput("behind_a_slow_link") == pytest.approx(300.0)  # weighted: 3 per sample


def test_new_peer_enters_at_the_current_minimum():
    router = StageRouter()
    router.add_peer("a", 10.0)
    router.add_peer("b", 10.0)
    _dispatch(router, 50)
    minimum = min(router.virtual_finish_s("a"), router.virtual_finish_s("b"))
    router.add_peer("c", 10.0)
    assert router.virtual_finish_s("c") == minimum
    # it does not get a flood of work: the next 30 go round-robin-ish over all three
    counts = _dispatch(router, 30)
    assert max(counts.values()) - min(counts.values()) <= 2


def test_banned_and_excluded_peers_are_skipped_then_return():
    router = StageRouter()
    for peer in ("a", "b", "c"):
        router.add_peer(peer, 10.0)
    router.ban("b", until_s=5.0)
    counts = _dispatch(router, 40, now_s=1.0, exclude=["c"])
    assert set(counts) == {"a"}
    assert router.is_banned("b", 1.0) and not router.is_banned("b", 6.0)
    counts = _dispatch(router, 60, now_s=6.0)
    assert counts["b"] > 0 and counts["c"] > 0


def test_no_available_peer_returns_none():
    router = StageRouter()
    assert router.choose(0.0) is None
    router.add_peer("a", 1.0)
    router.ban("a", 10.0)
    assert router.choose(0.0) is None


def test_backward_weight_and_remove_peer():
    router = StageRouter()
    router.add_peer("a", 10.0)
    router.add_peer("b", 10.0)
    router.choose(0.0, num_samples=10, weight=BACKWARD_WEIGHT)
    assert max(router.virtual_finish_s(p) for p in router.peers) == pytest.approx(2.0)
    router.remove_peer("a")
    assert router.peers == ["b"]
    assert _dispatch(router, 3) == Counter({"b": 3})


def test_dispatch_is_deterministic():
    def run():
        router = StageRouter()
        for i, tput in enumerate([3.0, 5.0, 7.0, 5.0]):
            router.add_peer(f"p{i}", tput)
        return [router.choose(0.0) for _ in range(50)]

    assert run() == run()


@pytest.mark.parametrize(
    "direct, first",
    [
        ([], 0),
        ([True, True], 0),
        ([False], 1),  # the only boundary relayed: stage 1 is the last, so the whole route
        ([False, True], 1),
        ([True, False], 2),
        ([False, True, True, False], 4),  # the last boundary that cannot decides
    ],
)
def test_direct_hand_offs_start_after_the_last_boundary_that_cannot_hand_off(direct, first):
    assert direct_from(direct) == first


HOME_A = ["192.168.1.20", "203.0.113.9"]
HOME_A2 = ["192.168.1.31"]
HOME_B = ["10.0.0.5", "192.168.7.2"]
PUBLIC = ["203.0.113.7"]


def test_peers_hand_off_directly_unless_both_are_behind_nats_on_different_lans():
    assert can_hand_off((False, False), (PUBLIC, PUBLIC))
    assert can_hand_off((True, False), (HOME_A, PUBLIC)) and can_hand_off((False, True), (PUBLIC, HOME_A))
    assert not can_hand_off((True, True), (HOME_A, HOME_B))  # two homes
    assert can_hand_off((True, True), (HOME_A, HOME_A2))  # one home: same private /24
    # loopback, IPv6 and malformed addresses tell nothing about a LAN
    odd = ["127.0.0.1", "fd00::1", "999.1.1.1", ""]
    assert not can_hand_off((True, True), (odd, odd))
