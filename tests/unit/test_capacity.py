"""A server's announced capacity leaves its idle baseline out (runtime/server/capacity.py)."""

import pytest

from swarmtrain.runtime.server.capacity import MIN_WORK_SHARE, CapacityMeter

pytestmark = pytest.mark.unit

IDLE_CPU_PER_S = 0.07
WORK_CPU_PER_SAMPLE_S = 0.01  # 100 samples per CPU second of work


def _feed(meter: CapacityMeter, load_samples_per_s: float, windows: int, clock: list) -> float:
    for _ in range(windows):
        wall, cpu, samples = clock
        samples_now = samples + int(load_samples_per_s * 2)
        cpu_now = cpu + 2 * IDLE_CPU_PER_S + (samples_now - samples) * WORK_CPU_PER_SAMPLE_S
        clock[:] = [wall + 2.0, cpu_now, samples_now]
        meter.update(*clock)
    return meter.samples_per_cpu_s


def test_a_lightly_and_a_heavily_loaded_server_announce_the_same_capacity():
    estimates = []
    for load in (10.0, 80.0):  # a replica among many on its stage, and the only one on its stage
        meter, clock = CapacityMeter(samples_per_cpu_s=50.0), [0.0, 0.0, 0]
        meter.restart(*clock)
        _feed(meter, 0.0, 2, clock)  # before the trainer comes
        estimates.append(_feed(meter, load, 30, clock))
    assert estimates == pytest.approx([100.0, 100.0], rel=0.02)
    # counting the baseline as work, the lightly loaded one read 59 samples per CPU second
    naive = 10.0 / (IDLE_CPU_PER_S + 10.0 * WORK_CPU_PER_SAMPLE_S)
    assert naive < 0.6 * estimates[0]


def test_without_an_idle_window_it_counts_every_cpu_second_and_never_less_than_a_share():
    meter, clock = CapacityMeter(samples_per_cpu_s=50.0), [0.0, 0.0, 0]
    meter.restart(*clock)
    assert _feed(meter, 10.0, 30, clock) == pytest.approx(10.0 / (IDLE_CPU_PER_S + 0.1), rel=0.02)
    meter.idle_cpu_per_s = 5.0  # an absurd baseline (e.g. measured during a download) cannot inflate it
    bounded = 10.0 / (IDLE_CPU_PER_S + 0.1) / MIN_WORK_SHARE
    assert _feed(meter, 10.0, 30, clock) == pytest.approx(bounded, rel=0.02)


def test_a_start_figure_off_by_10x_is_gone_after_the_first_busy_window():
    """Found live: start-up figures of identical servers read 33 to 506 samples/s; an EMA of weight 0.3
    still read half the truth after 6 windows, and the balancer's plan changed while it settled."""
    for start in (10.0, 1000.0):
        meter, clock = CapacityMeter(samples_per_cpu_s=start), [0.0, 0.0, 0]
        meter.restart(*clock)
        _feed(meter, 0.0, 2, clock)
        assert _feed(meter, 40.0, 1, clock) == pytest.approx(100.0, rel=0.02)
