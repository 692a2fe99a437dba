"""A CPU quota per peer, so that peers of a local swarm behave like separate, equally fast machines.

On one machine, every process of a swarm shares the same cores: adding a replica adds load and no
compute, so "does adding a peer add throughput?" cannot be answered by running more processes. A
Linux cgroup with a CFS quota gives each peer (its whole process tree: python, hivemind's forks and
p2pd inherit the group) at most `cpus` cores, whatever the others do. Used by the benchmark and the
launcher only; it needs root and a writable cgroup `cpu` controller (v1 or v2), and says so otherwise.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from swarmtrain.config.errors import UserError

_PERIOD_US = 100_000
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")


class CpuQuotaError(UserError):
    """The machine does not let us limit a process's CPU (not root, or no cgroup cpu controller)."""


class CpuQuota:
    """One cgroup limited to `cpus` cores. Create it before spawning, join it from the child's
    preexec, `remove()` it after the processes in it have exited."""

    def __init__(self, name: str, cpus: float) -> None:
        if not 0.01 <= cpus <= os.cpu_count():
            raise CpuQuotaError(f"a CPU quota must be between 0.01 and {os.cpu_count()} cores, got {cpus}")
        self.cpus = cpus
        self.path = self._create(f"swarmtrain-{os.getpid()}-{name}", int(cpus * _PERIOD_US))

    @staticmethod
    def _create(dirname: str, quota_us: int) -> Path:
        try:
            if (_V1_ROOT / "cpu.cfs_quota_us").exists():
                path = _V1_ROOT / dirname
                path.mkdir(exist_ok=True)
                (path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota_us))
                return path
            if "cpu" in (_V2_ROOT / "cgroup.controllers").read_text().split():
                path = _V2_ROOT / dirname
                path.mkdir(exist_ok=True)
                (path / "cpu.max").write_text(f"{quota_us} {_PERIOD_US}")
                return path
        except OSError as exc:
            raise CpuQuotaError(f"cannot create a CPU-limited cgroup ({exc}); run as root on Linux") from exc
        raise CpuQuotaError("no cgroup cpu controller on this machine; cannot limit a peer's CPU")

    def join(self) -> None:
        """Move the calling process into the group (its later children inherit it)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def throttled_s(self) -> float:
        """Seconds the group's processes were held back by the quota (v1: cpu.stat throttled_time ns;
        v2: throttled_usec)."""
        try:
            stats = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        except OSError:
            return 0.0
        if "throttled_time" in stats:
            return int(stats["throttled_time"]) / 1e9
        return int(stats.get("throttled_usec", 0)) / 1e6

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by the processes now in the group (v1 has no usage
        counter in the cpu hierarchy, so it is summed from /proc)."""
        try:
            pids = (self.path / "cgroup.procs").read_text().split()
        except OSError:
            return 0.0
        return sum(_process_cpu_s(int(pid)) for pid in pids)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Delete the group once its processes are gone (the kernel refuses while any remain)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # a straggler still lives: leave the (harmless, empty-later) group
                time.sleep(0.1)


def _process_cpu_s(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0  # exited meanwhile
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
