"""The sending half of the overlap (issue 53 item 2) and a server's default torch threads.

On CUDA a stage server's reply is encoded on a side stream behind the compute stream and its payload's
copy to the host started there (net/codec.encode_behind, net/device_bytes.start_download); the compute
thread goes on, and its send thread waits for that copy's event before the caller sees the reply
(runtime/server/stage_replies.py, runtime/server/compute.py's `finish`). On CPU nothing of that runs:
the bytes and the code path are today's.

CPU tests here: the CPU path gives the reference bytes; the download bookkeeping (a pinned buffer lent to
one copy at a time, given back only once its bytes were read, or once its download is dropped unread; the
event waited on before reading) against fake buffers and events; the per-device maps' keys; the compute
thread's send thread, stopping included; `server_threads`. The `gpu` tests (skipped
without CUDA) check on a device that the overlapped bytes are the host's, that a result encoded behind is
not corrupted by the next job's compute, that buffers are not reused too early, and that neither the
compute thread nor its busy clock waits for the copy.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import pytest
import torch
from test_codec_device import FLOAT_CODECS, activations

from swarmtrain.model.device import CPU_FP32, ComputeDevice, busy_clock_s, resolve_device, server_threads
from swarmtrain.net import codec, device_bytes
from swarmtrain.net.protocol import Message, StageRequest, make_message, pack
from swarmtrain.runtime.server.compute import PRIORITY_FORWARD, BatchItem, ComputeWorker
from swarmtrain.runtime.server.stage_replies import PendingReply, Replies, finished
from swarmtrain.runtime.server.stage_service import compute_thread
from swarmtrain.runtime.server.stage_worker import StageWorker

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

HANG_GUARD_S = 20.0  # a future or event that never comes fails the test instead of hanging it
DETERMINISTIC = FLOAT_CODECS


# the CPU path is today's ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_encoding_behind_on_the_host_is_the_reference_encoding(name):
    values = activations().view(50, 100)
    behind = codec.encode_behind(values, name)
    assert isinstance(behind, codec.EncodedTensor) and behind == codec.encode(values, name)
    ids = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert codec.encode_behind(ids, name) == codec.encode(ids, "none")


def test_the_reference_8bit_bytes_are_unchanged():
    """The payload `encode` writes (after its split into `_payload` and a download) is the documented one."""
    values = activations(1000)
    blocks = [values[i : i + codec.BLOCK_SIZE] for i in range(0, 1000, codec.BLOCK_SIZE)]
    absmax = torch.stack([b.abs().max() for b in blocks])
    codes = torch.cat([(b * (127.0 / m)).round() for b, m in zip(blocks, absmax, strict=True)])
    expected = (absmax / 127.0).numpy().tobytes() + codes.to(torch.int8).numpy().tobytes()
    assert codec.encode(values, "8bit").payload == expected
    assert codec.encode(torch.empty(0, 3), "8bit").payload == b""


@pytest.mark.parametrize("name", ["none", "8bit", "4bit-rht"])
def test_replies_on_the_host_are_the_messages_make_message_makes(name):
    """`Replies.result` with or without `overlap` on CPU: a complete Message, packed to the same bytes."""
    outputs, grads = activations(seed=1).view(5, 1000), activations(seed=2).view(5, 1000)
    header = {"mb": "m1", "acc": 5}
    reference = pack(make_message("result", header, {"outputs": outputs}, name))
    for overlap in (False, True):
        reply = Replies(CPU_FP32, overlap).result(header, {"outputs": outputs}, name)
        assert isinstance(reply, Message) and pack(reply) == reference
    bf16 = Replies(ComputeDevice(torch.device("cpu"), "bf16"), True)
    reply = bf16.result(header, {"grad_inputs": grads.bfloat16()}, "8bit")  # cast back to fp32 first
    assert reply.tensors["grad_inputs"].dtype == "float32"


def _middle_stage(cfg):
    cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, num_stages=3))
    return cfg, cfg.stages()[1]


def test_a_worker_asked_to_overlap_sends_on_the_host_replies_byte_for_byte_as_before(tiny_cfg):
    cfg, spec = _middle_stage(tiny_cfg)
    plain, overlapped = StageWorker(cfg, spec), StageWorker(cfg, spec, overlap_sends=True)
    assert not overlapped.replies.overlap  # on CPU there is nothing to overlap
    assert compute_thread(overlapped, 0)._finish is None  # nor anything left to finish
    shape = (4, cfg.model.seq_len, cfg.model.wire_dim)
    generator = torch.Generator().manual_seed(3)
    x, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    forward = StageRequest("forward", "m1", "8bit", x, step=0)
    assert pack(overlapped.forward(forward)) == pack(plain.forward(forward))
    backward = StageRequest("backward", "m1", "4bit", x, grad_outputs=grad, step=0)
    sent = overlapped.backward(backward)
    assert isinstance(sent, Message) and "grad_inputs" in sent.tensors
    # stochastic rounding: the same descriptors and sizes (the bytes differ by the random draws)
    assert len(pack(sent)) == len(pack(plain.backward(backward)))


# downloads: buffers lent to one copy at a time, the event waited on before reading ----------------------
class _FakeEvent:
    """A copy's event: the copied bytes land in the buffer only when the event is waited on (as a DMA's
    could land any time before), so reading before waiting reads what was there."""

    def __init__(self) -> None:
        self.landing: tuple | None = None  # (buffer, bytes) the copy recorded behind will write
        self.waits = 0

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.landing is None

    def synchronize(self) -> None:
        self.waits += 1
        if self.landing is not None:
            buffer, data = self.landing
            buffer[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self.landing = None


class _FakeBuffer:
    def __init__(self, size: int) -> None:
        self.size = size

    def numel(self) -> int:
        return self.size


def test_a_pool_lends_a_buffer_to_one_copy_at_a_time_and_grows_it():
    made: list[_FakeBuffer] = []

    def new_buffer(size: int) -> _FakeBuffer:
        made.append(_FakeBuffer(size))
        return made[-1]

    pool = device_bytes.StagingPool(new_buffer, _FakeEvent, keep=2)
    first, second = pool.lend(100), pool.lend(100)
    assert first[0] is not second[0] and pool.lent == 2  # both copies pending: two buffers
    pool.give_back(*first)
    assert pool.lend(60)[0] is first[0]  # read: lent again, whatever smaller size comes
    pool.give_back(*second)
    grown = pool.lend(150)
    assert grown[0] is not second[0] and grown[0].size == 200  # twice the one let go
    pool.give_back(*grown)
    assert pool.lend(150)[0] is grown[0]
    assert len(made) == 3 and pool.lent == 2
    for buffer in made:
        pool.give_back(buffer, _FakeEvent())
    assert len(pool._idle) == 2  # at most `keep` idle ones are held


def test_a_pool_shared_by_threads_never_lends_one_buffer_twice():
    pool = device_bytes.StagingPool(_FakeBuffer, _FakeEvent)
    held: set[int] = set()
    lock, clashes = threading.Lock(), []

    def borrow() -> None:
        for size in range(1, 300):
            buffer, event = pool.lend(size)
            with lock:
                clashes.append(id(buffer) in held)
                held.add(id(buffer))
            with lock:
                held.discard(id(buffer))
            pool.give_back(buffer, event)

    threads = [threading.Thread(target=borrow) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not any(clashes) and pool.lent == 0


def _fake_start(monkeypatch) -> device_bytes.StagingPool:
    """`start_download` on CPU tensors: a pool of plain host buffers whose events hold the copy back."""
    pool = device_bytes.StagingPool(lambda size: torch.zeros(size, dtype=torch.uint8), _FakeEvent)
    monkeypatch.setattr(device_bytes, "_pool", lambda device: pool)
    monkeypatch.setattr(device_bytes, "copy_stream", lambda device: ("stream of", device))
    real_lend = pool.lend

    def lend(size: int):
        buffer, event = real_lend(size)
        saved = buffer.clone()
        event.landing = (buffer, None)  # set below, once the copy has been made

        def record(stream) -> None:
            assert stream == ("stream of", torch.device("cpu"))  # the copy's device's, where it was queued
            event.landing = (buffer, bytes(buffer[:size].numpy()))  # what was copied
            buffer.copy_(saved)  # not there before the event passes

        event.record = record
        return buffer, event

    monkeypatch.setattr(pool, "lend", lend)
    return pool


def test_a_download_waits_for_its_copy_then_gives_its_buffer_back(monkeypatch):
    pool = _fake_start(monkeypatch)
    a = device_bytes.start_download(torch.full((64,), 7, dtype=torch.uint8))
    b = device_bytes.start_download(torch.full((32,), 9, dtype=torch.uint8))
    assert pool.lent == 2 and not a.done()
    assert b.result() == bytes([9]) * 32 and pool.lent == 1  # read: its buffer is back
    assert a.result() == bytes([7]) * 64 and a.result() == bytes([7]) * 64 and a.done()
    assert pool.lent == 0  # given back once, however often the bytes are asked for
    c = device_bytes.start_download(torch.full((40,), 3, dtype=torch.uint8))
    assert c.result() == bytes([3]) * 40  # a buffer lent again carries the new copy's bytes


def test_a_download_dropped_unread_gives_its_buffer_back(monkeypatch):
    pool = _fake_start(monkeypatch)
    copied, pending = (device_bytes.start_download(torch.full((64,), i, dtype=torch.uint8)) for i in (1, 2))
    copied._event.synchronize()  # this copy has run; the other has not
    assert pool.lent == 2
    del copied, pending
    gc.collect()
    assert pool.lent == 0
    assert len(pool._idle) == 1  # the copied one is lent again; the one a copy may still write is let go
    again = device_bytes.start_download(torch.full((64,), 5, dtype=torch.uint8))
    assert again.result() == bytes([5]) * 64 and pool.lent == 0


def test_a_batch_failing_after_its_replies_were_started_gives_their_buffers_back(monkeypatch):
    pool = _fake_start(monkeypatch)

    def run_many(items):
        started = [device_bytes.start_download(torch.full((8,), 1, dtype=torch.uint8)) for _ in items]
        assert len(started) == len(items)
        raise RuntimeError("the batch failed after making its replies")

    worker = _started(finish=finished, max_batch_tokens=64)
    future = worker.submit(None, PRIORITY_FORWARD, batch=BatchItem("k", 8, "x", run_many))
    with pytest.raises(RuntimeError, match="after making its replies"):
        future.result(HANG_GUARD_S)
    worker.stop()
    del future  # its error's traceback held the replies made
    gc.collect()
    assert pool.lent == 0


def test_a_pending_reply_finishes_to_the_reference_message(monkeypatch):
    """What the send thread makes of a reply whose payloads were still copying: the Message
    `make_message` makes, packed to the same bytes, tensors in order."""
    _fake_start(monkeypatch)
    tensors = {"grad_inputs": activations(seed=4).view(10, 500), "outputs": activations(seed=5)}
    pending = {}
    for name, tensor in tensors.items():
        applied, payload = codec._payload(tensor, "8bit", False)
        download = device_bytes.start_download(payload)
        pending[name] = codec.PendingTensor(applied, "float32", tuple(tensor.shape), download)
    reply = PendingReply("result", {"mb": "m2"}, pending)
    assert pack(reply.finished()) == pack(make_message("result", {"mb": "m2"}, tensors, "8bit"))
    assert finished(reply).tensors.keys() == tensors.keys()
    message, error = Message("result", {"mb": "m3"}), ValueError("refused")
    assert finished(message) is message and finished(error) is error and finished(3) == 3


# the compute thread's send thread ----------------------------------------------------------------------
def _started(**kwargs) -> ComputeWorker:
    worker = ComputeWorker(**kwargs)
    worker.start()
    return worker


def test_the_compute_thread_takes_its_next_job_while_an_outcome_is_finished():
    next_job_ran, finishing = threading.Event(), []

    def finish(outcome):
        if outcome == "a":  # a download still running: held until the next job has run
            finishing.append(next_job_ran.wait(HANG_GUARD_S))
        return f"{outcome} finished on {threading.current_thread().name}"

    worker = _started(finish=finish)
    try:
        first = worker.submit(lambda: "a", PRIORITY_FORWARD)
        second = worker.submit(lambda: next_job_ran.set() or "b", PRIORITY_FORWARD)
        assert first.result(HANG_GUARD_S) == "a finished on stage-compute-send"
        assert second.result(HANG_GUARD_S) == "b finished on stage-compute-send"
        assert finishing == [True]  # the compute thread did not wait for the first outcome's finish
    finally:
        worker.stop()


def test_finished_outcomes_reach_their_callers_in_job_order_errors_included():
    order: list[str] = []

    def finish(outcome):
        if outcome == "bad":
            raise RuntimeError("the copy failed")
        order.append(outcome)
        return outcome.upper()

    worker = _started(finish=finish, max_batch_tokens=64)
    try:
        futures = [worker.submit(lambda n=n: n, PRIORITY_FORWARD) for n in ("a", "bad", "c")]
        item = BatchItem("k", 8, "d", lambda items: [f"{i}" for i in items])
        futures.append(worker.submit(None, PRIORITY_FORWARD, batch=item))
        failing = worker.submit(lambda: 1 / 0, PRIORITY_FORWARD)  # the job's own error is not finished
        assert futures[0].result(HANG_GUARD_S) == "A" and futures[2].result(HANG_GUARD_S) == "C"
        with pytest.raises(RuntimeError, match="the copy failed"):
            futures[1].result(HANG_GUARD_S)
        outcome, share_s = futures[3].result(HANG_GUARD_S)
        assert outcome == "D" and share_s >= 0
        with pytest.raises(ZeroDivisionError):
            failing.result(HANG_GUARD_S)
        assert order == ["a", "c", "d"]
    finally:
        worker.stop()


def test_without_finish_outcomes_are_handed_over_by_the_compute_thread_as_before():
    worker = _started()
    try:
        name = worker.submit(lambda: threading.current_thread().name, PRIORITY_FORWARD)
        assert name.result(HANG_GUARD_S) == "stage-compute"
        assert not worker._sender.is_alive()  # no send thread was started
    finally:
        worker.stop()


def test_stopping_delivers_the_outcomes_of_the_jobs_that_ran():
    started = threading.Event()

    def finish(outcome):
        worker._stopped.wait(HANG_GUARD_S)  # a copy still running when stop is called
        return outcome

    worker = _started(finish=finish)
    future = worker.submit(lambda: started.set() or "ran", PRIORITY_FORWARD)
    assert started.wait(HANG_GUARD_S)  # taken before the stop marker: it runs, whatever the machine's load
    worker.stop()  # its outcome is held on the send thread until now
    assert future.result(HANG_GUARD_S) == "ran"
    worker._sender.join(HANG_GUARD_S)
    assert not worker._sender.is_alive()


def test_a_job_still_running_when_stop_gives_up_waiting_still_reaches_its_caller():
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        release.wait(HANG_GUARD_S)
        return "late"

    worker = _started(finish=lambda outcome: f"{outcome} finished")
    future = worker.submit(job, PRIORITY_FORWARD)
    queued = worker.submit(lambda: "never run", PRIORITY_FORWARD)
    assert started.wait(HANG_GUARD_S)
    worker.stop(timeout_s=0.01)  # returns with the job still running
    assert worker._thread.is_alive() and not future.done()
    release.set()
    assert future.result(HANG_GUARD_S) == "late finished"  # the send thread waited for it
    with pytest.raises(RuntimeError, match="compute worker stopped"):
        queued.result(HANG_GUARD_S)
    worker._thread.join(HANG_GUARD_S)
    worker._sender.join(HANG_GUARD_S)
    assert not worker._thread.is_alive() and not worker._sender.is_alive()


def test_a_jobs_seconds_include_what_its_busy_clock_waited_for():
    """On CUDA a job's call only queues its kernels, and the busy clock's reading at its end waits for
    them: the job's seconds (a reply's `compute_s`) are read after that, so they include them."""
    readings: list[float] = []

    def clock() -> float:
        if len(readings) % 2 == 1:  # the reading at the job's end: the device finishes the job meanwhile
            time.sleep(0.05)
        readings.append(time.perf_counter())
        return readings[-1]

    worker = _started(busy_clock=clock, max_batch_tokens=64)
    try:
        item = BatchItem("k", 8, "x", lambda items: list(items))
        outcome, share_s = worker.submit(None, PRIORITY_FORWARD, batch=item).result(HANG_GUARD_S)
        assert outcome == "x" and share_s >= 0.05 and worker.busy_s >= 0.05
        assert worker.work_s_by_priority[PRIORITY_FORWARD] >= 0.05
    finally:
        worker.stop()


# a server's default threads ------------------------------------------------------------------------------
def test_a_cpu_server_keeps_one_thread_and_a_cuda_server_takes_a_few():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device name: nothing touches CUDA
    assert [server_threads(cpu, cores) for cores in (1, 2, 64, None)] == [1, 1, 1, 1]
    assert [server_threads(cuda, cores) for cores in (1, 2, 4, 16, 128)] == [1, 2, 4, 4, 4]
    assert 1 <= server_threads(cuda) <= 4


def test_the_server_threads_flag_defaults_by_device_and_says_so(capsys):
    from swarmtrain.cli.main import build_parser, main

    argv = ["server", "--preset", "tiny", "--stage", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert build_parser().parse_args(argv).threads is None
    assert build_parser().parse_args([*argv, "--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        main(["server", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 1 on CPU" in text and "on CUDA min(4, this process's cores)" in text
    with pytest.raises(SystemExit):
        main(["replica", "--help"])
    assert "default: torch's choice, one per core" in " ".join(capsys.readouterr().out.split())
    # a trainer computes no model: a couple of threads, not torch's one per core beside the servers
    trainer = ["trainer", "--preset", "tiny", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert build_parser().parse_args(trainer).threads == 2
    assert build_parser().parse_args([*trainer, "--threads", "1"]).threads == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args([*trainer, "--threads", "0"])


# per-device maps ----------------------------------------------------------------------------------------------
def test_device_keys_name_a_cuda_device_by_its_index(monkeypatch):
    """`cuda` and `cuda:N` (N the current device) get one side stream and one staging pool: tensors on it
    say `cuda:N`. Nothing here touches CUDA (the current device is faked)."""
    cpu = torch.device("cpu")
    assert device_bytes.device_key(cpu) is cpu and device_bytes.device_key(torch.device("meta")).index is None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert device_bytes.device_key(torch.device("cuda")) == torch.device("cuda", 2)
    assert device_bytes.device_key(torch.device("cuda", 1)) == torch.device("cuda", 1)  # kept as it is
    monkeypatch.setattr(device_bytes, "_pools", {})
    shared = device_bytes._pool(torch.device("cuda"))
    assert device_bytes._pool(torch.device("cuda", 2)) is shared
    assert device_bytes._pool(torch.device("cuda", 1)) is not shared


# on a GPU (skipped without one; not run when this was written) -------------------------------------------
def _delay_side_stream(device: torch.device, cycles: int = 200_000_000) -> None:
    """Queue ~0.1 s of sleep on this thread's side stream, so what `encode_behind` queues there next
    waits while the current stream goes on."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep")
    with torch.cuda.stream(device_bytes._side(device)):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_on_cuda_a_reply_encoded_behind_has_the_host_bytes(name):
    device = resolve_device("cuda")  # as a server makes it: cuda:N
    values = activations().view(50, 100)
    behind = codec.encode_behind(values.to(device), name)
    assert isinstance(behind, codec.PendingTensor)
    assert behind.result() == codec.encode(values, name)
    ids = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert codec.encode_behind(ids.to(device), name).result() == codec.encode(ids, name)


