"""Peers forked from the preloaded interpreter (runtime/harness/preloaded.py), which every swarm test's peers are:
they exit, log and die as the fresh processes users start do."""

import multiprocessing.connection
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from swarmtrain.net.engine import LOCKS_MADE_AT_IMPORT
from swarmtrain.runtime.harness.preloaded import PreloadedPeer, preloadable
from swarmtrain.runtime.procs import ManagedProcess, group_members

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ENTRY = [sys.executable, "-m", "swarmtrain.cli.main"]


def run_to_exit(tmp_path, name: str, argv: list[str], preloaded: bool) -> tuple[int, str]:
    start = PreloadedPeer if preloaded else None
    proc = ManagedProcess(name, argv, tmp_path / f"{name}.log", env=dict(os.environ), start=start)
    assert isinstance(proc.proc, PreloadedPeer) == preloaded
    code = proc.proc.wait(timeout=60)
    proc.kill()
    return code, proc.log_text()


@pytest.mark.parametrize(
    "args",
    [
        ["keygen", "{dir}/key"],  # a command that succeeds and prints
        ["keygen", "{dir}/missing/folder/key"],  # a user's mistake: one line, exit 1
        ["server", "--stage", "0"],  # argparse's error: exit 2, usage on stderr
        ["no-such-command"],
    ],
)
def test_a_preloaded_peer_exits_and_logs_as_a_fresh_process_does(tmp_path, args):
    results = []
    for preloaded in (False, True):
        where = tmp_path / ("forked" if preloaded else "fresh")
        where.mkdir()
        argv = [*ENTRY, *(a.format(dir=where) for a in args)]
        code, log = run_to_exit(where, "peer", argv, preloaded)
        results.append((code, log.replace(str(where), "DIR")))
    (fresh_code, fresh_log), (forked_code, forked_log) = results
    assert forked_code == fresh_code and forked_log == fresh_log, results
    assert "Traceback" not in forked_log


def test_a_launcher_keeps_no_descriptor_of_a_peer_that_ended(tmp_path):
    """`multiprocessing` keeps two pipes per process until its object is closed: kept for every peer, a CI
    session's launcher ran out of descriptors and every later swarm test's DHT "did not start"."""

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    run_to_exit(tmp_path, "first", [*ENTRY, "--help"], preloaded=True)  # the fork server is up
    before = open_descriptors()
    for i in range(4):
        code, _ = run_to_exit(tmp_path, f"peer{i}", [*ENTRY, "--help"], preloaded=True)
        assert code == 0
    unobserved = PreloadedPeer([*ENTRY, "--help"], str(tmp_path / "unobserved.log"), None)
    assert multiprocessing.connection.wait([unobserved.sentinel], timeout=60)  # ended; nobody polled it
    run_to_exit(tmp_path, "last", [*ENTRY, "--help"], preloaded=True)  # its start releases the one above
    assert open_descriptors() == before


def test_a_preloaded_peer_leads_its_own_group_and_a_kill_takes_the_whole_group(tmp_path):
    address = tmp_path / "dht.addr"
    argv = [*ENTRY, "dht", "--address-file", str(address)]
    shared_before = set(os.listdir("/dev/shm"))  # killed processes' files may carry a pid in use again
    proc = ManagedProcess("dht", argv, tmp_path / "dht.log", env=dict(os.environ), start=PreloadedPeer)
    deadline = time.monotonic() + 60
    while not address.exists():
        assert proc.alive and time.monotonic() < deadline, proc.log_text()
        time.sleep(0.1)
    assert os.getpgid(proc.pid) == proc.pid  # a session of its own, as `child_preexec` gives a fresh one
    members = group_members(proc.pid)
    assert len(members) >= 2  # the peer and its p2pd
    # hivemind shares its futures' state as a fresh peer does (`file_descriptor`): no /dev/shm files, which
    # a SIGKILL would leave behind (the fork server imported hivemind before the peer's environment was set)
    shared = set(os.listdir("/dev/shm")) - shared_before
    assert [f for f in shared if any(f.startswith(f"torch_{pid}_") for pid in members)] == []
    with pytest.raises(Exception, match="timed out"):
        proc.proc.wait(timeout=0.2)
    proc.kill()
    assert proc.proc.returncode == -signal.SIGKILL and group_members(proc.pid) == []


def test_only_swarmtrain_entry_points_of_this_interpreter_are_forked():
    assert preloadable([*ENTRY, "server"])
    assert preloadable([sys.executable, "-m", "swarmtrain.cli.faulty", "--", "server"])
    assert not preloadable(["/usr/bin/python3", "-m", "swarmtrain.cli.main", "server"])
    assert not preloadable([sys.executable, "-m", "json.tool"])
    assert not preloadable(["ip", "netns", "exec", "ns0", *ENTRY, "server"])
    with pytest.raises(ValueError):
        PreloadedPeer([sys.executable, "-c", "pass"], "/dev/null", None)


