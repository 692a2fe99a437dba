"""One compute thread per stage server: every tensor operation on the stage's parameters runs here.

Requests from the network (asyncio) and the synchronizer (optimizer steps) are queued by priority
(sync work first, then backward, then forward, then evaluation; FIFO within a priority). A single
thread means parameters never change under a running forward/backward and needs no locks around
the model. Requests whose caller has already timed out are dropped instead of computed.

Request batching (`max_batch_tokens` > 0): a job submitted as a `BatchItem` carries a key; when the
thread takes one, it also takes the queued items with the same key (same kind and step), oldest first,
up to `max_batch_tokens` tokens, and runs them as one call of their `run_many`, whose results go back to
each caller. On a small micro-batch the per-call cost (Python, dispatch, kernel launches) is most of
the work, so several trainers' micro-batches in one call serve more samples per second. Requests known
to arrive together (a bundle's items, a batched forward's backwards coming back in one reply) reach the
queue a few callbacks apart, and an idle thread would start the first alone: an item names how many
`mates` it expects, and a thread with nothing else queued waits up to `MATES_WAIT_S` for them.

Finishing (`finish`, a CUDA server's): a job may return before its outcome is complete (a reply whose
payloads are still being copied to the host, runtime/server/stage_replies.py). Its outcomes then go to a
second thread, `<name>-send`, which finishes them and hands them to their callers in the order the jobs
ran, while the compute thread takes its next job. Without `finish` (CPU) the compute thread hands its
outcomes over itself, as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

PRIORITY_SYNC = 0
PRIORITY_BACKWARD = 1
PRIORITY_FORWARD = 2
PRIORITY_EVAL = 3
MATES_WAIT_S = 0.002  # the longest an idle thread waits for the announced mates of a batch item


class DeadlineExpired(RuntimeError):
    """The request waited in the queue longer than its caller was willing to wait."""


@dataclass(frozen=True)
class BatchItem:
    """One request that may share a call with queued requests of the same `key`.

    `run_many(items)` computes a list of items (same key, in queue order) and returns one outcome per
    item, in order: a result, or the exception that item's caller gets."""

    key: Hashable
    tokens: int
    item: Any
    run_many: Callable[[list[Any]], Sequence[Any]]
    mates: int = 1  # requests of this key (this one included) known to be arriving together


@dataclass(order=True)
class _Job:
    priority: int
    order: int
    fn: Callable[[], Any] | None = field(compare=False)
    future: concurrent.futures.Future | None = field(compare=False)
    deadline_s: float | None = field(compare=False)
    batch: BatchItem | None = field(compare=False, default=None)