@pytest.mark.gpu
def test_on_cuda_a_result_encoded_behind_is_not_corrupted_by_the_next_jobs_compute():
    """The result's memory goes back to the allocator as soon as the compute thread drops it; the next
    job's allocations of its size, written at once on the current stream, must not get it before the
    side stream (delayed here) has encoded it."""
    device = resolve_device("cuda")  # as a server makes it: cuda:N
    host = activations(1 << 20, seed=6)
    expected = codec.encode(host, "8bit")
    for _ in range(3):
        _delay_side_stream(device)
        result = host.to(device) * 1.0  # computed on the current stream
        pending = codec.encode_behind(result, "8bit")
        del result
        overwrites = [torch.full((1 << 20,), float("nan"), device=device) for _ in range(8)]
        assert not pending.download.done()  # the encoding was still waiting: the race was on
        assert pending.result() == expected
        del overwrites


@pytest.mark.gpu
def test_on_cuda_staging_buffers_are_not_reused_before_their_bytes_are_read(monkeypatch):
    device = resolve_device("cuda")  # as a server makes it: cuda:N
    pool = device_bytes._pool(device)
    lent_before = pool.lent
    _delay_side_stream(device)
    payloads = [torch.full((100_000 + i,), i, dtype=torch.uint8, device=device) for i in range(6)]
    side = device_bytes._side(device)
    side.wait_stream(torch.cuda.current_stream(device))  # the payloads are made before they are copied
    with torch.cuda.stream(side):
        downloads = [device_bytes.start_download(p) for p in payloads]
    assert pool.lent == lent_before + 6 and not downloads[0].done()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the whole device was waited on"))
    for i, download in enumerate(downloads):  # each pending at once: one buffer each, or bytes would mix
        assert download.result() == bytes([i]) * (100_000 + i)
    assert pool.lent == lent_before
    again = device_bytes.start_download(torch.full((100_003,), 42, dtype=torch.uint8, device=device))
    assert again.result() == bytes([42]) * 100_003  # a buffer lent again holds the new bytes


