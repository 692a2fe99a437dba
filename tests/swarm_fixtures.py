"""Fixtures for tests that run a real local swarm: every process is stopped even when a test fails."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import pytest

from swarmtrain.config import load_run_config
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, write_run_toml

# short timeouts so that a failure shows up in seconds, not minutes
# rebalancing off: a test that is not about moves pins its fleet (a server moved mid-test changes which
# server a fault strikes and what is compared); tests of moves set a period, and test_rebalance_default
# runs the default
FAST_SWARM = {
    "request_timeout_s": 10.0,
    "averaging_timeout_s": 10.0,
    "announce_period_s": 1.0,
    "rebalance_period_s": 0.0,
}
TEARDOWN_GRACE_S = 0.0  # SIGKILL at teardown, no SIGTERM first: nothing looks at a swarm after its test
STALL_DUMP_AFTER_S = 10.0  # no micro-batch completed for this long: every process's stacks are dumped
DUMP_PRINT_CHARS = 30_000


TWO_REPLICAS_OF_STAGE_0 = {"s0a": 0, "s0b": 0, "s1": 1}

T = TypeVar("T")


def in_background(fn: Callable[[], T]) -> Future[T]:
    """`fn()` on a thread of this process at the lowest CPU priority (nice 19, that thread only; torch on
    one thread runs its ops on the calling thread): a test's one-process reference, computed while its
    peers run, takes the CPU they leave idle instead of running after them. The same computation either
    way, only when it runs changes. Worth it where the peers leave CPU idle (DiLoCo replicas waiting on
    each other's rounds: test_replicas); a stage swarm at full load slowed as much as it saved
    (docs/LOG.md, fourteenth session). A test that fails before asking for the result leaves the thread
    to finish at nice 19."""

    def niced() -> T:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return fn()

    return on_a_thread(niced, "one-process-reference")


def on_a_thread(fn: Callable[[], T], name: str = "beside-the-test") -> Future[T]:
    """`fn()` on a thread of this process while the test goes on, e.g. work that needs no swarm while the
    test starts its DHT (~2 s to its address file). Peers are started on the test's own thread, never in
    `fn`: a peer gets its parent's death signal (`procs.child_preexec`, PR_SET_PDEATHSIG) when the thread
    that spawned it ends. A test that fails before asking for the result leaves the thread to finish."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the result
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def start_servers(swarm, servers: dict[str, int]) -> None:
    """A DHT and one server per `name: stage`, ready to serve."""
    swarm.start_dht()
    for name, stage in servers.items():
        swarm.start_server(name, stage)
    swarm.wait_ready(list(servers))


@pytest.fixture(scope="session", autouse=True)
def compiled_sources():
    """swarmtrain's own modules compiled to bytecode once, before the first peer starts, and removed after
    the session. Where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), no process
    writes a .pyc, so every peer, trainer and CLI run compiled the swarmtrain modules it imports again
    (~0.13 CPU-s per process measured for a server's and a trainer's imports; the installed packages
    ship theirs); a .pyc that exists is read all the same. Python checks each against its source's mtime
    and size: a source changed meanwhile is compiled afresh, as before. The files go where Python puts
    them (`__pycache__`, ignored by git); only those this fixture wrote are removed. Under pytest-xdist each
    worker compiles (the files are written atomically) and the first to finish removes them: the other's
    later processes compile in memory, as without this fixture."""
    import compileall

    import swarmtrain

    root = Path(swarmtrain.__file__).parent
    before = set(root.rglob("__pycache__/*.pyc"))
    compileall.compile_dir(root, quiet=1, workers=1)
    yield
    for path in set(root.rglob("__pycache__/*.pyc")) - before:
        path.unlink(missing_ok=True)
    for cache in root.rglob("__pycache__"):
        with contextlib.suppress(OSError):
            cache.rmdir()  # only an empty one


@pytest.fixture
def make_swarm(tmp_path):
    """make_swarm(preset, overrides) -> (LocalSwarm, RunConfig); all swarms stopped at teardown."""
    with _swarm_maker(tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def make_module_swarm(tmp_path_factory, request):
    """`make_swarm` for the tests of one module together: a swarm they share, one start less per test, which
    each must leave as the others expect it (e.g. they check what they change as deltas); stopped after
    the module's last test."""
    with _swarm_maker(tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])) as make:
        yield make


@contextlib.contextmanager
def _swarm_maker(tmp_path: Path):
    swarms, probes = [], []

    def make(preset: str = "tiny", overrides: dict | None = None):
        sections = {"swarm": dict(FAST_SWARM)}
        for section, values in (overrides or {}).items():
            sections.setdefault(section, {}).update(values)
        path = write_run_toml(tmp_path / f"run{len(swarms)}.toml", preset, sections)
        swarm = LocalSwarm(tmp_path / f"swarm{len(swarms)}", path, preloaded=True)
        swarm.watch_stalls(STALL_DUMP_AFTER_S, on_dump=_print_dump)
        swarms.append(swarm)
        return swarm, load_run_config(path)

    def probe(cfg, swarm, codec="none", network=None):
        from swarmtrain.runtime.harness.probe import SwarmProbe

        client = SwarmProbe(cfg, [swarm.address], codec=codec, network=network)
        probes.append(client)
        return client

    make.probe = probe
    try:
        yield make
    finally:
        for client in probes:
            client.close()
        # nothing looks at a swarm after its test: each process group is SIGKILLed at once (tests that
        # check a graceful stop call `stop_all` themselves); a grace would cost every test its length
        for swarm in swarms:
            swarm.stop_all(grace_s=TEARDOWN_GRACE_S)


def _print_dump(path) -> None:
    """A stall's stacks go to the test's captured output, which pytest shows when the test fails."""
    print(f"\n{path}:\n{path.read_text()[:DUMP_PRINT_CHARS]}", flush=True)
