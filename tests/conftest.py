"""Shared fixtures: small configs and a guard that no test leaves child processes behind; `gpu`-marked
tests are skipped, and listed as skipped (`-ra`), where torch sees no CUDA device."""

from __future__ import annotations

import dataclasses

import pytest

from swarmtrain.config import get_preset

GPU_SKIP_REASON = "needs a CUDA device; torch sees none"


def pytest_collection_modifyitems(config, items):
    """The default test command deselects only `slow`: `gpu` tests are collected and, without CUDA,
    skipped with a reason, so a run says how many GPU tests it did not run (never silently none).
    Swarm tests run two at a time (`make test`: pytest-xdist, `--dist loadgroup`): each module's tests
    on one worker (a module-scoped swarm starts once), and every `timed` test on the same one, so no two
    of them run side by side."""
    for item in items:
        group = "timed" if item.get_closest_marker("timed") is not None else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: a torch-free selection stays torch-free

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def tiny_cfg():
    return get_preset("tiny")


@pytest.fixture
def small_text_dir(tmp_path):
    """A user data folder: a few text files plus a binary and a hidden file that must be skipped."""
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("hello swarm " * 400)
    (root / "sub" / "b.md").write_text("pipeline stages and peers " * 300)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (root / ".hidden").write_text("secret")
    return root


def with_training(cfg, **changes):
    return cfg.replace(training=dataclasses.replace(cfg.training, **changes))


@pytest.fixture
def start_compute():
    """start_compute() -> a running stage compute thread; torch on one thread (tiny tensors: thread
    start-up costs more than it saves on a shared machine); every thread stopped at teardown."""
    import torch

    from swarmtrain.runtime.server.compute import ComputeWorker

    started: list[ComputeWorker] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def start() -> ComputeWorker:
        compute = ComputeWorker()
        compute.start()
        started.append(compute)
        return compute

    yield start
    for compute in started:
        compute.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module (`pytest.mark.usefixtures("one_torch_thread")`): on tiny tensors
    thread start-up and contention on a shared 2-core machine cost more than they save."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
