"""A WAN test bed on one Linux machine: local peers behind rate-limited links (tests and benches only).

Each peer gets its own network namespace, joined to one bridge in the root namespace by a veth pair.
A `tc tbf` qdisc on the egress of the namespace's end limits the peer's upload, one on the egress of
the bridge's end limits its download. A launcher runs peer i's command inside its namespace with
`wrap(i, argv)` and points the other peers at `host(i)`; the bridge has an address too, so the root
namespace reaches every peer.

What it emulates: per-peer upload and download bandwidth, changeable while running (`set_rate`), a
peer's link cut and restored (`cut`, `reconnect`), and peers on distinct IP addresses. What it cannot: latency, jitter or loss (this kernel has no `netem`),
so a link here is narrow but as fast to answer as loopback. Needs root, `ip` and `tc` (iproute2) and
the kernel's netns, bridge, veth and tbf support; `available()` says what is missing.

Every namespace and link name starts with `PREFIX` and a random tag, so two test beds never collide
and `leftovers()` / `cleanup_leftovers()` find what a killed run left behind. Each test bed records
its owner process under /run, so that a cleanup spares the test beds of processes still running.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from swarmtrain.config.errors import UserError

log = logging.getLogger(__name__)

PREFIX = "stw"  # "swarmtrain WAN": the start of every namespace and link name a test bed creates
_TAG_HEX_CHARS = 6
_IFNAME_MAX_CHARS = 15  # Linux IFNAMSIZ minus the terminating NUL
_MAX_PEERS = 250  # one /24: .1 is the bridge, peers from .2
_OWNERS_DIR = Path("/run/swarmtrain-netbed")  # tmpfs: records vanish on reboot, as namespaces do
# files `ip netns exec NS` mounts over /etc (natbed's hosts files); `ip netns del` leaves them behind
NETNS_ETC = Path("/etc/netns")
_COMMAND_TIMEOUT_S = 20.0
_KILL_TIMEOUT_S = 5.0
_MIN_RATE_MBIT_S = 0.01  # tc rates are whole kbit/s
# A router's buffer of ~100 ms: a queue that absorbs bursts instead of dropping every one of them
_TBF_LATENCY_MS = 100
# The bucket must hold at least a packet, and at high rates ~one timer tick of traffic, or tbf
# delivers less than the rate it is given
_TBF_MIN_BURST_BYTES = 32 * 1024
_TBF_BURST_S = 0.02
# tbf counts whole Ethernet frames. A full TCP segment on the bed's veths (MTU 1500, Linux's default
# TCP timestamps on) carries 1448 bytes of payload in a frame of 1514 (14 Ethernet, 20 IP, 32 TCP)
_TCP_PAYLOAD_BYTES_PER_FRAME = 1448
_FRAME_BYTES = 1514

_open_beds: set[WanTestbed] = set()


class NetbedError(UserError):
    """The test bed cannot be built, changed or removed (not root, a missing tool, a failed command)."""


def _run(argv: list[str]) -> str:
    """Run a command to completion; a failure raises NetbedError naming the command and its stderr."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetbedError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise NetbedError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _run_quietly(argv: list[str]) -> bool:
    """Run a removal command whose object may already be gone (that is fine: the goal is its absence)."""
    try:
        _run(argv)
        return True
    except NetbedError as exc:
        log.debug("%s", exc)
        return False


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NetbedError(f"the WAN test bed needs root (running as uid {os.geteuid()})")


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "") when this machine can build a test bed, else (False, the reason) for a skip message.
    Probes the kernel once per process (a throwaway namespace with a bridge, a veth pair and a tbf)."""
    return _check_availability()


def _check_availability() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, f"the WAN test bed needs root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"the WAN test bed needs {' and '.join(missing)} (iproute2) on PATH"
    try:
        _probe_kernel()
    except NetbedError as exc:
        return False, f"this kernel cannot host the WAN test bed: {exc}"
    return True, ""


def _probe_kernel() -> None:
    """Everything is created inside one namespace, so deleting it removes all of it."""
    tag = PREFIX + secrets.token_hex(_TAG_HEX_CHARS // 2)
    ns = f"{tag}probe"
    _record_owner(tag)
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["ip", "-n", ns, "link", "set", "v0", "master", "br0"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "v1", "root", *_tbf_args(1.0)])
    finally:
        _run_quietly(["ip", "netns", "del", ns])
        _forget_owner(tag)


# --- owners: which process built which test bed ---------------------------------------------------


def _process_start_ticks(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat): a reused pid has a different one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def _record_owner(tag: str) -> None:
    try:
        _OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        (_OWNERS_DIR / tag).write_text(f"{os.getpid()} {_process_start_ticks(os.getpid())}\n")
    except OSError as exc:
        raise NetbedError(f"cannot record the test bed's owner in {_OWNERS_DIR}: {exc}") from exc


def _forget_owner(tag: str) -> None:
    (_OWNERS_DIR / tag).unlink(missing_ok=True)


def _owner_alive(tag: str) -> bool:
    try:
        pid, start_ticks = (_OWNERS_DIR / tag).read_text().split()
    except (OSError, ValueError):
        return False
    return _process_start_ticks(int(pid)) == start_ticks


def _recorded_tags(prefix: str) -> list[str]:
    try:
        return [path.name for path in _OWNERS_DIR.iterdir() if path.name.startswith(prefix)]
    except OSError:
        return []


# --- listing and removing kernel objects ----------------------------------------------------------


def _namespaces(prefix: str) -> list[str]:
    """`ip netns list` writes "NAME" or "NAME (id: N)" per line."""
    names = (line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip())
    return [name for name in names if name.startswith(prefix)]


def _links(prefix: str) -> list[str]:
    """Links of the root namespace; `ip -o link` writes "N: NAME: ..." or, for a veth, "N: NAME@PEER: ..."."""
    lines = _run(["ip", "-o", "link", "show"]).splitlines()
    names = (line.split(":")[1].strip().split("@")[0] for line in lines if line.count(":") >= 2)
    return [name for name in names if name.startswith(prefix)]


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces, then links (veth ends, bridges), whose name starts with `prefix`, live test beds
    included. A link inside a listed namespace is not listed: it goes with its namespace."""
    return _namespaces(prefix) + _links(prefix)