def write_launcher(tmp_path, then: str = "", first: str = "", definitions: str = "") -> Path:
    """A launcher script: it runs `first` (statements; `definitions` are the module's own), forks a DHT
    from the preloaded server, prints the peer's pid once the DHT is up (or after 60 s), then runs `then`
    and exits without stopping the peer."""
    script = tmp_path / "launcher.py"
    address, log = str(tmp_path / "dht.addr"), str(tmp_path / "dht.log")
    main = textwrap.dedent(
        f"""
        address = Path({address!r})
        argv = [sys.executable, "-m", "swarmtrain.cli.main", "dht", "--address-file", str(address)]
        peer = PreloadedPeer(argv, {log!r}, dict(os.environ))
        deadline = time.monotonic() + 60
        while not address.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        print(peer.pid, flush=True)
        """
    )
    body = "\n".join(textwrap.dedent(part) for part in (first, main, then))
    imports = "import os, signal, sys, time\nfrom pathlib import Path\n"
    imports += "from swarmtrain.runtime.harness.preloaded import PreloadedPeer, _fork_server\n"
    script.write_text(
        f"{imports}\n{textwrap.dedent(definitions)}\n\nif __name__ == '__main__':\n{textwrap.indent(body, '    ')}"
    )
    return script


def test_a_launcher_that_leaves_a_peer_running_still_exits_and_takes_the_peer_with_it(tmp_path):
    """multiprocessing joins every live child at exit: without the kill before it, a peer left running
    would hold its launcher's exit forever."""
    script = write_launcher(tmp_path)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pid) == []  # the peer and its p2pd


def test_a_launcher_killed_outright_takes_its_peers_with_it(tmp_path):
    """A fresh peer gets SIGTERM when its launcher dies (procs.py); a forked one when the fork server
    ends, which it does once nothing holds the launcher's end of its pipe."""
    script = write_launcher(tmp_path, then="time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(launcher.stdout.readline())
        assert len(group_members(pid)) >= 2
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    deadline = time.monotonic() + 20
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pid) == []


SCAN_FOR_LOCKS = """
import importlib, inspect, sys
import multiprocessing.synchronize as sync
from swarmtrain.runtime.harness.preloaded import PRELOAD

def is_a_lock(value):
    kinds = (sync.SemLock, sync.Event, sync.Condition, sync.Barrier)
    return isinstance(value, kinds) or type(value).__module__ == "multiprocessing.sharedctypes"

for module in PRELOAD:
    importlib.import_module(module)
found = set()
for name, module in list(sys.modules.items()):
    for attr, value in list(vars(module).items()):
        if is_a_lock(value):
            found.add(f"{name}.{attr}")
        if inspect.isclass(value) and value.__module__ == name:
            found |= {f"{name}.{attr}.{a}" for a, v in list(vars(value).items()) if is_a_lock(v)}
print("\\n".join(sorted(found)))
"""


def test_every_lock_a_preloaded_module_makes_at_import_is_made_again_in_each_peer():
    """A multiprocessing lock made at import in the fork server is shared by every peer forked from it;
    `net/engine.py renew_after_preloaded_fork` makes the ones it knows again. A new one (a hivemind upgrade) fails
    here by name."""
    done = subprocess.run([sys.executable, "-c", SCAN_FOR_LOCKS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == sorted(LOCKS_MADE_AT_IMPORT)


def test_a_peer_killed_holding_hiveminds_lock_stalls_no_peer_forked_after_it(tmp_path):
    """The CI failure of docs/LOG.md's "twenty-seventh session": a peer SIGKILLed inside a DHT call held
    hivemind's `SharedBytes._lock`, made in the fork server, and every peer forked after it waited forever
    at its first DHT call. Here a fork of the same server takes that lock and is killed; a DHT forked next
    must still start."""
    flag = str(tmp_path / "held")
    definitions = f"""
        def hold_the_lock():
            from hivemind.utils.mpfuture import SharedBytes

            SharedBytes._lock.acquire()  # as a peer killed inside `SharedBytes.next` leaves it
            Path({flag!r}).write_text("held")
            time.sleep(600)
        """
    first = f"""
        holder = _fork_server().Process(target=hold_the_lock)
        holder.start()
        while not Path({flag!r}).exists():
            time.sleep(0.05)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
        """
    script = write_launcher(tmp_path, first=first, definitions=definitions)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "dht.addr").exists(), (tmp_path / "dht.log").read_text()[-3000:]
