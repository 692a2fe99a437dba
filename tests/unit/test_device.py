"""Where a peer computes and in what precision (model/device.py): `--device` names, autocast, host copies,
fp32 master weights under bf16, fp16's loss scaler, stage servers in bf16, the busy clock.

Device-aware tests run once per entry of `DEVICES`: on CPU here, and on CUDA where torch sees a device
(the `gpu` parametrizations are collected everywhere and skipped, listed, without one: tests/conftest.py).

Tolerances (bf16 against fp32 on the same weights and samples; bf16 keeps 8 mantissa bits, ~0.4%):
- `train-local`, 16 optimizer steps of `tiny`: final validation loss within 3% (measured on CPU: 0.1%);
- one micro-batch through 2 `StageWorker`s: loss within 1% (measured: 0.001%), stage 0's outputs
  within 2% in relative L2 norm (measured: 0.2%), every accumulated gradient sum within 5% in
  relative L2 norm (measured: 0.7% at most).
"""

import dataclasses
import io
import threading
import time
import types

import pytest
import torch

from swarmtrain.cli.main import main
from swarmtrain.config.errors import UserError
from swarmtrain.model.device import CPU_FP32, ComputeDevice, DeviceError, busy_clock_s, resolve_device
from swarmtrain.net import codec
from swarmtrain.net.protocol import StageRequest
from swarmtrain.runtime.local import LocalTrainer
from swarmtrain.runtime.server.stage_worker import StageWorker
from swarmtrain.runtime.server.sums_codec import SumsCodec

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HAS_CUDA = torch.cuda.is_available()

TRAIN_SAMPLES = 512  # 16 optimizer steps of tiny's global batch of 32
# fp16 on the CPU is emulated (~25 ms a sample): 8 steps learn enough for its check (the loss falls by 1.62
# on the CPU, 2.70 after 16 steps; the check asks for 1.0)
FP16_TRAIN_SAMPLES = 256
VAL_LOSS_RTOL = 0.03
STAGE_LOSS_RTOL = 0.01
STAGE_OUTPUT_RTOL = 0.02
STAGE_GRAD_RTOL = 0.05


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# --device names ---------------------------------------------------------------------------------------


