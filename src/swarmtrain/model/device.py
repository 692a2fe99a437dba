"""Where a peer computes and in what precision: the one device abstraction of `server`, `replica`,
`train-local` and `demo` (`--device auto|cpu|cuda[:N]`, `--dtype fp32|bf16|fp16`).

Mixed precision keeps "master weights": parameters, gradients and optimizer state stay fp32 on the
device, and only the compute runs under `torch.autocast` in the chosen dtype, so the optimizer's updates
are not rounded to 8 mantissa bits (bf16) and a replica's state is the same kind of tensor whatever its
peers compute in. fp16's narrow range needs a loss scaler (`grad_scaler`); bf16 has fp32's range and
needs none. bf16 autocast runs on CPU too, which is how the mixed-precision path is tested here.

The CUDA-only code is the two branches marked "CUDA" below (a pinned staging copy, a synchronize of the
current stream before reading the clock), and net/device_bytes.py's staging buffers and streams. They run
in the `gpu` test tier (tests/unit/test_device.py, tests/unit/test_codec_device.py); on CPU the busy
clock's is run against a fake torch.cuda.current_stream.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from swarmtrain.config.errors import UserError

DEVICE_CHOICES_HELP = "auto (CUDA when torch sees one, else CPU), cpu, cuda or cuda:N"
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(UserError):
    """A device or dtype this machine cannot compute on (a user's choice, reported in one line)."""


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a torch device; asking for CUDA where torch sees none is an
    error, never a silent CPU run."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2]
        if index_text and not index_text.isdigit():
            raise DeviceError(f"--device {name}: expected cuda:N with N a device index")
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name}: torch sees no CUDA device on this machine (use --device cpu)"
            )
        index = int(index_text) if index_text else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    raise DeviceError(f"--device {name}: expected {DEVICE_CHOICES_HELP}")


@dataclass(frozen=True)
class ComputeDevice:
    """A device and the dtype its compute runs in (parameters stay fp32: see the module docstring)."""

    device: torch.device
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise DeviceError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")

    @classmethod
    def from_names(cls, device: str = "auto", dtype: str = "fp32") -> ComputeDevice:
        return cls(resolve_device(device), dtype)

    @property
    def mixed(self) -> bool:
        return self.dtype != "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward (and its recompute) runs in; fp32 runs as written."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.dtype])

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16's dynamic loss scaler (None for fp32 and bf16, which need none)."""
        return torch.amp.GradScaler(self.device.type) if self.dtype == "fp16" else None

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A received tensor on the compute device (one a stage decoded there already stays as it is)."""
        if tensor.device.type != "cpu" or self.device.type != "cuda":
            return tensor.to(self.device)  # on a device already (`cuda` and `cuda:0` alike): no pinning
        # a host tensor to CUDA: through a pinned host buffer, so the copy is a DMA that does not block
        # this thread; the caching host allocator keeps the buffer until the copy on the current stream
        # has run. Only small tensors come this way (token ids, labels): float ones arrive decoded there
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """A result for the wire, where it was computed: fp32 (the codecs' input; autocast's bf16/fp16
        outputs are cast back), detached. The codec encodes it on the device and only the payload's
        bytes come to the host (net/device_bytes.py)."""
        out = tensor.detach()
        if out.is_floating_point() and out.dtype != torch.float32:
            out = out.float()
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`wire(tensor)` on the host (blocking on CUDA: the values must exist before they are read)."""
        return self.wire(tensor).cpu()

    def graph_budget_bytes(self, micro_batch_bytes: int) -> int:
        """How much memory the forward graphs kept for backwards may take by default. On CUDA: the device's
        free memory now (call it once the stage's parameters and optimizer state exist), less 10% of the
        card and two micro-batches' graphs of working room (a forward, a backward's gradients); on CPU
        `CPU_GRAPH_BUDGET_BYTES`: host memory is shared with every other process of the machine."""
        if self.device.type != "cuda":
            return CPU_GRAPH_BUDGET_BYTES
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        return max(0, int(free_bytes - 0.1 * total_bytes) - 2 * micro_batch_bytes)

    @property
    def bytes_per_value(self) -> int:
        """Bytes of one activation value in this compute dtype."""
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def describe(self) -> str:
        return f"{self.device} {self.dtype}"


# a CPU server's default: 64 forward-only requests of a full batch once grew a server to 1.7 GB
CPU_GRAPH_BUDGET_BYTES = 512 << 20
CPU_FP32 = ComputeDevice(torch.device("cpu"), "fp32")  # the default of every API that takes a ComputeDevice


def busy_clock_s(device: torch.device) -> float:
    """A clock whose differences around one job are the time the device spent on it: this thread's CPU
    time on CPU (exact however busy the machine is); on CUDA, wall time read after synchronizing this
    thread's current stream, because kernels run asynchronously and the launching thread's CPU time would
    read near zero. The compute thread runs one job at a time, so the synchronize at a job's start waits
    for nothing of it. The current stream only, not the whole device: a reply's encoding and its copy to
    the host run on a side stream (net/device_bytes.behind_current) and must not hold the compute thread
    (they are not counted as the job's time; decodes the job used are, the current stream waits for them)."""
    if device.type == "cuda":  # CUDA
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return time.thread_time()


def server_threads(device: torch.device, cores: int | None = None) -> int:
    """A stage server's torch CPU threads when `--threads` is not given. CPU: 1, because a CPU swarm's
    servers share a machine's cores (and tests and benches run several per machine). CUDA: the per-element
    work is on the device, but host tensor work remains (the stage exchange's gradient sums, their robust
    mean, sealed buckets): a few threads, min(4, the cores this process may run on; `cores` for tests)."""
    if device.type != "cuda":
        return 1
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(SERVER_CUDA_THREADS, cores))


SERVER_CUDA_THREADS = 4  # a CUDA server's default torch threads, on a machine with that many cores
