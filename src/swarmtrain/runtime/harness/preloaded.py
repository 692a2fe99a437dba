"""Peers started from an interpreter that has already imported torch, hivemind and swarmtrain (a fork
server), for launchers that start many short-lived peers on one machine: the test suite.

A fresh `python -m swarmtrain.cli.main server` spends ~3 s of one core importing before it does anything,
and a swarm test starts three to six peers: on two cores, importing was a quarter of the swarm tests' CPU
time (docs/LOG.md, "twenty-sixth session"). Here one process per launcher imports once
(`multiprocessing`'s fork server, with those modules preloaded) and forks each peer from it. The peer then
runs the same `main(argv)` a fresh interpreter would, with its own log, environment, session and
parent-death signal, and ends as an interpreter does: non-daemon threads joined, `atexit` handlers run,
output flushed. What the imports set up once and a peer must own is made again in each peer
(`net/engine.py renew_after_preloaded_fork`: hivemind's import-time multiprocessing locks, which one
killed peer holding them once stalled every other, and its tensor sharing strategy; numpy's global
generator is reseeded here, Python's `random` reseeds at every fork). What still differs from a fresh
interpreter: other environment variables read at import time were read in the fork server's environment.
Users' own launchers (`swarmtrain demo`, the benches) start fresh interpreters.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading

from swarmtrain.runtime.procs import child_preexec

# what a swarm peer imports before it starts working; everything else it imports itself
PRELOAD = (
    "torch",
    "numpy",
    "hivemind",
    "swarmtrain.cli.main",
    "swarmtrain.cli.faulty",
    "swarmtrain.net.engine",
    "swarmtrain.runtime.server.server_process",
    "swarmtrain.runtime.server.stage_service",
    "swarmtrain.runtime.trainer.swarm_trainer",
)
ENTRY_MODULES = ("swarmtrain.cli.main", "swarmtrain.cli.faulty")

_context: multiprocessing.context.ForkServerContext | None = None
_context_lock = threading.Lock()
_peers: list[PreloadedPeer] = []  # peers not yet seen to end, for `_kill_leftovers`


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """The fork server's context, its preload set once; the server itself starts with the first peer."""
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(PRELOAD))
            # registered after multiprocessing's own exit hook, so it runs first: that hook joins every
            # live child, and a peer a launcher left running would hold the launcher's exit forever
            atexit.register(_kill_leftovers)
            _context = context
        return _context


def _kill_leftovers() -> None:
    """At the launcher's exit: SIGKILL the process group of every peer still running (a fresh process
    would get SIGTERM from its parent-death signal; a forked peer's parent is the fork server)."""
    for peer in list(_peers):
        if peer.poll() is None:
            try:
                os.killpg(peer.pid, signal.SIGKILL)
            except OSError:
                pass
            peer.wait_quietly(timeout_s=5.0)


def preloadable(argv: list[str]) -> bool:
    """Whether `argv` runs one of swarmtrain's entry modules with this interpreter (`python -m module
    ...`), which a fork of the preloaded server can run instead."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in ENTRY_MODULES


class PreloadedPeer:
    """A peer forked from the preloaded server: the part of `subprocess.Popen` a launcher uses (`pid`,
    `poll`, `wait`, `returncode`, `send_signal`, `terminate`, `kill`)."""

    def __init__(self, argv: list[str], log_path: str, env: dict | None) -> None:
        if not preloadable(argv):
            raise ValueError(f"not a swarmtrain entry point of this interpreter: {argv[:3]}")
        self.args = list(argv)
        self._returncode: int | None = None
        for peer in list(_peers):
            peer.poll()  # releases the pipes of peers that ended unobserved
        self._process = _fork_server().Process(
            target=run_entry,
            args=(argv[2], argv[3:], str(log_path), dict(os.environ if env is None else env)),
            name=f"peer:{argv[3] if len(argv) > 3 else argv[2]}",
        )
        self._process.start()
        _peers.append(self)
        self.pid: int = self._process.pid  # type: ignore[assignment]  # set by start()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    @property
    def sentinel(self) -> int:
        """Readable once the peer's exit status is known (`multiprocessing.connection.wait`)."""
        return self._process.sentinel

    def poll(self) -> int | None:
        if self._returncode is None and self._process.exitcode is not None:
            self._returncode = self._process.exitcode
            self._release()
        return self._returncode

    def _release(self) -> None:
        """Close the ended process's two pipes to the fork server. `multiprocessing` keeps them until the
        process object is collected or closed; kept for every peer, a launcher's descriptors grew by two
        per peer (with `ulimit -n 40` the 16th start failed: docs/LOG.md, "twenty-seventh session")."""
        self._process.close()
        _peers.remove(self)

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def wait_quietly(self, timeout_s: float) -> None:
        try:
            self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_entry(module: str, args: list[str], log_path: str, env: dict) -> None:
    """In the forked peer: become what `Popen(argv, stdout=log, stderr=STDOUT, stdin=DEVNULL,
    preexec_fn=child_preexec, env=env)` would start, run the entry module's `main(args)`, and end as an
    interpreter ends."""
    _let_go_of_the_launchers_pipe()
    child_preexec()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as PYTHONUNBUFFERED would: launchers read logs live
    os.environ.clear()
    os.environ.update(env)
    # a fork server's child inherits "forkserver" as its start method; a fresh interpreter has the
    # platform's default (hivemind's DHT and averager processes are started with it)
    multiprocessing.set_start_method(None, force=True)
    from swarmtrain.net.engine import renew_after_preloaded_fork

    renew_after_preloaded_fork()
    import numpy

    numpy.random.seed()  # the fork server's global generator is every peer's otherwise
    entry = importlib.import_module(module)
    sys.argv = [entry.__file__ or module, *args]
    code: object = 1
    try:
        code = entry.main(args)
    except SystemExit as exc:
        code = exc.code
    finally:
        _end_as_an_interpreter_does()
    sys.exit(code)  # multiprocessing turns it into the exit status, as the interpreter would


def _let_go_of_the_launchers_pipe() -> None:
    """Close the peer's copy of the launcher's end of the fork server's "alive" pipe. The fork server
    exits when the launcher's end closes; every fork holds a copy (for its own forks, which a peer never
    makes through the fork server), and so would the peer's DHT process and p2pd: a launcher killed
    outright would leave the fork server, and with it every peer, running (their parent-death signal
    fires when the fork server ends)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _end_as_an_interpreter_does() -> None:
    """What an interpreter does after its main module returns, in its order: threading's exit hooks and
    the join of non-daemon threads (`threading._shutdown`, which the interpreter itself calls; the fork
    server's child would call it too, but after this), then `atexit` handlers (the fork server's child
    ends in `os._exit`, which runs none), then flushed output."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
