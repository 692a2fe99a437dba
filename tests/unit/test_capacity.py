"""A server's announced capacity counts only the work that comes with its samples, so replicas at any
share of the traffic announce the same figure (runtime/server/capacity.py)."""

import time

import pytest

from swarmtrain.runtime.server.capacity import BUSY_WINDOWS, CapacityMeter
from swarmtrain.runtime.server.compute import PRIORITY_BACKWARD, PRIORITY_SYNC, ComputeWorker

pytestmark = pytest.mark.unit

WORK_CPU_PER_SAMPLE_S = 0.01  # 100 samples per CPU second of work


def _feed(meter: CapacityMeter, load_samples_per_s: float, windows: int, totals: list) -> float:
    """`windows` announce periods of 2 s at a load; `totals` = [samples, work CPU seconds] so far."""
    for _ in range(windows):
        served = int(load_samples_per_s * 2)
        totals[0] += served
        totals[1] += served * WORK_CPU_PER_SAMPLE_S
        meter.update(*totals)
    return meter.samples_per_work_s


def test_a_lightly_and_a_heavily_loaded_server_announce_the_same_capacity():
    estimates = []
    for load in (4.0, 80.0):  # a replica among many on its stage, and the only one on its stage
        meter, totals = CapacityMeter(samples_per_work_s=50.0), [0, 0.0]
        meter.restart(*totals)
        _feed(meter, 0.0, 2, totals)  # before the trainer comes: the start figure stands
        assert meter.samples_per_work_s == 50.0
        estimates.append(_feed(meter, load, 30, totals))
    assert estimates == pytest.approx([100.0, 100.0], rel=1e-9)


def test_a_start_figure_off_by_10x_is_gone_after_the_first_busy_window():
    """Found live: start-up figures of identical servers read 33 to 506 samples/s; an EMA of weight 0.3
    still read half the truth after 6 windows, and the balancer's plan changed while it settled."""
    for start in (10.0, 1000.0):
        meter, totals = CapacityMeter(samples_per_work_s=start), [0, 0.0]
        meter.restart(*totals)
        assert _feed(meter, 40.0, 1, totals) == pytest.approx(100.0)


def test_windows_weigh_by_their_samples_and_old_ones_are_forgotten():
    meter, totals = CapacityMeter(samples_per_work_s=50.0), [0, 0.0]
    meter.restart(*totals)
    totals[:] = [1, 0.1]  # a window of one slow sample (a cold cache, a recomputation)
    meter.update(*totals)
    _feed(meter, 50.0, 1, totals)  # 100 samples at 100 per CPU second
    assert meter.samples_per_work_s == pytest.approx(101 / 1.1)
    _feed(meter, 50.0, BUSY_WINDOWS, totals)
    assert meter.samples_per_work_s == pytest.approx(100.0)
    # samples counted before their job's CPU (a job still running at the announcement): kept for later
    totals[0] += 10
    assert meter.update(*totals) == pytest.approx(100.0)
    totals[1] += 10 * WORK_CPU_PER_SAMPLE_S
    assert meter.update(*totals) == pytest.approx(100.0)


def test_the_compute_thread_counts_its_cpu_per_job_priority():
    """Thread time, not wall time: a job that sleeps costs nothing, one that spins costs its CPU."""
    worker = ComputeWorker()
    worker.start()
    try:
        worker.submit(lambda: time.sleep(0.2), PRIORITY_SYNC).result(5)

        def spin() -> None:
            end = time.thread_time() + 0.1
            while time.thread_time() < end:
                pass

        worker.submit(spin, PRIORITY_BACKWARD).result(5)
    finally:
        worker.stop()
    assert worker.work_s_by_priority[PRIORITY_SYNC] < 0.05
    assert 0.1 <= worker.work_s_by_priority[PRIORITY_BACKWARD] < 0.5
    assert worker.busy_s >= 0.3


def test_the_compute_thread_measures_work_with_the_devices_clock():
    """The work per job is read from the clock it is given (`model.device.busy_clock_s` of the serving
    device: on CUDA, wall time after a synchronize), not from the thread's CPU time."""
    ticks = iter(range(100))
    worker = ComputeWorker(busy_clock=lambda: float(next(ticks)))
    worker.start()
    try:
        worker.submit(lambda: None, PRIORITY_BACKWARD).result(5)
        worker.submit(lambda: None, PRIORITY_BACKWARD).result(5)
    finally:
        worker.stop()
    assert worker.work_s_by_priority[PRIORITY_BACKWARD] == 2.0  # one tick per job, whatever the CPU


def test_the_start_figure_stands_until_enough_samples_were_measured():
    """A moved server's first window held a micro-batch or two and read 5,556 samples per CPU second for
    a 190 one; the balancer planned moves back on it."""
    meter, totals = CapacityMeter(samples_per_work_s=190.0, min_samples=32), [0, 0.0]
    meter.restart(*totals)
    totals[:] = [8, 0.0014]
    assert meter.update(*totals) == 190.0
    totals[:] = [40, 0.0014 + 32 * WORK_CPU_PER_SAMPLE_S]
    assert meter.update(*totals) == pytest.approx(40 / totals[1])


def test_the_first_micro_batches_are_a_warm_up_and_not_measured():
    """A fresh stage's first micro-batches cost several times the CPU of later ones; counted, one
    stage-0 server's figure swung from 380 to 1,100 in the first seconds of traffic."""
    meter, totals = CapacityMeter(samples_per_work_s=50.0, warmup_samples=32), [0, 0.0]
    meter.restart(*totals)
    totals[:] = [16, 16 * 5 * WORK_CPU_PER_SAMPLE_S]  # slow, and not yet 32 samples: still warming up
    assert meter.update(*totals) == 50.0
    totals[:] = [32, totals[1] + 16 * 5 * WORK_CPU_PER_SAMPLE_S]
    assert meter.update(*totals) == 50.0  # warm from here
    assert _feed(meter, 40.0, 1, totals) == pytest.approx(100.0)
