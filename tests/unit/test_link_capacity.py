"""Link-aware capacity: the pure decision (planner/link_capacity.py), the busy clock that takes the union
of transfers' intervals (net/link_meter.py), and the windows a server reads its links' figures over
(runtime/server/capacity.LinkCapacityMeter)."""

import numpy as np
import pytest

from swarmtrain.net.link_meter import DOWN, UP, BusyClock, LinkMeter
from swarmtrain.planner.link_capacity import (
    Transfers,
    limited_capacity,
    limited_rates,
    link_rate_bytes_per_s,
    link_samples_per_s,
)
from swarmtrain.runtime.server.capacity import LinkCapacityMeter

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_slowest_resource_limits_and_an_unmeasured_link_limits_nothing():
    assert limited_capacity(100.0) == (100.0, "compute")
    assert limited_capacity(100.0, None, None) == (100.0, "compute")
    assert limited_capacity(100.0, 40.0, 60.0) == (40.0, "uplink")
    assert limited_capacity(100.0, None, 60.0) == (60.0, "downlink")
    assert limited_capacity(50.0, 50.0, 50.0) == (50.0, "compute")  # a link is named only when slower


def test_a_links_rate_is_the_larger_lower_bound_all_together_or_its_fastest_partner():
    # saturated: transfers overlap, the union is the window, all together give the link's rate
    assert link_rate_bytes_per_s(Transfers(10e6, 10.0), [Transfers(5e6, 10.0), Transfers(5e6, 10.0)]) == 1e6
    # one slow partner (0.1 MB/s) and one fast one (1 MB/s) one after the other: the mix reads 0.18 MB/s,
    # the link is at least as fast as the fast partner
    slow, fast = Transfers(1e6, 10.0), Transfers(1e6, 1.0)
    assert link_rate_bytes_per_s(Transfers(2e6, 11.0), [slow, fast]) == 1e6
    assert link_rate_bytes_per_s(Transfers(0, 0.0)) is None


def test_samples_per_second_of_a_link_and_the_simulators_element_wise_decision():
    assert link_samples_per_s(1e6, 4e3) == 250.0
    assert link_samples_per_s(1e6, 0.0) == float("inf")  # a sample that costs the direction nothing
    compute = np.array([[100.0, 100.0]])
    up = link_samples_per_s(np.array([[1e6, 1e6]]), np.array([[4e3, 0.0]]))
    assert up.tolist() == [[250.0, float("inf")]]
    assert limited_rates(compute, up, np.array([[50.0, 500.0]])).tolist() == [[50.0, 100.0]]
    # the same numbers through the scalar decision
    assert limited_capacity(100.0, 250.0, 50.0) == (50.0, "downlink")


def test_the_busy_clock_counts_overlapping_transfers_once():
    clock = FakeClock()
    busy = BusyClock(clock)
    busy.start()  # 0 .. 3
    clock.now_s = 1.0
    busy.start()  # 1 .. 2, inside the first
    clock.now_s = 2.0
    busy.stop()
    clock.now_s = 3.0
    busy.stop()
    clock.now_s = 5.0  # idle 3 .. 5
    busy.start()
    clock.now_s = 6.0
    assert busy.busy_s() == 4.0  # 3 s, then 1 s of the spell under way
    busy.stop()
    busy.stop()  # an unpaired stop does nothing
    clock.now_s = 9.0
    assert busy.busy_s() == 4.0


def test_the_meter_counts_per_partner_and_forgets_an_idle_partner_to_make_room(monkeypatch):
    from swarmtrain.net import link_meter

    monkeypatch.setattr(link_meter, "MAX_PARTNERS", 2)
    clock = FakeClock()
    meter = LinkMeter(clock)
    for name in ("a", "b", "c"):
        meter.started(UP, name)
        clock.now_s += 1.0
        meter.stopped(UP, name, 1000)
    totals = meter.totals(UP)
    assert (totals.bytes, totals.busy_s) == (3000, 3.0)
    assert totals.partners == {"b": (1000, 1.0), "c": (1000, 1.0)}
    assert meter.totals(DOWN).bytes == 0


