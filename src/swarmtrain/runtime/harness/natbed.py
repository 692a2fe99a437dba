"""Peers behind an emulated NAT on the WAN test bed (tests and benches only).

A `NatTestbed` wraps a `WanTestbed` (runtime/harness/netbed.py) whose last bridge peer is a home router:
its namespace has the public side (a veth on the bridge, with the test bed's rate limits) and a private
LAN (a bridge inside it) on which each private peer's namespace hangs by a veth, on a subnet of its
own, with a default route through the router. The router forwards and masquerades what its LAN sends
out (`iptables -t nat ... -j MASQUERADE`) and, like a home router's stateful firewall, forwards to the
LAN only the answers to connections the LAN opened (`FORWARD` policy DROP, conntrack ESTABLISHED,RELATED
accepted). So a private peer dials every public peer, and every public peer sees it as the router's
address; nobody outside opens a connection to it, even a peer that routes the LAN's subnet through
the router (the public namespaces have no route there at all). No port is forwarded, no UPnP.

Peers are numbered 0..num_public-1 (public, on the bridge) then num_public.. (private, behind the NAT);
`wrap(i, argv)`, `host(i)`, `namespace(i)` and `pids(i)` work for both, so a launcher (`LocalSwarm(...,
netbed=bed)`) treats a NatTestbed like a WanTestbed. The private namespaces are named after the test
bed's tag, so `netbed.leftovers()` / `netbed.cleanup_leftovers()` find and remove them too, and `close()`
(also run when `start()` fails half-way and at interpreter exit) removes them first.

Public peers also get DNS names (`hostname(i)`, resolved in every namespace of the test bed through
/etc/netns/NS/hosts): libp2p treats private-range addresses as unroutable and announces no relayed
address through a relay it knows only by one, so relay peers here announce a name instead. The router
counts what its LAN sends each public peer directly (`lan_bytes_to(i)`): zero means the private peers
sent that peer nothing over a direct connection (whatever they exchanged went through a relay).

Needs what the WAN test bed needs, plus iptables with the nat table and conntrack inside a namespace,
and `sysctl` (procps); `available()` says what is missing. iptables: the nf_tables variant
(`iptables-nft`, Debian's default) is tried first, the legacy one second; the rules live only in the
router's namespace, so the variant never meets the host's own firewall.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import logging
import os
import secrets
import shutil

from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.netbed import NetbedError, WanTestbed

log = logging.getLogger(__name__)

_IPTABLES_VARIANTS = ("iptables-nft", "iptables-legacy", "iptables")
_LAN_BRIDGE = "lan0"  # inside the router's namespace: no name clash with the root namespace's links
_PRIVATE_IF = "eth0"  # a private peer's end of its veth, inside its own namespace
_MAX_PRIVATE_PEERS = 250  # one /24: .1 is the router's LAN address, peers from .2
_HOSTS_HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"

_open_nat_beds: set[NatTestbed] = set()


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "") when this machine can build a NAT test bed, else (False, the reason) for a skip
    message. Probes once per process (a throwaway namespace with the router's rules)."""
    ok, why = netbed.available()
    if not ok:
        return False, why
    if shutil.which("sysctl") is None:
        return False, "the NAT test bed needs sysctl (procps) on PATH"
    if iptables() is None:
        return False, (
            "the NAT test bed needs iptables with the nat table and conntrack in a network namespace "
            f"(tried {', '.join(_IPTABLES_VARIANTS)}; `apt-get install iptables`)"
        )
    return True, ""


@functools.cache
def iptables() -> str | None:
    """The first iptables variant that can set up the router's rules in a namespace here, or None."""
    for variant in _IPTABLES_VARIANTS:
        if shutil.which(variant) is not None and _probe_iptables(variant):
            return variant
    return None


def _probe_iptables(variant: str) -> bool:
    tag = netbed.PREFIX + secrets.token_hex(3)
    ns = f"{tag}nat"
    netbed._record_owner(tag)  # a concurrent cleanup spares it
    try:
        netbed._run(["ip", "netns", "add", ns])
        _router_rules(variant, ns, "lo", ipaddress.IPv4Network("10.0.0.0/24"))
        return True
    except NetbedError as exc:
        log.debug("%s cannot set up a NAT here: %s", variant, exc)
        return False
    finally:
        netbed._run_quietly(["ip", "netns", "del", ns])
        netbed._forget_owner(tag)


