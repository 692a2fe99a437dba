"""Starting hivemind safely: environment knobs set before its import, DHT creation, address parsing.

hivemind changes process-wide state when imported (torch sharing strategy, log handlers) and its
components fork; these helpers are called by entry points only, before any thread is started.
See docs/DESIGN.md section 4 for the traps they avoid.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarmtrain.config.errors import UserError
from swarmtrain.net.auth import RunKey, keyless_record_filter, record_validator
from swarmtrain.utils.logging import get_logger

if TYPE_CHECKING:  # hivemind (which identity imports) only after prepare_environment
    from swarmtrain.net.identity import PeerIdentity

logger = get_logger(__name__)


class NetworkError(UserError):
    """The local node could not start or join the swarm (bad address, unreachable bootstrap peer)."""


def prepare_environment(log_level: str = "WARNING") -> None:
    """Set hivemind/p2pd knobs; must run before `import hivemind` anywhere in the process."""
    # file_descriptor sharing leaves no /dev/shm/torch_* files behind after a SIGKILL
    os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", log_level)
    os.environ.setdefault("GOLOG_LOG_LEVEL", "fatal")
    os.environ.setdefault("USE_LEGACY_BFLOAT16", "0")  # send bf16 as 2 bytes, not as fp32
    asyncio.set_event_loop_policy(StopTolerantLoopPolicy())


# the multiprocessing locks hivemind makes at import, which `renew_after_preloaded_fork` makes again
# (tests/integration/test_preloaded.py looks for any other lock a preloaded module makes at import)
LOCKS_MADE_AT_IMPORT = (
    "hivemind.utils.asyncio._AsyncContextWrapper.EXECUTOR_LOCK",
    "hivemind.utils.mpfuture.MPFuture._initialization_lock",
    "hivemind.utils.mpfuture.MPFuture._update_lock",
    "hivemind.utils.mpfuture.SharedBytes._lock",
)


def renew_after_preloaded_fork() -> None:
    """In a peer forked from a process that imported hivemind before this process's environment was set
    (the test harness's fork server, runtime/harness/preloaded.py): what hivemind set up at import, made
    again as a fresh interpreter would. Its tensor sharing strategy, read from the environment at import
    (the fork server's had no `prepare_environment`: `file_system`, which leaves /dev/shm files behind
    after a SIGKILL). And the multiprocessing locks it makes at import, meant for one process and its own
    forks: made in the fork server, one set was every peer's, and a peer SIGKILLed while it held
    `SharedBytes._lock` (taken for every DHT call) left every other peer of the test session, later ones
    too, waiting forever at their next DHT call (docs/LOG.md, "twenty-seventh session")."""
    prepare_environment()
    import multiprocessing

    import torch.multiprocessing
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    torch.multiprocessing.set_sharing_strategy(os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"])
    MPFuture.reset_backend()  # hivemind's own: new MPFuture and SharedBytes locks; no future exists yet
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


class StopTolerantLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """Event loops that stay quiet when the libp2p daemon is gone. A Ctrl-C or SIGTERM to a peer's
    process group stops its `p2pd` at once; hivemind's daemon bindings then fail in background tasks
    nobody awaits (writing to the daemon's socket: `ConnectionResetError`, the socket file removed:
    `FileNotFoundError`), and asyncio printed each as "Task exception was never retrieved" with a
    traceback, 3-7 per stopped server. Those failures are expected on a stop and logged at debug;
    every other unhandled exception goes to asyncio's default handler as before."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        loop.set_exception_handler(_daemon_gone_or_default)
        return loop


DAEMON_GONE_ERRORS = (ConnectionError, FileNotFoundError, asyncio.IncompleteReadError, EOFError)


def _daemon_gone_or_default(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if isinstance(context.get("exception"), DAEMON_GONE_ERRORS) and _in_daemon_bindings(context):
        logger.debug("libp2p daemon gone: %s", context.get("message"))
        return
    if _cancelled_stream_handler(context):
        logger.debug("stream handler cancelled on stop: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


def _cancelled_stream_handler(context: dict) -> bool:
    """Python 3.11's `StreamReaderProtocol` asks a finished connection handler task for its exception
    without checking whether it was cancelled, so every unix-socket stream handler of hivemind's daemon
    bindings that a stop cancels printed "Exception in callback StreamReaderProtocol.connection_made.
    <locals>.callback ... (CancelledError)" into a stopping server's log (seen in the netbed chaos
    bench's logs). A cancelled handler on a stop is expected; Python 3.12 no longer reports it."""
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    name = getattr(callback, "__qualname__", "")
    return isinstance(context.get("exception"), asyncio.CancelledError) and name.startswith(
        "StreamReaderProtocol.connection_made"
    )


def _in_daemon_bindings(context: dict) -> bool:
    """Whether the failed task or future ran hivemind's P2P code (its daemon bindings)."""
    future = context.get("future") or context.get("task")
    coro = future.get_coro() if isinstance(future, asyncio.Task) else None
    code = getattr(coro, "cr_code", None)
    return code is not None and f"hivemind{os.sep}p2p" in code.co_filename


def restore_sigint(handler=None) -> None:
    """hivemind's DHT and averagers set SIGINT to ignored in the parent and never restore it: put back
    `handler` (what was there before them: a peer's own stop handler), or Python's KeyboardInterrupt."""
    signal.signal(signal.SIGINT, handler if callable(handler) else signal.default_int_handler)


@dataclass(frozen=True)
class PeerNetwork:
    """How this peer meets the others: where it listens and what it announces, its identity, the
    run key of a private run, and the NAT options (relays, client mode)."""

    host: str = "127.0.0.1"
    port: int = 0
    # the peer's private key file (created when missing): its peer id, and with a fixed port its
    # whole address, survive restarts
    identity_path: str | None = None
    run_key: RunKey | None = None
    # addresses others should dial (a public IP or a port forward in front of this peer); default:
    # what libp2p sees locally
    announce_addrs: tuple[str, ...] = ()
    use_relay: bool = True  # may be reached through, and reach others through, circuit relays
    use_auto_relay: bool = False  # behind NAT: find relays and announce relayed addresses
    client_mode: bool = False  # accepts no incoming connections (behind a NAT with no relay)


def start_dht(
    initial_peers: list[str] | None,
    network: PeerNetwork | None = None,
    *,
    client_mode: bool = False,
    startup_timeout_s: float = 20.0,
    identity: PeerIdentity | None = None,
):
    """Start a hivemind DHT (own process + p2pd) and return it; bootstrap failures become NetworkError.
    `client_mode`: this role never serves (trainers, probes), whatever `network.client_mode` says.
    `identity`: the key p2pd runs with (`peer_identity(network)`), for a process that signs with it."""
    prepare_environment()
    from hivemind.dht import DHT

    network = network or PeerNetwork()
    extra = _dht_options(network)
    if network.identity_path:
        extra["identity_path"] = str(_identity_file(network.identity_path))
    with _identity_for_p2pd(identity, extra):
        dht = _start_dht(DHT, initial_peers, network, client_mode, startup_timeout_s, extra)
    if identity is not None and dht.peer_id.to_base58() != identity.peer_id:
        shutdown_quietly(dht)
        raise NetworkError(
            f"the DHT runs as {dht.peer_id}, not as this process's identity {identity.peer_id}"
        )
    return dht


def peer_identity(network: PeerNetwork) -> PeerIdentity:
    """This peer's identity: the one in --identity-path (written there first, in hivemind's format, if
    the file does not exist yet), or a new one for this run."""
    prepare_environment()
    from swarmtrain.net.identity import IdentityError, PeerIdentity

    if not network.identity_path:
        return PeerIdentity.generate()
    path = _identity_file(network.identity_path)
    if not path.exists():
        identity = PeerIdentity.generate()
        identity.write(path)
        return identity
    try:
        return PeerIdentity.from_file(path)
    except IdentityError as exc:
        raise NetworkError(f"--identity-path: {exc}") from None


def _identity_file(name: str) -> Path:
    path = Path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NetworkError(f"cannot create the folder of --identity-path {path}: {exc.strerror}") from None
    if path.is_dir():
        raise NetworkError(f"--identity-path {path} is a directory; give a file name")
    return path


@contextlib.contextmanager
def _identity_for_p2pd(identity: PeerIdentity | None, extra: dict):
    """Without --identity-path, p2pd reads `identity` from a file only this user can read, removed once
    the daemon has started."""
    if identity is None or "identity_path" in extra:
        yield
        return
    folder = tempfile.mkdtemp(prefix="swarmtrain-identity-")
    try:
        path = os.path.join(folder, "identity.key")
        identity.write(path)
        extra.update(identity_path=path, check_if_identity_free=False)  # new: nobody else has it
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start_dht(
    DHT, initial_peers, network: PeerNetwork, client_mode: bool, startup_timeout_s: float, extra: dict
):
    host, port = network.host, network.port
    host_maddr = f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"
    sockets_before = set(glob.glob("/tmp/hivemind-*.sock"))
    try:
        dht = DHT(
            initial_peers=list(initial_peers) if initial_peers else None,
            start=True,
            client_mode=client_mode or network.client_mode,
            host_maddrs=[host_maddr],
            startup_timeout=startup_timeout_s,
            await_ready=False,
            **extra,
        )
        dht.wait_until_ready(timeout=startup_timeout_s + 10)
    except Exception as exc:  # hivemind raises bare Exceptions/P2PDaemonError/TimeoutError here
        _remove_dead_sockets(set(glob.glob("/tmp/hivemind-*.sock")) - sockets_before)
        raise NetworkError(
            f"could not start or join the DHT (initial peers: {initial_peers or 'none'}): {exc}. "
            "Check that the address printed by `swarmtrain dht` is right and reachable."
        ) from None
    restore_sigint()
    if not (client_mode or network.client_mode):
        try:
            _require_reachable(dht, initial_peers or [], network)
        except NetworkError:
            shutdown_quietly(dht)
            _remove_dead_sockets(set(glob.glob("/tmp/hivemind-*.sock")) - sockets_before)
            raise
    return dht


def _require_reachable(dht, initial_peers: list[str], network: PeerNetwork) -> None:
    """Answer other peers' dial-back checks, and unless relays reach this peer (--auto-relay), check
    that its initial peers can connect to it: if not, stop now with what to do (net/reachability.py)."""
    from swarmtrain.net import reachability

    dht.run_coroutine(reachability.serve_dial_backs)
    if network.use_auto_relay:
        reachability.wait_for_relay(lambda: [str(a) for a in dht.get_visible_maddrs(latest=True)])
        return
    reason = reachability.check_reachable(dht, initial_peers, visible_addresses(dht))
    if reason is not None:
        raise NetworkError(reason)


def _dht_options(network: PeerNetwork) -> dict:
    from hivemind.utils.multiaddr import Multiaddr

    options: dict = {"use_relay": network.use_relay, "use_auto_relay": network.use_auto_relay}
    if network.use_auto_relay:
        # libp2p looks for relays only once AutoNAT calls this peer private, and AutoNAT never does when
        # the peers around it have private-range addresses (its servers refuse to dial those back: a
        # LAN, a cloud VPC, the NAT test bed) and takes minutes elsewhere. --auto-relay says "behind a
        # NAT": take it at its word, so relays are reserved at start-up (tests/integration/test_nat.py)
        options["force_reachability"] = "private"
    if network.announce_addrs:
        try:
            options["announce_maddrs"] = [Multiaddr(a) for a in network.announce_addrs]
        except ValueError as exc:
            raise NetworkError(
                f"bad --announce-addr: {exc} (expected e.g. /ip4/203.0.113.7/tcp/31337)"
            ) from None
    if network.run_key is not None:
        options["record_validators"] = [record_validator(network.run_key)]
    else:
        options["record_validators"] = [keyless_record_filter()]
    return options


def _remove_dead_sockets(paths: set[str]) -> None:
    """A p2pd that fails to bootstrap exits without removing its socket file; remove the new ones that
    nobody listens on any more."""
    for path in paths:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                os.remove(path)
        except OSError:
            pass
        finally:
            probe.close()


def visible_addresses(dht) -> list[str]:
    """Multiaddrs other peers can use as --initial-peers (each ends with /p2p/<peer id>)."""
    return [str(addr) for addr in dht.get_visible_maddrs()]


def validate_initial_peers(peers: list[str]) -> list[str]:
    """Reject obviously malformed multiaddrs with a clear message before hivemind sees them."""
    cleaned = []
    for peer in peers:
        for part in peer.replace(",", " ").split():
            if not part.startswith("/") or "/p2p/" not in part:
                raise NetworkError(
                    f"bad --initial-peers entry {part!r}: expected a multiaddr like "
                    "/ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID (as printed by `swarmtrain dht`)"
                )
            cleaned.append(part)
    return cleaned


def shutdown_quietly(*components) -> None:
    """Shut down DHTs/averagers, ignoring errors (used on exit paths)."""
    for component in components:
        if component is None:
            continue
        is_alive = getattr(component, "is_alive", None)
        if is_alive is not None and not is_alive():
            continue  # already gone (a stop signal to the process group reached it first)
        try:
            component.shutdown()
        except Exception as exc:  # exit path: report, never raise
            print(f"warning: shutdown of {type(component).__name__} failed: {exc}", file=sys.stderr)


async def release_p2p_replica(dht, p2p) -> None:
    """Close this process's P2P replica of the DHT's daemon, so the next `dht.replicate_p2p()` makes a
    new one. A server that moves to another stage must do this before its next stage's averager forks:
    hivemind's averager process calls `replicate_p2p()` too, sees another pid and drops the replica it
    inherited, whose finalizer deletes the unix socket the daemon delivers our incoming streams to. The
    moved server could then call out but not be called (its stage peers' gradients: "connection reset",
    every step; bench/rebalance_live.py). hivemind keeps the replica in `DHT._p2p_replica`, and 1.1.12
    offers no public way to drop it (`replicate_p2p()` is its only accessor), hence the private write."""
    dht._p2p_replica = None
    await p2p.shutdown()
