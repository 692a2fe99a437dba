"""A complete swarm on this machine as separate processes: used by `swarmtrain demo`, the integration
and fault tests, and the benchmark. Every process is started in its own process group and stopped
(or killed) as a whole, so nothing is left behind, also when the caller fails.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from swarmtrain.config.errors import UserError
from swarmtrain.runtime.harness.cpu_quota import CpuQuota
from swarmtrain.runtime.harness.preloaded import PreloadedPeer, preloadable
from swarmtrain.runtime.harness.stall_watchdog import StallWatchdog, dump_stacks
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.procs import ManagedProcess, group_members, process_state

if TYPE_CHECKING:
    from swarmtrain.runtime.faults import FaultHooks

READY_MARKER = "ready (epoch"


class SwarmStartError(UserError):
    """A peer of the local swarm did not start (its log tail is in the message)."""


def write_run_toml(path: str | Path, preset: str, overrides: dict[str, dict] | None = None) -> Path:
    """A TOML run file: the preset plus per-section overrides (ints, floats, strings, bools, lists)."""
    lines = [f'preset = "{preset}"']
    for section, values in (overrides or {}).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def derived_run_toml(base: str | Path, path: str | Path, overrides: dict[str, dict]) -> Path:
    """A copy of the run file `base` (a preset plus flat sections, as `write_run_toml` writes them) with
    `overrides` merged into its sections, written to `path`."""
    import tomllib

    with open(base, "rb") as handle:
        sections = tomllib.load(handle)
    preset = sections.pop("preset", "tiny")
    for section, values in overrides.items():
        sections.setdefault(section, {}).update(values)
    return write_run_toml(path, preset, sections)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def not_started(proc: ManagedProcess, what: str) -> SwarmStartError:
    """The error for a peer that did not start: its exit code, or, still running, each of its processes'
    state and Python stacks (a start that hangs once in a CI run leaves nothing else to read), then its
    log."""
    code = proc.proc.poll()
    if code is not None:
        head = f"{what} did not start: exit code {code}"
    else:
        members = group_members(proc.pid)
        states = "\n".join(process_state(pid) for pid in members)
        stacks = dump_stacks({proc.name: proc.pid})  # its Python; p2pd's Go stacks py-spy cannot read
        head = f"{what} did not start: still running; its processes:\n{states}\n{stacks}"
    return SwarmStartError(f"{head}\nits log:\n{proc.log_text()[-3000:]}")


class LocalSwarm:
    """Start/stop peers of one run. Use as a context manager: everything is stopped on exit."""

    def __init__(
        self,
        workdir: str | Path,
        config_path: str | Path,
        python: str | None = None,
        env: dict | None = None,
        cpus_per_server: float | None = None,
        netbed=None,
        netbed_peers: dict[str, int] | None = None,
        preloaded: bool = False,
    ) -> None:
        """`cpus_per_server`: run each server's process tree in its own cgroup limited to that many
        cores (CpuQuota), so servers behave like separate equal machines; None: no limit.
        `netbed` (a started `netbed.WanTestbed`) and `netbed_peers` (peer name -> index in it): a peer
        named there runs inside that namespace (`wrap`) and listens on its address (`--host`).
        `preloaded`: peers outside a namespace or quota are forked from an interpreter that has imported
        their modules (runtime/harness/preloaded.py: ~3 s less CPU per peer; the test suite's swarms)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = str(config_path)
        self.python = python or sys.executable
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.processes: dict[str, ManagedProcess] = {}
        self.address: str | None = None
        self.cpus_per_server = cpus_per_server
        self.quotas: dict[str, CpuQuota] = {}
        self.netbed = netbed
        self.netbed_peers = dict(netbed_peers or {})
        self.watchdog: StallWatchdog | None = None
        self.preloaded = preloaded
        self.trainer_names: list[str] = []  # started with start_trainer: stopped first, watched for stalls

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def _spawn(
        self, name: str, args: list[str], cpu_quota: CpuQuota | None = None, faults: FaultHooks | None = None
    ) -> ManagedProcess:
        """`faults`: the peer is faulty (runtime/faults.py), launched through the test-only entry point."""
        entry = [self.python, "-m", "swarmtrain.cli.main"]
        if faults is not None:
            entry = [self.python, "-m", "swarmtrain.cli.faulty", *faults.as_args(), "--"]
        command, rest = args[:1], args[1:]
        if self.netbed is not None and name in self.netbed_peers:
            i = self.netbed_peers[name]  # --host right after the subcommand: `extra` may still override it
            rest = ["--host", self.netbed.host(i), *rest]
        argv = [*entry, *command, *rest]
        if self.netbed is not None and name in self.netbed_peers:
            argv = self.netbed.wrap(self.netbed_peers[name], argv)
        start = PreloadedPeer if self.preloaded and cpu_quota is None and preloadable(argv) else None
        proc = ManagedProcess(
            name, argv, self.workdir / f"{name}.log", env=self.env, cpu_quota=cpu_quota, start=start
        )
        self.processes[name] = proc
        return proc

    def start_dht(self, *extra: str, timeout_s: float = 60.0) -> str:
        address_file = self.workdir / "dht.addr"
        address_file.unlink(missing_ok=True)
        proc = self._spawn("dht", ["dht", "--address-file", str(address_file), *extra])
        deadline = time.monotonic() + timeout_s
        while not address_file.exists():
            if not proc.alive or time.monotonic() > deadline:
                raise not_started(proc, "the DHT")
            time.sleep(0.1)
        self.address = address_file.read_text().split()[0]
        proc.remember_sockets()
        return self.address

    def start_dht_peer(self, name: str, *extra: str) -> ManagedProcess:
        """One more `swarmtrain dht` node, joined to the first: a reachable peer that serves nothing but
        the DHT and, as every reachable peer does by default, relays for peers behind a NAT."""
        return self._spawn(name, ["dht", "--initial-peers", self.address, *extra])

    def start_server(
        self, name: str, stage: int | str | None, *extra: str, faults: FaultHooks | None = None
    ) -> ManagedProcess:
        """`stage`: an index, "auto", or None when `extra` says where (--plan); `faults`: a faulty
        server (tests)."""
        args = [
            "server",
            *([] if stage is None else ["--stage", str(stage)]),
            "--config",
            self.config_path,
            "--initial-peers",
            self.address,
            "--ledger",
            str(self.workdir / f"{name}.ledger.jsonl"),
            *extra,
        ]
        quota = None
        if self.cpus_per_server is not None:
            quota = self.quotas[name] = CpuQuota(name, self.cpus_per_server)
        return self._spawn(name, args, quota, faults)

    def start_trainer(self, name: str, *extra: str) -> ManagedProcess:
        args = [
            "trainer",
            "--config",
            self.config_path,
            "--initial-peers",
            self.address,
            "--trainer-id",
            name,
            "--ledger",
            str(self.workdir / f"{name}.ledger.jsonl"),
            "--summary-json",
            str(self.workdir / f"{name}.summary.json"),
            *extra,
        ]
        proc = self._spawn(name, args)
        # after the spawn: the stall watchdog's thread reads the name's process (a KeyError once at start)
        self.trainer_names.append(name)
        return proc

    def start_replica(
        self, name: str, shard: str, *extra: str, faults: FaultHooks | None = None
    ) -> ManagedProcess:
        """A whole-model replica (`swarmtrain replica`) of data shard `shard` ("K/N"); `faults`: a faulty
        one (tests)."""
        args = [
            "replica",
            "--config",
            self.config_path,
            "--initial-peers",
            self.address,
            "--shard",
            shard,
            "--summary-json",
            str(self.summary_path(name)),
            *extra,
        ]
        return self._spawn(name, args, faults=faults)

    def start_monitor(self, port: int = 0, *extra: str, timeout_s: float = 60.0) -> str:
        """`swarmtrain monitor` of this swarm (stopped with the servers); returns its page's URL."""
        url_file = self.workdir / "monitor.url"
        url_file.unlink(missing_ok=True)
        args = ["monitor", "--config", self.config_path, "--initial-peers", self.address, "--port", str(port)]
        proc = self._spawn("monitor", [*args, "--url-file", str(url_file), *extra])
        deadline = time.monotonic() + timeout_s
        while not url_file.exists():
            if not proc.alive or time.monotonic() > deadline:
                raise not_started(proc, "the monitor")
            time.sleep(0.1)
        return url_file.read_text().strip()

    def summary_path(self, name: str) -> Path:
        return self.workdir / f"{name}.summary.json"

    def wait_ready(self, names: list[str], timeout_s: float = 120.0) -> None:
        """Wait until each named server logged that it serves."""
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        while pending:
            for name in list(pending):
                proc = self.processes[name]
                if READY_MARKER in proc.log_text():
                    pending.remove(name)
                    proc.remember_sockets()
                elif not proc.alive:
                    raise not_started(proc, name)
            if pending and time.monotonic() > deadline:
                raise not_started(self.processes[pending[0]], f"{pending} (not ready after {timeout_s:.0f}s)")
            time.sleep(0.2)

    def wait_exit(self, name: str, timeout_s: float) -> int | None:
        try:
            return self.processes[name].proc.wait(timeout=timeout_s)
        except Exception:
            return None

    def ledger_path(self, name: str) -> Path:
        return self.workdir / f"{name}.ledger.jsonl"

    def ledger_events(self, name: str, event: str) -> list[dict]:
        """The `event` entries of a process's ledger, oldest first: a server's `ready` (stage, peer,
        epoch: once per stage it serves) and `stage_choice` (`--stage auto`'s inputs and choice)."""
        return [e for e in read_ledger(self.ledger_path(name)) if e.get("e") == event]

    def kill(self, name: str) -> None:
        self.processes[name].kill()

    def watch_stalls(
        self, quiet_s: float = 10.0, on_dump: Callable[[Path], None] | None = None
    ) -> StallWatchdog:
        """Dump every process's stacks into the work directory whenever the trainers complete nothing
        for `quiet_s` (runtime/harness/stall_watchdog.py); stopped by `stop_all`."""
        if self.watchdog is None:
            self.watchdog = StallWatchdog(
                ledgers=lambda: [self.ledger_path(n) for n in self._trainers()],
                pids=lambda: {n: p.pid for n, p in list(self.processes.items()) if p.alive},
                alive=lambda: any(self.processes[n].alive for n in self._trainers()),
                out_dir=self.workdir,
                quiet_s=quiet_s,
                on_dump=on_dump,
            ).start()
        return self.watchdog

    def _trainers(self) -> list[str]:
        return list(self.trainer_names)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Graceful stop: trainers first (their in-flight micro-batches still find servers), then
        servers and the DHT; whole process groups are SIGKILLed after `grace_s` (0: at once, no SIGTERM)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if grace_s > 0:
            trainers = self._trainers()
            self._terminate([self.processes[n] for n in trainers], grace_s)
            self._terminate([p for n, p in self.processes.items() if n not in trainers], grace_s)
        for proc in self.processes.values():
            proc.kill()  # idempotent: SIGKILLs the rest of each group and removes its sockets
        for quota in self.quotas.values():
            quota.remove()

    @staticmethod
    def _terminate(procs: list[ManagedProcess], grace_s: float) -> None:
        live = [p for p in procs if p.alive]
        for proc in live:  # signal everyone first so they shut down in parallel
            try:
                os.kill(proc.pid, 15)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in live:
            try:
                proc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
