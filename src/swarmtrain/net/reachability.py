"""Can the swarm open a connection to this peer? A dial-back check at start-up.

A server or replica behind a NAT or a firewall, with no relay, is a trap: it joins the DHT (it dials
out, and libp2p answers over the connections it opened), announces itself, and then every peer it has
not dialed first fails to reach it. Trainers retry it micro-batch after micro-batch; the peer itself
never learns why. libp2p's own detection cannot tell us: its AutoNAT servers refuse to dial
private-range addresses back (a LAN, a cloud VPC, the NAT test bed) and p2pd does not expose its verdict.

So every peer that accepts connections serves `DIAL_BACK` (in its DHT process, beside the DHT), and a
peer that must be reachable (neither client mode nor auto-relay) asks its initial peers at start-up to
open a new TCP connection to it. The asked peer dials the IP it sees the request come from, never an
address the asker names (no port probes on anyone's behalf), at each TCP port the asker announces.
No answer (an older peer, a timeout) is no verdict; "unreachable" from a peer that answered, and
"reachable" from none, is the one-line error of `unreachable_reason`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import time

from swarmtrain.utils.logging import get_logger

logger = get_logger(__name__)

DIAL_BACK = "swarmtrain.DialBack"  # the handler's protocol name
DIAL_TIMEOUT_S = 3.0  # one TCP connection attempt by the asked peer
ASK_TIMEOUT_S = 10.0  # the whole request: its dials plus the round trip
_MAX_PORTS = 4  # ports of one asker the asked peer dials (a peer announces one or two)
_DIALS_AT_ONCE = 4  # requests one peer serves concurrently; the rest wait
_ASK_AT_MOST = 3  # initial peers asked
RELAY_WAIT_S = 60.0  # how long a peer behind a NAT (--auto-relay) waits for a relay before it serves
_RELAY_POLL_S = 0.5
MAX_REQUEST_BYTES = 1 << 16  # a request names a few addresses (a few hundred bytes each at most)

_dial_slots: asyncio.Semaphore | None = None  # made in the DHT process's event loop


# --- pure logic -------------------------------------------------------------------------------------


def ip_and_tcp_port(addr: str) -> tuple[str | None, int | None]:
    """("1.2.3.4", 5) for /ip4/1.2.3.4/tcp/5[/p2p/ID]; None for parts a relayed, DNS or UDP address
    lacks (a circuit address is the relay's, not the peer's)."""
    parts = addr.strip("/").split("/")
    if "p2p-circuit" in parts:
        return None, None
    fields = dict(zip(parts[::2], parts[1::2], strict=False))
    ip = fields.get("ip4") or fields.get("ip6")
    port = fields.get("tcp")
    return ip, int(port) if port and port.isdigit() else None


def dial_targets(observed_addrs: list[str], announced_addrs: list[str]) -> list[tuple[str, int]]:
    """(ip, port) pairs to dial back: every IP the asker's connections come from (as this peer sees
    them) with every TCP port it announces, at most `_MAX_PORTS` ports."""
    ips = dict.fromkeys(ip for ip, _ in map(ip_and_tcp_port, observed_addrs) if ip)
    ports = dict.fromkeys(port for _, port in map(ip_and_tcp_port, announced_addrs) if port)
    return [(ip, port) for ip in ips for port in list(ports)[:_MAX_PORTS]]


def all_loopback(addrs: list[str]) -> bool:
    """Whether every address is a loopback one: a swarm on one machine, where nothing can be in the way."""
    ips = [ip for ip, _ in map(ip_and_tcp_port, addrs)]
    return bool(ips) and all(ip is not None and ipaddress.ip_address(ip).is_loopback for ip in ips)


def peer_id_of(addr: str) -> str:
    """The peer id an --initial-peers multiaddr ends with (the last /p2p/ component)."""
    return addr.rstrip("/").rsplit("/p2p/", 1)[-1]


def unreachable_reason(answers: list[dict | None]) -> str | None:
    """The error when the answers say nobody can connect to this peer; None when one could, or when
    nobody gave a verdict (no answer, or nothing to dial)."""
    verdicts = [a for a in answers if a and a.get("reachable") is not None]
    if not verdicts or any(a["reachable"] for a in verdicts):
        return None
    tried = ", ".join(sorted({t for a in verdicts for t in a.get("tried", [])}))
    return (
        f"this peer cannot be reached: its initial peers could not open a connection to it (tried "
        f"{tried}, where they see it). Behind a NAT or firewall without port forwarding, start it with "
        "--auto-relay (others reach it through a relay) or, for a replica, --client-mode; with a "
        "forwarded port, pass --announce-addr /ip4/PUBLIC_IP/tcp/PORT (README: Across the internet)"
    )


# --- the asked peer (runs in its DHT process) ---------------------------------------------------------


async def serve_dial_backs(_dht, node) -> None:
    """`DHT.run_coroutine` target: answer DIAL_BACK requests on this DHT's libp2p daemon."""
    from hivemind.proto import runtime_pb2

    handler = functools.partial(_dial_back, node.p2p)
    try:
        await node.p2p.add_protobuf_handler(DIAL_BACK, handler, runtime_pb2.ExpertRequest)
    except Exception as exc:  # others' checks then get no verdict from us; this peer itself is fine
        logger.warning("cannot answer other peers' reachability checks: %r", exc)