def _router_rules(variant: str, ns: str, wan_if: str, lan: ipaddress.IPv4Network) -> None:
    """Masquerade what the LAN sends out through `wan_if`; let in only answers to the LAN's connections."""
    ipt = ["ip", "netns", "exec", ns, variant]
    netbed._run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    netbed._run([*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", str(lan), "-o", wan_if, "-j", "MASQUERADE"])
    netbed._run([*ipt, "-P", "FORWARD", "DROP"])
    netbed._run([*ipt, "-A", "FORWARD", "-s", str(lan), "-o", wan_if, "-j", "ACCEPT"])
    established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    netbed._run([*ipt, "-A", "FORWARD", "-i", wan_if, "-d", str(lan), *established])


class NatTestbed:
    """`num_public` peers on the WAN test bed's bridge and `num_private` peers behind one NAT router
    (itself one more bridge peer: `up_mbit_s` / `down_mbit_s`, one value or one per bridge peer with
    the router last, limit its uplink, which the private peers share; their LAN is unlimited).

        with NatTestbed(2, 1) as bed:   # peers 0, 1 public; peer 2 behind the NAT
            ManagedProcess("srv", bed.wrap(2, ["swarmtrain", "server", "--host", bed.host(2), ...]), log)
    """

    def __init__(
        self,
        num_public: int,
        num_private: int,
        up_mbit_s: float | list[float] | None = None,
        down_mbit_s: float | list[float] | None = None,
        name_prefix: str = netbed.PREFIX,
    ) -> None:
        if num_public < 1 or not 1 <= num_private <= _MAX_PRIVATE_PEERS:
            raise NetbedError(
                f"a NAT test bed holds at least 1 public peer and 1 to {_MAX_PRIVATE_PEERS} private "
                f"peers, got {num_public} and {num_private}"
            )
        self.wan = WanTestbed(num_public + 1, up_mbit_s, down_mbit_s, name_prefix)  # the router last
        self.tag = self.wan.tag
        self.num_public, self.num_private = num_public, num_private
        self.num_peers = num_public + num_private
        self._lan: ipaddress.IPv4Network | None = None  # set while started
        self._iptables: str | None = None

    # names and addresses

    def is_private(self, i: int) -> bool:
        if not 0 <= i < self.num_peers:
            raise IndexError(f"peer {i} of a NAT test bed with {self.num_peers} peers")
        return i >= self.num_public

    def namespace(self, i: int) -> str:
        return f"{self.tag}-n{i - self.num_public}" if self.is_private(i) else self.wan.namespace(i)

    @property
    def router_namespace(self) -> str:
        return self.wan.namespace(self.num_public)

    def router_host(self) -> str:
        """The NAT's public address: what public peers see as the source of every private peer."""
        return self.wan.host(self.num_public)

    def lan(self) -> ipaddress.IPv4Network:
        """The private peers' subnet (behind the router)."""
        if self._lan is None:
            raise NetbedError("the NAT test bed is not started: use `with NatTestbed(...)` or start()")
        return self._lan

    def host(self, i: int) -> str:
        """Peer i's IPv4 address: public peers' on the bridge, private peers' on the LAN (unreachable
        from the public side)."""
        if self.is_private(i):
            return str(self.lan()[i - self.num_public + 2])
        return self.wan.host(i)

    def bridge_host(self) -> str:
        return self.wan.bridge_host()

    def hostname(self, i: int) -> str:
        """Public peer i's DNS name, resolved to `host(i)` in every namespace of this test bed (through
        /etc/netns/NS/hosts, which `ip netns exec` puts in place of /etc/hosts). libp2p counts every
        private-range address as unroutable, so a relay known only by its 10.x address gets no
        relayed address announced (autorelay's cleanupAddressSet keeps public and DNS addresses
        only); a relay that announces `/dns4/hostname(i)/tcp/PORT` does."""
        if self.is_private(i):
            raise NetbedError(f"peer {i} is behind the NAT: it has no public name")
        return f"peer{i}.{self.tag}.test"

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside peer i's namespace (same pid and process group: `ip netns exec` execs)."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def pids(self, i: int) -> list[int]:
        return netbed.namespace_pids(self.namespace(i))

    def names(self) -> set[str]:
        """Every namespace and root-namespace link this test bed creates."""
        private = (self.namespace(i) for i in range(self.num_public, self.num_peers))
        return self.wan.names() | set(private)

    # life cycle

    def __enter__(self) -> NatTestbed:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        netbed.close_keeping_first_error(self.close, exc_type, "NAT test bed")

    def start(self) -> NatTestbed:
        if self._lan is not None:
            raise NetbedError(f"NAT test bed {self.tag} is already started")
        netbed._require_root()  # before probing iptables, whose failure would hide the reason
        self._iptables = iptables()
        if self._iptables is None:
            raise NetbedError(available()[1] or "no working iptables for the NAT test bed")
        self.wan.start()  # records the owner under the shared tag: a concurrent cleanup spares us
        _open_nat_beds.add(self)
        try:
            self._lan = netbed._free_subnet()  # after the bridge exists: never the public subnet
            self._create_router()
            for i in range(self.num_public, self.num_peers):
                self._create_private_peer(i)
            self._write_hosts_files()
        except BaseException:
            self.close()
            raise
        return self

    def _create_router(self) -> None:
        ns, lan = self.router_namespace, self.lan()
        netbed._run(["ip", "-n", ns, "link", "add", _LAN_BRIDGE, "type", "bridge"])
        netbed._run(["ip", "-n", ns, "addr", "add", f"{lan[1]}/{lan.prefixlen}", "dev", _LAN_BRIDGE])
        netbed._run(["ip", "-n", ns, "link", "set", _LAN_BRIDGE, "up"])
        wan_if = self.wan._peer_veth(self.num_public)
        _router_rules(self._iptables or "iptables", ns, wan_if, lan)
        for i in range(self.num_public):  # counting rules (no target), ahead of the ACCEPT
            self._iptables_run(["-I", "FORWARD", "1", "-s", str(lan), "-d", self.host(i)])

    def _iptables_run(self, args: list[str]) -> str:
        return netbed._run(
            ["ip", "netns", "exec", self.router_namespace, self._iptables or "iptables", *args]
        )

    def lan_bytes_to(self, i: int) -> int:
        """Bytes (IP packets) the router forwarded from its LAN to public peer i since start: what the
        private peers sent it over direct connections, none of what went through a relay."""
        if self.is_private(i):
            raise NetbedError(f"peer {i} is behind the NAT; count bytes to public peers")
        listing = self._iptables_run(["-L", "FORWARD", "-v", "-x", "-n"])
        for line in listing.splitlines():
            words = line.split()
            # "pkts bytes [target] prot opt in out source destination": the counting rules have no target
            if words[-2:] == [str(self.lan()), self.host(i)] and "ACCEPT" not in words:
                return int(words[1])
        raise NetbedError(f"no counting rule for peer {i} in the router's FORWARD chain:\n{listing}")

    def _create_private_peer(self, i: int) -> None:
        router, ns, lan = self.router_namespace, self.namespace(i), self.lan()
        router_veth = f"r{i - self.num_public}"
        netbed._run(["ip", "netns", "add", ns])
        netbed._run(
            ["ip", "-n", router, "link", "add", router_veth, "type", "veth"]
            + ["peer", "name", _PRIVATE_IF, "netns", ns]
        )
        netbed._run(["ip", "-n", router, "link", "set", router_veth, "master", _LAN_BRIDGE])
        netbed._run(["ip", "-n", router, "link", "set", router_veth, "up"])
        netbed._run(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/{lan.prefixlen}", "dev", _PRIVATE_IF])
        netbed._run(["ip", "-n", ns, "link", "set", _PRIVATE_IF, "up"])
        netbed._run(["ip", "-n", ns, "link", "set", "lo", "up"])  # peers talk to their own p2pd over loopback
        netbed._run(["ip", "-n", ns, "route", "add", "default", "via", str(lan[1])])

    def _namespaces(self) -> list[str]:
        return [*(self.namespace(i) for i in range(self.num_peers)), self.router_namespace]

    def _write_hosts_files(self) -> None:
        lines = "".join(f"{self.host(i)}\t{self.hostname(i)}\n" for i in range(self.num_public))
        for ns in self._namespaces():
            folder = netbed.NETNS_ETC / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(_HOSTS_HEADER + lines)

    def close(self) -> None:
        """Kill what runs behind the NAT, delete the private namespaces, then the WAN test bed (router
        included). Idempotent; raises NetbedError if anything remains."""
        for i in range(self.num_public, self.num_peers):
            netbed._remove_namespace(self.namespace(i))
        self.wan.close()  # raises for its own remains; each namespace's /etc/netns folder goes with it
        remaining = sorted(set(netbed.leftovers(self.tag)) & self.names())
        if remaining:
            raise NetbedError(f"NAT test bed {self.tag}: could not remove {', '.join(remaining)}")
        _open_nat_beds.discard(self)
        self._lan = None


@atexit.register
def _close_forgotten_nat_beds() -> None:
    """Last resort for NAT test beds never closed, by their owner only (as netbed's own)."""
    for bed in list(_open_nat_beds):
        if bed.wan._owner_pid == os.getpid():
            try:
                bed.close()
            except NetbedError as exc:
                log.warning("%s", exc)
