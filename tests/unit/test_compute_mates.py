"""The compute queue's wait for announced mates (runtime/server/compute.py): an idle thread holding an
item that expects others of its key waits for them (up to `MATES_WAIT_S`) and runs them in one call; a
mate that never comes delays it by at most that wait; other queued work is never held up for them."""

import threading
import time

import pytest

from swarmtrain.runtime.server import compute as compute_module
from swarmtrain.runtime.server.compute import PRIORITY_BACKWARD, PRIORITY_FORWARD, BatchItem, ComputeWorker

pytestmark = pytest.mark.unit
HANG_GUARD_S = 20.0  # futures that never resolve fail the test instead of hanging it


def _item(name: str, key: str = "k", mates: int = 1, calls: list | None = None) -> BatchItem:
    def run_many(items):
        if calls is not None:
            calls.append(list(items))
        return [f"done {i}" for i in items]

    return BatchItem(key, 8, name, run_many, mates)


@pytest.fixture
def worker():
    compute = ComputeWorker(max_batch_tokens=64)
    compute.start()
    yield compute
    compute.stop()


def test_an_idle_thread_waits_for_the_announced_mates_and_runs_them_in_one_call(worker, monkeypatch):
    monkeypatch.setattr(compute_module, "MATES_WAIT_S", HANG_GUARD_S)  # only their arrival ends the wait
    calls: list = []
    first = worker.submit(None, PRIORITY_FORWARD, batch=_item("a", mates=3, calls=calls))
    time.sleep(0.05)  # the thread has taken "a" and waits
    rest = [worker.submit(None, PRIORITY_FORWARD, batch=_item(n, mates=3, calls=calls)) for n in "bc"]
    results = [f.result(timeout=HANG_GUARD_S)[0] for f in [first, *rest]]
    assert results == ["done a", "done b", "done c"]
    assert calls == [["a", "b", "c"]] and worker.calls == 1


def test_a_mate_that_never_comes_delays_the_call_by_the_wait_only(worker, monkeypatch):
    monkeypatch.setattr(compute_module, "MATES_WAIT_S", 0.05)
    calls: list = []
    alone = worker.submit(None, PRIORITY_FORWARD, batch=_item("a", mates=2, calls=calls))
    assert alone.result(timeout=HANG_GUARD_S)[0] == "done a" and calls == [["a"]]


def test_other_queued_work_is_never_held_up_for_mates(worker, monkeypatch):
    monkeypatch.setattr(compute_module, "MATES_WAIT_S", 3600.0)  # a wait would outlast the hang guard
    gate = threading.Event()
    blocker = worker.submit(lambda: gate.wait(HANG_GUARD_S), 0)
    # queued behind the blocker: "a" (taken first, a backward) expects a mate; "b" of another key waits
    expecting = worker.submit(None, PRIORITY_BACKWARD, batch=_item("a", mates=2))
    other = worker.submit(None, PRIORITY_FORWARD, batch=_item("b", key="other"))
    gate.set()
    blocker.result(timeout=HANG_GUARD_S)
    assert expecting.result(timeout=HANG_GUARD_S)[0] == "done a"
    assert other.result(timeout=HANG_GUARD_S)[0] == "done b"