def test_auto_is_cuda_only_where_torch_sees_it():
    assert resolve_device("auto") == torch.device("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    if not HAS_CUDA:  # this project's machines
        assert ComputeDevice.from_names().device.type == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:x", "tpu"])
def test_a_device_this_machine_lacks_is_a_one_line_user_error(name):
    if HAS_CUDA and name in ("cuda", "cuda:0"):
        pytest.skip("this machine has a CUDA device: --device cuda is valid here")
    with pytest.raises(DeviceError) as exc:
        resolve_device(name)
    message = str(exc.value)
    assert isinstance(exc.value, UserError)
    assert f"--device {name}" in message and "\n" not in message


def test_an_unknown_dtype_is_a_user_error():
    with pytest.raises(DeviceError, match="--dtype fp8"):
        ComputeDevice(torch.device("cpu"), "fp8")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device: --device cuda is valid here")
@pytest.mark.parametrize("command", [["train-local", "--max-samples", "64"], ["demo", "--no-kill"]])
def test_cli_device_cuda_without_cuda_exits_2_with_one_line(capsys, command):
    """Refused before any data is read or process started."""
    assert main([*command, "--device", "cuda"]) == 2
    line = _one_line_error(capsys)
    assert "--device cuda" in line and "no CUDA device" in line


def test_cli_bad_dtype_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train-local", "--dtype", "fp8"])
    assert exc.value.code == 2 and "--dtype" in capsys.readouterr().err


# ComputeDevice ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_is_a_no_op_in_fp32_and_bf16_matmuls_in_bf16(device):
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    fp32 = ComputeDevice(resolve_device(device), "fp32")
    a, b = fp32.to_device(a), fp32.to_device(b)
    assert a.device.type == device
    with fp32.autocast():
        assert not torch.is_autocast_enabled(device)
        exact = a @ b
    assert exact.dtype == torch.float32
    bf16 = ComputeDevice(resolve_device(device), "bf16")
    assert bf16.mixed and bf16.grad_scaler() is None and fp32.grad_scaler() is None
    with bf16.autocast():
        assert torch.is_autocast_enabled(device)
        low = a @ b
    assert low.dtype == torch.bfloat16 and low.device.type == device
    torch.testing.assert_close(low.float(), exact, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_to_host_returns_fp32_cpu_tensors(device):
    compute = ComputeDevice(resolve_device(device), "bf16")
    values = torch.randn(4, 3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        host = compute.to_host(compute.to_device(values.to(dtype)))
        assert host.dtype == torch.float32 and host.device.type == "cpu"
        torch.testing.assert_close(host, values.to(dtype).float())
    ids = compute.to_host(compute.to_device(torch.arange(5)))
    assert ids.dtype == torch.int64 and ids.device.type == "cpu"  # integers are not cast
    leaf = compute.to_device(values).requires_grad_(True)
    assert not compute.to_host(leaf * 2).requires_grad  # detached: the wire takes no graph


def test_the_default_is_cpu_fp32():
    assert CPU_FP32 == ComputeDevice(torch.device("cpu"), "fp32") and not CPU_FP32.mixed
    assert CPU_FP32.describe() == "cpu fp32"


# whole-model training (train-local) --------------------------------------------------------------------


def _train_cfg(tiny_cfg, text_dir, samples: int = TRAIN_SAMPLES):
    training = dataclasses.replace(
        tiny_cfg.training, max_samples=samples, warmup_samples=64, eval_samples=32, eval_every_samples=0
    )
    data = dataclasses.replace(tiny_cfg.data, source=str(text_dir), validation_fraction=0.1)
    return tiny_cfg.replace(training=training, data=data)


def _assert_fp32_master_state(trainer: LocalTrainer, device: str) -> None:
    for name, param in trainer.model.named_parameters():
        assert param.dtype == torch.float32 and param.device.type == device, name
        state = trainer.optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32 and state[key].device.type == device, (name, key)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_training_matches_fp32_and_keeps_fp32_master_weights(tiny_cfg, small_text_dir, device):
    cfg = _train_cfg(tiny_cfg, small_text_dir)
    results, trainers = {}, {}
    for dtype in ("fp32", "bf16"):
        trainers[dtype] = LocalTrainer(
            cfg, progress=False, compute=ComputeDevice(resolve_device(device), dtype)
        )
        results[dtype] = trainers[dtype].train()
    fp32, bf16 = results["fp32"], results["bf16"]
    assert fp32.samples == bf16.samples == TRAIN_SAMPLES
    assert bf16.final_val_loss < bf16.initial_val_loss - 1.0  # it learned
    assert bf16.final_val_loss == pytest.approx(fp32.final_val_loss, rel=VAL_LOSS_RTOL)
    assert bf16.final_val_loss != fp32.final_val_loss  # bf16 did compute (not the fp32 path)
    _assert_fp32_master_state(trainers["bf16"], device)
    # the gradients autocast's backward leaves on the parameters are fp32 too
    trainer = trainers["bf16"]
    inputs, labels = next(iter(trainer.val_set.ordered_batches(4, 4)))
    with trainer.compute.autocast():
        loss = trainer.model(trainer.compute.to_device(inputs), trainer.compute.to_device(labels))
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in trainer.model.parameters() if p.grad is not None)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_trains_with_a_finite_loss_scale(tiny_cfg, small_text_dir, tmp_path, device):
    cfg = _train_cfg(tiny_cfg, small_text_dir, FP16_TRAIN_SAMPLES)
    compute = ComputeDevice(resolve_device(device), "fp16")
    trainer = LocalTrainer(cfg, checkpoint_dir=tmp_path / "ckpt", progress=False, compute=compute)
    assert isinstance(trainer.scaler, torch.amp.GradScaler) and trainer.scaler.is_enabled()
    result = trainer.train()
    assert result.final_val_loss < result.initial_val_loss - 1.0
    scale = trainer.scaler.get_scale()
    assert 0 < scale < float("inf")
    _assert_fp32_master_state(trainer, device)
    saved = torch.load(tmp_path / "ckpt" / "grad_scaler.pt", weights_only=True)  # a resume keeps it
    assert saved["scale"] == scale


# stage servers --------------------------------------------------------------------------------------


def _req(kind, mb, x, step=0, **kw):
    return StageRequest(kind, mb, "none", x, step=step, **kw)


def _micro_batch(workers, mb, x, y, step=0):
    """Trainer logic in-process (tests/unit/test_stage_worker.py): forward stage 0, fused last stage,
    backward stage 0; returns what crossed the wire."""
    outputs = workers[0].forward(_req("forward", mb, x, step)).tensor("outputs")
    reply = workers[1].forward(_req("forward_backward", mb, outputs, step, labels=y))
    grad = reply.tensor("grad_inputs")
    back = workers[0].backward(_req("backward", mb, x, step, grad_outputs=grad))
    return outputs, reply.header["loss"], grad, back


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(1e-12))


@pytest.mark.parametrize("device", DEVICES)
def test_stage_workers_in_bf16_send_fp32_and_match_fp32(tiny_cfg, device):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (8, tiny_cfg.model.seq_len + 1), generator=generator)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    runs = {}
    for dtype in ("fp32", "bf16"):
        compute = ComputeDevice(resolve_device(device), dtype)
        workers = [StageWorker(tiny_cfg, spec, compute=compute) for spec in tiny_cfg.stages()]
        runs[dtype] = (workers, _micro_batch(workers, "m0", x, y))
    workers32, (out32, loss32, _, _) = runs["fp32"]
    workers16, (out16, loss16, grad16, back16) = runs["bf16"]
    for sent in (out16, grad16):  # what a bf16 stage puts on the wire
        assert sent.dtype == torch.float32 and sent.device.type == "cpu"
    assert back16.header["acc"] == 8  # stage 0 accumulated it
    assert not torch.equal(out16, out32)  # bf16 did compute
    assert _relative_error(out16, out32) < STAGE_OUTPUT_RTOL
    assert loss16 == pytest.approx(loss32, rel=STAGE_LOSS_RTOL)
    for w16, w32 in zip(workers16, workers32, strict=True):
        assert w16.buckets[0].samples == 8
        for name, p, g16, g32 in zip(
            w16.names, w16.params, w16.buckets[0].grad_sums, w32.buckets[0].grad_sums, strict=True
        ):
            assert p.dtype == torch.float32 and g16.dtype == torch.float32, name
            assert _relative_error(g16.cpu(), g32.cpu()) < STAGE_GRAD_RTOL, name
        # a sealed step's sums stay where they were summed (its mean and update run there); what goes
        # to the stage's peers is their fp32 bytes
        sealed = w16.seal(0)
        assert all(
            g.dtype == torch.float32 and g.device.type == w16.compute.device.type for g in sealed.grad_sums
        )
        sent = SumsCodec().encode(sealed.grad_sums).encoded
        assert [(e.codec, e.dtype) for e in sent] == [("none", "float32")] * len(sent)
        for e, g in zip(sent, sealed.grad_sums, strict=True):
            assert torch.equal(codec.decode(e), g.cpu())