def _serve_window(meter: LinkMeter, clock: FakeClock, partner: str, num_bytes: int, seconds: float) -> None:
    meter.started(DOWN, partner)
    clock.now_s += seconds
    meter.stopped(DOWN, partner, num_bytes)
    clock.now_s += seconds  # idle as long again: a light share of the link


def _read(meter: LinkMeter) -> dict:
    return {d: meter.totals(d) for d in (UP, DOWN)}


def test_a_server_reads_its_downlinks_samples_per_second_whatever_its_share():
    clock = FakeClock()
    meter = LinkMeter(clock)
    links = LinkCapacityMeter(min_samples=16, warmup_samples=8)
    samples = 0
    links.update(samples, _read(meter))
    _serve_window(meter, clock, "a", 10**6, 1.0)  # warm-up: not measured
    samples += 8
    links.update(samples, _read(meter))
    assert links.downlink_samples_per_s is None
    for _ in range(3):  # 8 samples of 4 kB each, at 32 kB/s while busy, busy half the time
        _serve_window(meter, clock, "a", 32_000, 1.0)
        samples += 8
        links.update(samples, _read(meter))
    assert links.downlink_samples_per_s == pytest.approx(8.0)  # 32 kB/s / 4 kB per sample
    assert links.uplink_samples_per_s is None  # nothing went up
    # twice the share of the same link: the same figure
    for _ in range(8):
        _serve_window(meter, clock, "a", 64_000, 2.0)
        samples += 16
        links.update(samples, _read(meter))
    assert links.downlink_samples_per_s == pytest.approx(8.0)


def test_a_spell_ends_when_the_kernel_saw_its_last_byte_not_when_a_busy_process_noticed():
    clock = FakeClock()
    busy = BusyClock(clock)
    busy.start()  # 0
    clock.now_s = 1.0
    busy.start()  # 1
    clock.now_s = 5.0  # the process noticed late: the kernel saw the first end at 2, the second at 3
    busy.stop(ended_s=2.0)
    busy.stop(ended_s=3.0)
    assert busy.busy_s() == 3.0
    busy.start()  # 5
    clock.now_s = 6.0
    busy.stop(ended_s=4.0)  # the data came before the process looked: no evidence of a slow link
    busy.start()
    clock.now_s = 7.0
    busy.stop(ended_s=9.0)  # a kernel time after now counts as now
    assert busy.busy_s() == 4.0


def test_a_call_to_a_fast_stage_mate_shows_the_link_is_not_what_slows_transfers_to_a_slow_stage():
    """A stage-0 server whose data-plane partners all sit behind slow links reads them as its own link;
    its gradient exchange with a stage-0 replica (a libp2p call) shows its link is fast."""
    clock = FakeClock()
    meter = LinkMeter(clock)
    links = LinkCapacityMeter()
    links.update(0, _read(meter))
    for _ in range(4):  # 8 samples of activations (128 kB) to the slow stage-1 server: 0.5 s each
        meter.started(UP, "slow")
        clock.now_s += 0.5
        meter.stopped(UP, "slow", 128_000)
    links.update(32, _read(meter))
    assert links.uplink_samples_per_s == pytest.approx(16.0)  # 256 kB/s / 16 kB per sample
    meter.call(UP, "mate", 400_000, 0.04)  # the step's gradient sums to a replica: 10 MB/s
    meter.call(UP, "mate", 1_000, 0.04)  # too small to time: no evidence
    totals = meter.totals(UP)
    assert totals.bytes == 4 * 128_000 and totals.busy_s == 2.0  # calls stay out of the union
    assert totals.partners["mate"] == (400_000, 0.04)
    for _ in range(4):
        meter.started(UP, "slow")
        clock.now_s += 0.5
        meter.stopped(UP, "slow", 128_000)
    links.update(64, _read(meter))
    # 10 MB/s over 16 kB per sample of data-plane traffic
    assert links.uplink_samples_per_s == pytest.approx(10e6 / 16_000)
