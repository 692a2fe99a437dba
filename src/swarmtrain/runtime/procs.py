"""Process hygiene for a swarm on one machine: spawn peers in their own process groups, make them die
with their parent, kill whole trees (python + DHT fork + averager fork + p2pd), remove leftovers.

hivemind leaves `p2pd` and forked children running when a peer is SIGKILLed, and sockets in
/tmp/hivemind-*.sock (docs/DESIGN.md section 4). Every peer we spawn is therefore the leader of
its own process group (hivemind starts p2pd without a new session, so it stays in that group):
killing the group kills the whole peer. Peers also get SIGTERM when their parent dies (Linux
PR_SET_PDEATHSIG), and their own forks get SIGKILL when the peer dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
_at_fork_registered = False
_remembered_sockets: set[str] = set()


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send `sig` to this process when the thread that created it exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass  # not Linux: process groups still work


def child_preexec() -> None:
    """preexec_fn for peers: own session/process group, SIGTERM when the launcher dies."""
    os.setsid()
    set_parent_death_signal(signal.SIGTERM)


def forked_children_die_with_me() -> None:
    """hivemind forks its DHT and averager processes; make them die if this process dies."""
    global _at_fork_registered
    if not _at_fork_registered:
        os.register_at_fork(after_in_child=lambda: set_parent_death_signal(signal.SIGKILL))
        _at_fork_registered = True


def _live_stats():
    """(pid, stat fields after the command name) of every live process, zombies excluded: fields[1] is
    the parent pid, fields[2] the process group. A process that exits mid-scan is skipped."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name may itself hold ')' or spaces: the fields start after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z":
            yield int(entry.name), fields


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid` (zombies excluded)."""
    return [pid for pid, fields in _live_stats() if int(fields[2]) == pgid]


def process_state(pid: int) -> str:
    """One line on a process, for an error report: pid, state (R, S, D, T, Z), the kernel function it
    waits in, its command line's start."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as exc:
        return f"{pid}: gone ({exc.strerror})"
    return f"{pid}: state {stat[stat.rfind(')') + 2]}, waits in {wchan}: {cmdline[:160]}"


def kill_group_members(pgid: int, sig: int = signal.SIGKILL, exclude: tuple[int, ...] = ()) -> int:
    count = 0
    for pid in group_members(pgid):
        if pid in exclude:
            continue
        try:
            os.kill(pid, sig)
            count += 1
        except ProcessLookupError:
            pass
    return count


def hivemind_socket_paths(pids: list[int]) -> set[str]:
    """Unix socket files under /tmp owned by these processes (p2pd daemons and p2p clients)."""
    inodes: set[str] = set()
    paths: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in cmdline:
            if arg.startswith(b"-listen=/unix/"):
                paths.add(arg.decode()[len("-listen=/unix") :])
    try:
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/tmp/hivemind-"):
                paths.add(parts[7])
    except OSError:
        pass
    return {p for p in paths if p.startswith("/tmp/hivemind-")}


def remove_files(paths) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def start_exit_watchdog(grace_s: float) -> threading.Event:
    """If a graceful shutdown hangs, kill our whole group after `grace_s` (a daemon thread). Setting the
    returned event disarms it (a server that moved to another stage lives on)."""
    disarmed = threading.Event()

    def _watch() -> None:
        if disarmed.wait(grace_s):
            return
        reap_own_group()
        os._exit(1)

    threading.Thread(target=_watch, name="exit-watchdog", daemon=True).start()
    return disarmed


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (children, grandchildren, ...), zombies excluded."""
    children: dict[int, list[int]] = {}
    for child, fields in _live_stats():
        children.setdefault(int(fields[1]), []).append(child)
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by a live process and its live descendants."""
    pid = os.getpid() if pid is None else pid
    ticks = 0
    for member in (pid, *descendants(pid)):
        try:
            stat = Path(f"/proc/{member}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def remember_group_sockets() -> None:
    """Note the hivemind sockets of this process tree now (after start-up): forked children that exit
    before us would otherwise take the knowledge of their sockets with them."""
    _remembered_sockets.update(hivemind_socket_paths([os.getpid(), *descendants(os.getpid())]))


def reap_own_group() -> None:
    """At the end of a peer's life: kill whatever is left of its process tree (e.g. an orphaned p2pd)
    and remove its hivemind sockets (hivemind leaves p2p client sockets even on a clean shutdown)."""
    me = os.getpid()
    tree = descendants(me)
    if os.getpgrp() == me:  # our own group also holds orphans re-parented away from us
        tree = sorted(set(tree) | set(group_members(me)) - {me})
    sockets = hivemind_socket_paths([me, *tree]) | _remembered_sockets
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    remove_files(sockets)


def _preexec_in(cpu_quota):
    def preexec() -> None:
        child_preexec()
        cpu_quota.join()

    return preexec


class ManagedProcess:
    """A peer started by a launcher (demo, tests, benchmark): own process group, log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: str | Path,
        env: dict | None = None,
        cpu_quota=None,
        start=None,
    ) -> None:
        """`start(argv, log_path, env)`: starts the peer some other way than a fresh process (it returns
        what `subprocess.Popen` would: runtime/harness/preloaded.py); not with a `cpu_quota`."""
        self.name = name
        self.cpu_quota = cpu_quota  # a CpuQuota the peer's whole tree runs in, or None
        self.argv = argv
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in wait/kill)
        if start is not None and cpu_quota is None:
            self.proc = start(argv, str(self.log_path), env)
        else:
            self.proc = subprocess.Popen(
                argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=child_preexec if cpu_quota is None else _preexec_in(cpu_quota),
                env=env,
            )
        self.pid = self.proc.pid
        self.sockets: set[str] = set()

    def remember_sockets(self) -> None:
        """Note this peer's hivemind sockets now; after a crash nobody else knows them."""
        self.sockets |= hivemind_socket_paths(group_members(self.pid))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(the log {self.log_path} could not be read: {exc.strerror})"

    def kill(self) -> None:
        """SIGKILL the whole peer (a crash or a preempted machine), then remove its sockets."""
        sockets = self.sockets | hivemind_socket_paths(group_members(self.pid))
        kill_group_members(self.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(5.0)
        remove_files(sockets)
        self._log.close()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (graceful: announce offline, shut hivemind down), then SIGKILL what is left."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def _wait_group_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while group_members(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