# swarmtrain demo ------------------------------------------------------------------------------------


def test_demo_refuses_fp16_in_one_line(capsys):
    """Its stage servers would refuse it: one loss scale for a whole pipeline does not exist."""
    assert main(["demo", "--no-kill", "--dtype", "fp16"]) == 2
    assert "--dtype fp16" in _one_line_error(capsys)


def test_demo_gives_its_servers_and_its_reference_the_device_and_dtype(monkeypatch):
    from swarmtrain.config import get_preset
    from swarmtrain.runtime.harness import demo

    started = []

    def run_demo(options, out=None):  # the options the demo's processes would be started with
        started.append(options)
        return {"microbatches_completed": 1}

    monkeypatch.setattr(demo, "run_demo", run_demo)
    assert main(["demo", "--no-kill", "--no-monitor", "--device", "cpu", "--dtype", "bf16"]) == 0
    assert main(["demo", "--no-kill", "--no-monitor"]) == 0  # defaults: auto, resolved once, and fp32
    bf16, default = started
    args = bf16.server_args()
    assert args[args.index("--device") + 1] == "cpu" and args[args.index("--dtype") + 1] == "bf16"
    assert (default.device, default.dtype) == (str(resolve_device("auto")), "fp32")

    references = []

    def local_reference_val_loss(cfg, samples, **kwargs):
        references.append(kwargs["compute"])
        return 2.0

    monkeypatch.setattr("swarmtrain.runtime.local.local_reference_val_loss", local_reference_val_loss)
    summary = {"samples": 64, "val_loss": 2.2}
    out = io.StringIO()
    reference = demo._reference(get_preset("tiny"), summary, bf16, out)
    assert references == [ComputeDevice(torch.device("cpu"), "bf16")]
    assert reference["val_loss_gap"] == pytest.approx(0.1) and "(cpu bf16)" in out.getvalue()


# the busy clock ---------------------------------------------------------------------------------------