class ComputeWorker:
    def __init__(
        self,
        name: str = "stage-compute",
        busy_clock: Callable[[], float] = time.thread_time,
        max_batch_tokens: int = 0,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        """`busy_clock`: differences around a job are the device's time on it (`model.device.busy_clock_s`:
        this thread's CPU time on CPU, wall time after synchronizing its current stream on CUDA).
        `max_batch_tokens`: the most tokens one batched call takes (0: every request runs alone).
        `finish(outcome)`: what the caller gets for an outcome, computed on the send thread (None: the
        outcome, from this thread)."""
        self._heap: list[_Job] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._finish = finish
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()  # ran jobs, for the send thread
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._stopped = threading.Event()
        self._busy_clock = busy_clock
        self.max_batch_tokens = max_batch_tokens
        self.busy_s = 0.0
        self.tasks_done = 0
        self.calls = 0  # calls made: tasks_done - calls requests shared a call with another
        # the device's seconds of work per job priority (on CPU, thread time: exact whatever else the
        # machine does); what capacity is measured from (runtime/server/capacity.py)
        self.work_s_by_priority: dict[int, float] = {}

    def start(self) -> None:
        self._thread.start()
        if self._finish is not None:
            self._sender.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking jobs: the queued ones fail, the running one finishes. Waits up to `timeout_s` for
        each thread; a job still running then goes on, and its outcome still reaches its caller (the
        compute thread ends the send thread's queue only after its last job's outcomes)."""
        self._stopped.set()
        self._push(_Job(-1, next(self._order), None, None, None))
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._sender.is_alive():
            self._sender.join(timeout_s)

    @property
    def queue_len(self) -> int:
        with self._ready:
            return len(self._heap)

    def submit(
        self,
        fn: Callable[[], Any] | None,
        priority: int,
        deadline_s: float | None = None,
        batch: BatchItem | None = None,
    ) -> concurrent.futures.Future:
        """Run `fn` (or, for a `batch` item, its `run_many`) on the compute thread; `deadline_s` is a
        time.monotonic() value or None. A batch item's future gives (outcome, its share of the call's
        seconds)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            future.set_exception(RuntimeError("compute worker stopped"))
            return future
        self._push(_Job(priority, next(self._order), fn, future, deadline_s, batch))
        return future

    async def run(self, fn: Callable[[], Any], priority: int, deadline_s: float | None = None) -> Any:
        return await asyncio.wrap_future(self.submit(fn, priority, deadline_s))

    async def run_batchable(
        self, item: BatchItem, priority: int, deadline_s: float | None = None
    ) -> tuple[Any, float]:
        """(outcome, seconds of the call in proportion to this item's tokens)."""
        return await asyncio.wrap_future(self.submit(None, priority, deadline_s, item))

    def _push(self, job: _Job) -> None:
        with self._ready:
            heapq.heappush(self._heap, job)
            self._ready.notify()

    def _take(self) -> list[_Job]:
        """The next job, and the queued jobs that may share its call (same batch key, oldest first)."""
        with self._ready:
            while not self._heap:
                self._ready.wait()
            first = heapq.heappop(self._heap)
            if first.batch is None or self.max_batch_tokens <= 0:
                return [first]
            taken, deadline_s = self._with_mates(first), time.monotonic() + MATES_WAIT_S
            while self._awaits_mates(first, taken) and (left_s := deadline_s - time.monotonic()) > 0:
                self._ready.wait(left_s)  # releases the lock: the mates can be pushed meanwhile
                taken = self._with_mates(first)
            if len(taken) > 1:
                chosen = {id(j) for j in taken}
                self._heap = [j for j in self._heap if id(j) not in chosen]
                heapq.heapify(self._heap)
            return taken

    def _with_mates(self, first: _Job) -> list[_Job]:
        """`first` and the queued jobs of its key, oldest first, within the token bound."""
        assert first.batch is not None
        key, tokens = first.batch.key, first.batch.tokens
        taken = [first]
        for job in sorted(j for j in self._heap if j.batch is not None and j.batch.key == key):
            assert job.batch is not None
            if tokens + job.batch.tokens > self.max_batch_tokens:
                break
            tokens += job.batch.tokens
            taken.append(job)
        return taken

    def _awaits_mates(self, first: _Job, taken: list[_Job]) -> bool:
        """Fewer than `first`'s announced mates are here, another would fit, and nothing else waits."""
        assert first.batch is not None
        tokens = sum(j.batch.tokens for j in taken if j.batch is not None)
        return (
            len(taken) < first.batch.mates
            and tokens + first.batch.tokens <= self.max_batch_tokens
            and len(taken) - 1 == len(self._heap)
        )

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                jobs = [j for j in self._take() if self._runnable(j)]
                if any(j.fn is None and j.batch is None for j in jobs):
                    break
                if jobs:
                    self._run(jobs)
            self._fail_queued()
        finally:  # after the outcomes of every job that ran: their callers still get them
            self._outbox.put(None)

    def _runnable(self, job: _Job) -> bool:
        """Claims the job's future (False: cancelled, or expired in the queue and failed)."""
        if job.future is None:
            return True  # the stop marker
        if not job.future.set_running_or_notify_cancel():
            return False
        if job.deadline_s is not None and time.monotonic() > job.deadline_s:
            job.future.set_exception(DeadlineExpired("request expired in the queue"))
            return False
        return True

    def _run(self, jobs: list[_Job]) -> None:
        start, start_work_s = time.perf_counter(), self._busy_clock()
        try:
            outcomes, error = self._call(jobs), None
        except BaseException as exc:  # the caller decides; the thread must survive
            outcomes, error = None, exc
        # counted before the callers see the outcome: whoever counts the job's samples then finds its
        # work counted too (a window with samples and not their CPU read 5,556 samples per CPU second
        # for a 190 one, and the balancer planned a move back)
        work_s = self._busy_clock() - start_work_s
        # read after the busy clock: on CUDA it waited for the job's kernels, which the call only queued
        # (its replies' encoding and copy to the host, on a side stream, are not waited for)
        elapsed_s = time.perf_counter() - start
        self.busy_s += elapsed_s
        priority = jobs[0].priority
        self.work_s_by_priority[priority] = self.work_s_by_priority.get(priority, 0.0) + work_s
        self.tasks_done += len(jobs)
        self.calls += 1
        if self._finish is None:
            self._hand_over(jobs, outcomes, error, elapsed_s)
        else:  # the next job starts now; the send thread finishes these outcomes meanwhile
            self._outbox.put((jobs, outcomes, error, elapsed_s))

    def _send_loop(self) -> None:
        while (ran := self._outbox.get()) is not None:
            self._hand_over(*ran)

    def _hand_over(
        self, jobs: list[_Job], outcomes: Sequence[Any] | None, error: BaseException | None, elapsed_s: float
    ) -> None:
        """Each job's outcome (finished, with `finish`) or the error to its caller."""
        total_tokens = sum(j.batch.tokens for j in jobs if j.batch is not None) or 1
        for i, job in enumerate(jobs):
            assert job.future is not None
            if error is not None:
                job.future.set_exception(error)
                continue
            assert outcomes is not None
            outcome = outcomes[i]
            if self._finish is not None and not isinstance(outcome, BaseException):
                try:
                    outcome = self._finish(outcome)
                except Exception as exc:  # this caller's failure; the others' outcomes still go
                    outcome = exc
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            elif job.batch is None:
                job.future.set_result(outcome)
            else:
                job.future.set_result((outcome, elapsed_s * job.batch.tokens / total_tokens))

    @staticmethod
    def _call(jobs: list[_Job]) -> Sequence[Any]:
        first = jobs[0]
        if first.batch is None:
            assert first.fn is not None
            return [first.fn()]
        outcomes = first.batch.run_many([j.batch.item for j in jobs if j.batch is not None])
        if len(outcomes) != len(jobs):
            raise RuntimeError(f"a batched call returned {len(outcomes)} outcomes for {len(jobs)} requests")
        return outcomes

    def _fail_queued(self) -> None:
        """Fail whatever is left so no caller waits forever."""
        with self._ready:
            left, self._heap = self._heap, []
        for job in left:
            if job.future is not None and not job.future.done():
                job.future.set_exception(RuntimeError("compute worker stopped"))