@pytest.mark.gpu
def test_on_cuda_neither_the_compute_thread_nor_its_busy_clock_waits_for_the_copy():
    device = resolve_device("cuda")  # as a server makes it: cuda:N
    values = activations(1 << 16, seed=7)
    _delay_side_stream(device)
    pending = codec.encode_behind(values.to(device), "8bit")
    busy_clock_s(device)  # the compute thread's clock at the job's end: its current stream only
    assert not pending.download.done()  # still behind the side stream's sleep
    assert pending.result() == codec.encode(values, "8bit") and pending.download.done()


@pytest.mark.gpu
def test_on_cuda_a_server_reply_sent_through_the_send_thread_is_the_plain_one(tiny_cfg):
    device = ComputeDevice.from_names("cuda")  # as a server makes it
    cfg, spec = _middle_stage(tiny_cfg)
    plain = StageWorker(cfg, spec, compute=device)
    overlapped = StageWorker(cfg, spec, compute=device, overlap_sends=True)
    worker = compute_thread(overlapped, 0)
    worker.start()
    try:
        x = torch.randn(4, cfg.model.seq_len, cfg.model.wire_dim, generator=torch.Generator().manual_seed(8))
        for mb in ("m1", "m2", "m3"):
            request = StageRequest("forward", mb, "8bit", x.to(device.device), step=0)
            assert isinstance(overlapped.forward(request), PendingReply)
            sent = worker.submit(lambda r=request: overlapped.forward(r), PRIORITY_FORWARD)
            assert pack(sent.result(HANG_GUARD_S)) == pack(plain.forward(request))
    finally:
        worker.stop()


@pytest.mark.gpu
def test_on_cuda_a_device_named_without_its_index_is_the_current_one():
    named, indexed = torch.device("cuda"), resolve_device("cuda")
    assert device_bytes.device_key(named) == indexed == torch.device("cuda", torch.cuda.current_device())
    assert device_bytes._side(named) is device_bytes._side(indexed)
    assert device_bytes._pool(named) is device_bytes._pool(indexed)
    assert ComputeDevice(named).to_device(torch.ones(3, device=indexed)).device == indexed  # not pinned
    assert ComputeDevice(named).to_device(torch.ones(3)).device == indexed


@pytest.mark.gpu
def test_on_cuda_an_empty_reply_tensor_takes_no_staging_buffer():
    device = resolve_device("cuda")
    pool = device_bytes._pool(device)
    lent_before = pool.lent
    for name in ("none", "8bit", "4bit-rht"):
        empty = codec.encode_behind(torch.empty(0, 7, device=device), name)
        assert empty == codec.encode(torch.empty(0, 7), name) and empty.payload == b""
        assert pool.lent == lent_before