async def _dial_back(p2p, request, context):
    from hivemind.proto import runtime_pb2

    global _dial_slots
    try:
        announced = announced_addrs(request.metadata)
    except ValueError as exc:  # a malformed request: answered with the reason, nothing dialed
        logger.info("refused a dial-back request from %s: %s", context.remote_id, exc)
        return runtime_pb2.ExpertResponse(
            metadata=json.dumps({"reachable": None, "error": str(exc)}).encode()
        )
    _dial_slots = _dial_slots or asyncio.Semaphore(_DIALS_AT_ONCE)
    async with _dial_slots:
        observed = [
            str(a) for info in await p2p.list_peers() if info.peer_id == context.remote_id for a in info.addrs
        ]
        targets = dial_targets(observed, announced)
        connected = await asyncio.gather(*(_tcp_connects(ip, port) for ip, port in targets))
    reply = {
        "reachable": any(connected) if targets else None,
        "tried": [f"{ip}:{port}" for ip, port in targets],
    }
    return runtime_pb2.ExpertResponse(metadata=json.dumps(reply).encode())


def announced_addrs(metadata: bytes) -> list[str]:
    """The addresses a dial-back request announces (a stranger's bytes); ValueError, with the reason in
    one line, for anything but a JSON object whose `addrs` is a list of strings."""
    if len(metadata) > MAX_REQUEST_BYTES:
        raise ValueError(f"a request of {len(metadata)} bytes (at most {MAX_REQUEST_BYTES})")
    try:
        fields = json.loads(metadata or b"{}")
    except RecursionError:  # deeply nested JSON
        raise ValueError("a request that nests too deeply") from None
    except ValueError:  # not JSON, not UTF-8, an integer beyond Python's digit limit
        raise ValueError("a request that is not JSON") from None
    addrs = fields.get("addrs", []) if isinstance(fields, dict) else None
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        raise ValueError("a request without a list of addresses")
    return addrs


def checked_answer(metadata: bytes) -> dict | None:
    """A dial-back answer (an asked peer's bytes) as `unreachable_reason` reads it: {"reachable": True,
    False or None, "tried": [str]}; None (no verdict) for anything malformed."""
    try:
        fields = json.loads(metadata)
    except (ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return None
    if not isinstance(fields, dict):
        return None
    reachable, tried = fields.get("reachable"), fields.get("tried", [])
    if not (reachable is None or isinstance(reachable, bool)) or not isinstance(tried, list):  # 0 == False
        return None
    return {"reachable": reachable, "tried": [str(t)[:64] for t in tried[: 4 * _MAX_PORTS]]}


async def _tcp_connects(ip: str, port: int) -> bool:
    """A fresh TCP connection, the handshake only: what a peer that never met the asker would open."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
    except OSError:  # TimeoutError included
        return False
    writer.close()
    return True


# --- the asking peer ------------------------------------------------------------------------------------


async def ask_dial_back(_dht, node, peer_ids: list[str]) -> list[dict | None]:
    """`DHT.run_coroutine` target: ask each peer to dial this one back; None for a peer that gave no answer."""
    from hivemind.proto import runtime_pb2

    try:
        announced = [str(a) for a in await node.p2p.get_visible_maddrs(latest=True)]
    except Exception as exc:  # raised here, it would print a traceback from the DHT process
        logger.debug("no visible addresses to be dialed back at: %r", exc)
        return []
    request = runtime_pb2.ExpertRequest(metadata=json.dumps({"addrs": announced}).encode())
    answers = await asyncio.gather(*(_ask(node.p2p, peer_id, request) for peer_id in peer_ids))
    return list(answers)


async def _ask(p2p, peer_id: str, request) -> dict | None:
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    try:
        call = p2p.call_protobuf_handler(
            PeerID.from_base58(peer_id), DIAL_BACK, request, runtime_pb2.ExpertResponse
        )
        response = await asyncio.wait_for(call, ASK_TIMEOUT_S)
    except Exception as exc:  # an older peer without the handler, a timeout: no verdict from it
        logger.debug("no dial-back answer from %s: %r", peer_id, exc)
        return None
    answer = checked_answer(response.metadata)
    if answer is None:
        logger.info("a malformed dial-back answer from %s: no verdict from it", peer_id)
    return answer


def check_reachable(dht, initial_peers: list[str], visible_addrs: list[str]) -> str | None:
    """The error when this peer's initial peers cannot connect to it (None: reachable, or unknown).
    A peer on loopback only is on the same machine as every peer it meets: nothing to check."""
    if not initial_peers or all_loopback(visible_addrs):
        return None
    peer_ids = list(dict.fromkeys(peer_id_of(p) for p in initial_peers))[:_ASK_AT_MOST]
    answers = dht.run_coroutine(functools.partial(ask_dial_back, peer_ids=peer_ids))
    logger.debug("dial-back answers: %s", answers)
    return unreachable_reason(answers)


def relayed(addrs: list[str]) -> list[str]:
    """The addresses among `addrs` that reach this peer through a circuit relay."""
    return [a for a in addrs if "/p2p-circuit" in a]


def wait_for_relay(visible_addrs, timeout_s: float = RELAY_WAIT_S) -> list[str]:
    """Poll `visible_addrs()` until one reaches this peer through a relay, for at most `timeout_s`:
    the relayed addresses, or [] after a warning. A server behind a NAT that announced itself first
    took micro-batches it could not finish: a trainer's closes reach it only through a relay, and a
    step's micro-batches wait at it for the close of the step before (tests/integration/test_nat.py)."""
    logger.info("behind a NAT (--auto-relay): waiting for a relay to reserve a slot for this peer")
    start_s = time.monotonic()
    while True:
        addrs = relayed(visible_addrs())
        waited_s = time.monotonic() - start_s
        if addrs:
            logger.info("reachable through a relay after %.1f s: %s", waited_s, addrs[0])
            return addrs
        if waited_s >= timeout_s:
            logger.warning(
                "no relay reserved a slot for this peer in %.0f s; going on: peers reach it only over "
                "connections it opens until one does (start public `swarmtrain dht` peers to relay)",
                timeout_s,
            )
            return []
        time.sleep(_RELAY_POLL_S)