def _spin(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_busy_clock_counts_this_threads_cpu_work_not_sleep_nor_other_threads():
    """Behaviour, not a benchmark: loose bounds that hold however busy the machine is."""
    cpu = torch.device("cpu")
    start = busy_clock_s(cpu)
    time.sleep(0.2)
    assert busy_clock_s(cpu) - start < 0.05  # sleeping is not busy time

    other = threading.Thread(target=_spin, args=(0.2,))
    start = busy_clock_s(cpu)
    other.start()
    other.join()
    assert busy_clock_s(cpu) - start < 0.05  # another thread's work is not this thread's

    start = busy_clock_s(cpu)
    _spin(0.1)
    assert busy_clock_s(cpu) - start > 0  # this thread's work is


class _FakeCuda:
    """CUDA's asynchronous launches, on CPU: `launch` queues kernel time and returns at once; the wall
    clock (this fake's `perf_counter`) advances by the queued time only when `synchronize` runs it.
    Every synchronize and clock read is recorded, in order."""

    def __init__(self) -> None:
        self.now = 100.0
        self.queued_s = 0.0
        self.calls: list[tuple] = []

    def launch(self, seconds: float) -> None:
        self.queued_s += seconds

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize", device))
        self.now += self.queued_s
        self.queued_s = 0.0

    def current_stream(self, device=None) -> types.SimpleNamespace:
        """The calling thread's stream: the queued kernels are this fake's only stream's."""
        return types.SimpleNamespace(synchronize=lambda: self.synchronize(device))

    def perf_counter(self) -> float:
        self.calls.append(("read",))
        return self.now


def test_busy_clock_on_cuda_waits_for_queued_kernels(monkeypatch):
    """The CUDA branch of busy_clock_s against a fake torch.cuda.current_stream and wall clock (this
    machine has no GPU; the test runs on CPU): it synchronizes the given device's current stream before
    each read, so a job's difference is the time of the kernels it queued, not the earlier job's, and
    not ~0. The current stream, not the whole device: a reply's copy to the host on a side stream must
    not hold the compute thread (tests/unit/test_send_overlap.py, gpu tier)."""
    import swarmtrain.model.device as device_module

    gpu = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "current_stream", gpu.current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the whole device was waited on"))
    fake_time = types.SimpleNamespace(perf_counter=gpu.perf_counter, thread_time=time.thread_time)
    monkeypatch.setattr(device_module, "time", fake_time)
    device = torch.device("cuda", 1)
    gpu.launch(0.25)  # the previous job's kernels, still queued when this job starts
    start = busy_clock_s(device)
    for _ in range(3):
        gpu.launch(0.1)  # this job's kernels: launching returns before they run
    elapsed = busy_clock_s(device) - start
    assert elapsed == pytest.approx(0.3)  # read before synchronizing: 0.25; without a synchronize: 0.0
    assert gpu.calls == [("synchronize", device), ("read",)] * 2 and gpu.queued_s == 0.0

    gpu.calls.clear()
    busy_clock_s(torch.device("cpu"))
    assert gpu.calls == []  # on CPU: this thread's CPU time, no synchronize and no wall clock


@pytest.mark.gpu
def test_busy_clock_on_a_real_gpu_returns_after_the_queued_kernels_ran():
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    busy_clock_s(device)
    for _ in range(8):
        a = a @ a / 2048
    queued = torch.cuda.Event()
    queued.record()  # completes when every kernel launched above has run
    busy_clock_s(device)
    assert queued.query()  # the clock was read after they ran, not while they were queued


@pytest.mark.parametrize("device", DEVICES)
def test_forward_graphs_are_kept_within_the_device_default_budget(device, tiny_cfg):
    """`--cache-mb` unset: 512 MB on CPU; on CUDA the memory free once the stage is built, less 10% of
    the card and two micro-batches' graphs. Graphs are sized in the compute dtype (bf16: half of fp32)."""
    from swarmtrain.model.device import CPU_GRAPH_BUDGET_BYTES

    spec = tiny_cfg.stages()[0]
    fp32 = StageWorker(tiny_cfg, spec, compute=ComputeDevice(torch.device(device), "fp32"))
    bf16 = StageWorker(tiny_cfg, spec, compute=ComputeDevice(torch.device(device), "bf16"))
    assert abs(2 * bf16._entry_bytes_per_sample - fp32._entry_bytes_per_sample) <= 2
    if device == "cpu":
        assert fp32.cache_max_bytes == bf16.cache_max_bytes == CPU_GRAPH_BUDGET_BYTES
    else:
        free_bytes, total_bytes = torch.cuda.mem_get_info()
        assert 0 < fp32.cache_max_bytes <= free_bytes - 0.1 * total_bytes
    assert StageWorker(tiny_cfg, spec, cache_max_bytes=1 << 20).cache_max_bytes == 1 << 20
