"""One compute thread per stage server: every tensor operation on the stage's parameters runs here.

Requests from the network (asyncio) and the synchronizer (optimizer steps) are queued by priority
(sync work first, then backward, then forward, then evaluation; FIFO within a priority). A single
thread means parameters never change under a running forward/backward and needs no locks around
the model. Requests whose caller has already timed out are dropped instead of computed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

PRIORITY_SYNC = 0
PRIORITY_BACKWARD = 1
PRIORITY_FORWARD = 2
PRIORITY_EVAL = 3


class DeadlineExpired(RuntimeError):
    """The request waited in the queue longer than its caller was willing to wait."""


class ComputeWorker:
    def __init__(self, name: str = "stage-compute", busy_clock: Callable[[], float] = time.thread_time) -> None:
        """`busy_clock`: differences around a job are the device's time on it (`model.device.busy_clock_s`:
        this thread's CPU time on CPU, wall time after a synchronize on CUDA)."""
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._stopped = threading.Event()
        self.busy_s = 0.0
        self.tasks_done = 0
        # the device's seconds of work per job priority (on CPU, thread time: exact whatever else the
        # machine does); what capacity is measured from (runtime/server/capacity.py)
        self.work_s_by_priority: dict[int, float] = {}
        self._busy_clock = busy_clock

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._queue.put((-1, next(self._order), None, None, None))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def queue_len(self) -> int:
        return self._queue.qsize()

    def submit(
        self, fn: Callable[[], Any], priority: int, deadline_s: float | None = None
    ) -> concurrent.futures.Future:
        """Run `fn` on the compute thread; `deadline_s` is a time.monotonic() value or None."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            future.set_exception(RuntimeError("compute worker stopped"))
            return future
        self._queue.put((priority, next(self._order), fn, future, deadline_s))
        return future

    async def run(self, fn: Callable[[], Any], priority: int, deadline_s: float | None = None) -> Any:
        return await asyncio.wrap_future(self.submit(fn, priority, deadline_s))

    def _loop(self) -> None:
        while not self._stopped.is_set():
            priority, _order, fn, future, deadline_s = self._queue.get()
            if fn is None:
                break
            if not future.set_running_or_notify_cancel():
                continue
            if deadline_s is not None and time.monotonic() > deadline_s:
                future.set_exception(DeadlineExpired("request expired in the queue"))
                continue
            start, start_work_s = time.perf_counter(), self._busy_clock()
            try:
                result, error = fn(), None
            except BaseException as exc:  # the caller decides; the thread must survive
                result, error = None, exc
            # counted before the caller sees the outcome: whoever counts the job's samples then finds
            # their CPU counted too (a window with samples and not their CPU read 5,556 samples per
            # CPU second for a 190 one, and the balancer planned a move back)
            self.busy_s += time.perf_counter() - start
            work_s = self._busy_clock() - start_work_s
            self.work_s_by_priority[priority] = self.work_s_by_priority.get(priority, 0.0) + work_s
            self.tasks_done += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        while True:  # fail whatever is left so no caller waits forever
            try:
                _p, _o, fn, future, _d = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None and not future.done():
                future.set_exception(RuntimeError("compute worker stopped"))