def namespace_pids(ns: str) -> list[int]:
    """Processes running inside namespace `ns` (none when it does not exist)."""
    try:
        return [int(pid) for pid in _run(["ip", "netns", "pids", ns]).split()]
    except NetbedError:
        return []


def _kill_processes_in(ns: str) -> None:
    """SIGKILL what runs in `ns`: a namespace deleted with processes inside lives on, unnamed, and
    keeps its veth end (and the test bed's address) until they exit."""
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if pids:
        log.warning("processes %s in namespace %s survived SIGKILL for %.0f s", pids, ns, _KILL_TIMEOUT_S)


def _remove_namespace(ns: str) -> None:
    _kill_processes_in(ns)
    _run_quietly(["ip", "netns", "del", ns])
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when empty: ours was the last one


def _netns_etc_folders(prefix: str) -> list[Path]:
    try:
        return [path for path in NETNS_ETC.iterdir() if path.name.startswith(prefix)]
    except OSError:
        return []


def _live_tags(prefix: str) -> tuple[str, ...]:
    return tuple(tag for tag in _recorded_tags(prefix) if _owner_alive(tag))


def cleanup_leftovers(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Remove what `leftovers(prefix)` lists, killing the processes inside namespaces first. Test beds
    whose owner process still runs are spared unless `include_live`. Returns the names removed;
    objects already gone are not an error."""
    spared = () if include_live else _live_tags(prefix)
    namespaces = [ns for ns in _namespaces(prefix) if not ns.startswith(spared)]
    for ns in namespaces:
        _remove_namespace(ns)
    # deleting a veth end deletes its peer too, even one inside a namespace that is already unnamed
    links = [link for link in _links(prefix) if not link.startswith(spared)]
    for link in links:
        _run_quietly(["ip", "link", "del", link])
    for folder in _netns_etc_folders(prefix):  # a namespace deleted by someone else leaves its folder
        if not folder.name.startswith(spared):
            _remove_namespace(folder.name)
    for tag in _recorded_tags(prefix):
        if not tag.startswith(spared):
            _forget_owner(tag)
    return namespaces + links


# --- rate limits ----------------------------------------------------------------------------------


def tcp_payload_bytes_per_s(rate_mbit_s: float, busy_frame_bytes_per_s: float = 0.0) -> float:
    """At most what one direction of a link limited to `rate_mbit_s` carries as TCP payload, when
    other traffic already takes `busy_frame_bytes_per_s` of it (as `link_bytes` counts them):
    the rate counts frames, and every full segment's headers take 66 of its 1514 bytes (4.4%). A
    simulator's link figure is payload (sim/costs.py counts tensors' bytes), so a prediction for the
    bed takes this."""
    free_bytes_per_s = max(rate_mbit_s * 1e6 / 8 - busy_frame_bytes_per_s, 0.0)
    return free_bytes_per_s * _TCP_PAYLOAD_BYTES_PER_FRAME / _FRAME_BYTES


def _tbf_args(rate_mbit_s: float) -> list[str]:
    rate_bytes_per_s = rate_mbit_s * 1e6 / 8
    burst_bytes = max(_TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * _TBF_BURST_S))
    rate_kbit_s = round(rate_mbit_s * 1000)  # tc's kbit is 1000 bit
    return ["tbf", "rate", f"{rate_kbit_s}kbit", "burst", str(burst_bytes), "latency", f"{_TBF_LATENCY_MS}ms"]


def _set_egress_limit(ns: str | None, dev: str, rate_mbit_s: float | None) -> None:
    """Limit what `dev` sends to `rate_mbit_s` (None or 0: remove the limit)."""
    tc = ["tc", "-n", ns] if ns else ["tc"]
    if rate_mbit_s:
        _run([*tc, "qdisc", "replace", "dev", dev, "root", *_tbf_args(rate_mbit_s)])
    elif " tbf " in _run([*tc, "qdisc", "show", "dev", dev]):
        _run([*tc, "qdisc", "del", "dev", dev, "root"])


def _check_rate(rate_mbit_s: float | None, what: str) -> float | None:
    if rate_mbit_s and not rate_mbit_s >= _MIN_RATE_MBIT_S:
        raise NetbedError(
            f"{what} must be None/0 (unlimited) or at least {_MIN_RATE_MBIT_S}, got {rate_mbit_s}"
        )
    return rate_mbit_s or None


def _per_peer(rate_mbit_s: float | list[float] | None, num_peers: int, what: str) -> list[float | None]:
    rates = list(rate_mbit_s) if isinstance(rate_mbit_s, list | tuple) else [rate_mbit_s] * num_peers
    if len(rates) != num_peers:
        raise NetbedError(f"{what} has {len(rates)} values for {num_peers} peers")
    return [_check_rate(rate, what) for rate in rates]


# --- addresses ------------------------------------------------------------------------------------


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of every address and (non-default) route of the root namespace."""
    networks = []
    for line in _run(["ip", "-o", "-4", "addr", "show"]).splitlines():
        words = line.split()
        if "inet" in words:
            networks.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show"]).splitlines():
        try:
            networks.append(ipaddress.IPv4Network(line.split()[0], strict=False))
        except (ValueError, IndexError):
            pass  # "default" and the like: they do not claim a subnet
    return networks


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.X.Y.0/24 that overlaps no address or route here (other test beds' included)."""
    in_use = _networks_in_use()
    for _ in range(200):
        x, y = 100 + secrets.randbelow(155), secrets.randbelow(256)  # away from the common 10.0-10.99
        subnet = ipaddress.IPv4Network(f"10.{x}.{y}.0/24")
        if not any(subnet.overlaps(network) for network in in_use):
            return subnet
    raise NetbedError("found no free 10.X.Y.0/24 subnet for the WAN test bed")


# --- the test bed ---------------------------------------------------------------------------------


def close_keeping_first_error(close, exc_type, what: str) -> None:
    """A test bed's `__exit__`: `close()`; a cleanup failure after an error in the body is logged, so
    the body's error is the one raised."""
    try:
        close()
    except NetbedError:
        if exc_type is None:
            raise
        log.exception("%s cleanup failed after an error in its body", what)


class WanTestbed:
    """`num_peers` network namespaces on one bridge, each behind its own upload and download limit
    (Mbit/s; one value for all peers or one per peer; None or 0 = unlimited).

        with WanTestbed(2, up_mbit_s=[8, None], down_mbit_s=50) as bed:
            ManagedProcess("p0", bed.wrap(0, ["swarmtrain", "dht", "--host", bed.host(0)]), log)

    Kernel objects exist between `start()` (or `with`) and `close()`; `close()` also runs when
    `start()` fails half-way, and at interpreter exit for a test bed nobody closed.
    """

    def __init__(
        self,
        num_peers: int,
        up_mbit_s: float | list[float] | None = None,
        down_mbit_s: float | list[float] | None = None,
        name_prefix: str = PREFIX,
    ) -> None:
        if not 1 <= num_peers <= _MAX_PEERS:
            raise NetbedError(f"a WAN test bed holds 1 to {_MAX_PEERS} peers, got {num_peers}")
        if not (name_prefix.isascii() and name_prefix.isalnum()):
            raise NetbedError(f"name_prefix must be ASCII letters and digits, got {name_prefix!r}")
        self.num_peers = num_peers
        self.up_mbit_s = _per_peer(up_mbit_s, num_peers, "up_mbit_s")
        self.down_mbit_s = _per_peer(down_mbit_s, num_peers, "down_mbit_s")
        self.tag = name_prefix + secrets.token_hex(_TAG_HEX_CHARS // 2)
        if len(self._host_veth(num_peers - 1)) > _IFNAME_MAX_CHARS:
            raise NetbedError(
                f"name_prefix {name_prefix!r} is too long: interface names exceed 15 characters"
            )
        self.bridge = f"{self.tag}br"
        self._subnet: ipaddress.IPv4Network | None = None
        self._owner_pid: int | None = None  # set while started

    # names and addresses

    def namespace(self, i: int) -> str:
        return f"{self.tag}-{self._index(i)}"

    def _host_veth(self, i: int) -> str:
        return f"{self.tag}h{i}"  # the bridge's end: its egress is the peer's download

    def _peer_veth(self, i: int) -> str:
        return f"{self.tag}p{i}"  # the namespace's end: its egress is the peer's upload

    def _index(self, i: int) -> int:
        if not 0 <= i < self.num_peers:
            raise IndexError(f"peer {i} of a test bed with {self.num_peers} peers")
        return i

    def host(self, i: int) -> str:
        """Peer i's IPv4 address (what it listens on, what other peers dial)."""
        return str(self._started_subnet()[self._index(i) + 2])

    def bridge_host(self) -> str:
        """The root namespace's address on the bridge: peers reach processes outside the test bed here."""
        return str(self._started_subnet()[1])

    def _started_subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise NetbedError("the WAN test bed is not started: use `with WanTestbed(...)` or start()")
        return self._subnet

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside peer i's namespace. `ip netns exec` execs it: same pid, same process group."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def pids(self, i: int) -> list[int]:
        """Processes now running inside peer i's namespace."""
        return namespace_pids(self.namespace(i))

    # life cycle

    def __enter__(self) -> WanTestbed:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        close_keeping_first_error(self.close, exc_type, "WAN test bed")

    def start(self) -> WanTestbed:
        if self._owner_pid is not None:
            raise NetbedError(f"WAN test bed {self.tag} is already started")
        _require_root()
        _record_owner(self.tag)  # before any object exists, so a concurrent cleanup spares them
        self._owner_pid = os.getpid()
        _open_beds.add(self)
        try:
            self._subnet = _free_subnet()
            self._create_bridge()
            for i in range(self.num_peers):
                self._create_peer(i)
                self.set_rate(i, self.up_mbit_s[i], self.down_mbit_s[i])
        except BaseException:
            self.close()
            raise
        return self

    def _create_bridge(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_host()}/{self._subnet.prefixlen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def _create_peer(self, i: int) -> None:
        ns, host_veth, peer_veth = self.namespace(i), self._host_veth(i), self._peer_veth(i)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", host_veth, "type", "veth", "peer", "name", peer_veth, "netns", ns])
        _run(["ip", "link", "set", host_veth, "master", self.bridge])
        _run(["ip", "link", "set", host_veth, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/{self._subnet.prefixlen}", "dev", peer_veth])
        _run(["ip", "-n", ns, "link", "set", peer_veth, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # peers talk to their own p2pd over loopback

    def set_rate(self, i: int, up_mbit_s: float | None, down_mbit_s: float | None) -> None:
        """Change peer i's limits now (None or 0: unlimited); open connections continue at the new rate."""
        up_mbit_s, down_mbit_s = _check_rate(up_mbit_s, "up_mbit_s"), _check_rate(down_mbit_s, "down_mbit_s")
        self._started_subnet()
        _set_egress_limit(self.namespace(i), self._peer_veth(i), up_mbit_s)
        _set_egress_limit(None, self._host_veth(i), down_mbit_s)
        self.up_mbit_s[i], self.down_mbit_s[i] = up_mbit_s, down_mbit_s

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(uploaded, downloaded): the bytes of the packets peer i has sent and received so far, headers
        included, counted on the bridge's end of its veth (what it receives the peer sent). A packet is
        counted as the kernel passed it: a segmentation-offloaded one carries many segments under one
        set of headers, so bulk transfers read up to ~4% below their frames; small packets (the control
        plane's) are counted whole."""
        self._started_subnet()
        stats = Path("/sys/class/net") / self._host_veth(self._index(i)) / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def cut(self, i: int) -> None:
        """Cut peer i's link (its bridge-side veth down): packets to and from it are dropped, open
        connections hang rather than reset, like a cable pulled or a partition."""
        self._started_subnet()
        _run(["ip", "link", "set", self._host_veth(self._index(i)), "down"])

    def reconnect(self, i: int) -> None:
        """Undo `cut(i)`: the link comes back with its limits, open connections resume if still alive."""
        self._started_subnet()
        _run(["ip", "link", "set", self._host_veth(self._index(i)), "up"])

    def names(self) -> set[str]:
        """Every namespace and root-namespace link this test bed creates."""
        peers = range(self.num_peers)
        return {self.bridge, *(self.namespace(i) for i in peers), *(self._host_veth(i) for i in peers)}

    def close(self) -> None:
        """Kill what still runs inside, delete the namespaces (and their veth ends), the other veth ends
        and the bridge. Idempotent; objects already gone are fine. Raises NetbedError if any remain."""
        if self._owner_pid is None:
            return
        for i in range(self.num_peers):
            _remove_namespace(self.namespace(i))
        for i in range(self.num_peers):  # normally gone with their namespace
            _run_quietly(["ip", "link", "del", self._host_veth(i)])
        _run_quietly(["ip", "link", "del", self.bridge])
        remaining = sorted(set(leftovers(self.tag)) & self.names())
        if remaining:
            raise NetbedError(f"WAN test bed {self.tag}: could not remove {', '.join(remaining)}")
        _forget_owner(self.tag)
        _open_beds.discard(self)
        self._owner_pid = None
        self._subnet = None


@atexit.register
def _close_forgotten_beds() -> None:
    """Last resort for test beds never closed. Only their owner closes them: a forked child that
    exits normally must not tear down its parent's test bed."""
    for bed in list(_open_beds):
        if bed._owner_pid == os.getpid():
            try:
                bed.close()
            except NetbedError as exc:
                log.warning("%s", exc)
