"""Network arguments shared by `dht`, `server`, `trainer` and `demo`."""

from __future__ import annotations

import argparse


def add_network_args(parser: argparse.ArgumentParser, needs_peers: bool = True) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        metavar="MULTIADDR",
        required=needs_peers,
        help="addresses of running peers, as printed by `swarmtrain dht` (/ip4/HOST/tcp/PORT/p2p/PEER_ID)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all)",
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port)")
    parser.add_argument(
        "--run-key",
        metavar="FILE",
        help="the run key of a private run (made by `swarmtrain keygen FILE`, copied to every peer): "
        "records and requests of peers without it are ignored and refused (README: Private runs)",
    )
    reach = parser.add_argument_group(
        "reachability (peers behind NAT or firewalls; README: Across the internet)"
    )
    reach.add_argument(
        "--announce-addr",
        nargs="+",
        default=[],
        metavar="MULTIADDR",
        help="addresses other peers should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT when a router forwards PORT "
        "to this machine (default: the addresses this machine sees)",
    )
    reach.add_argument(
        "--auto-relay",
        action="store_true",
        help="behind a NAT without port forwarding: find relays among the peers and be reached through "
        "them (the peer announces itself once a relay holds a slot for it, within 60 s)",
    )
    reach.add_argument(
        "--no-relay", action="store_true", help="never use circuit relays (direct connections only)"
    )


def add_identity_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--identity-path",
        metavar="FILE",
        help="this peer's private key (created if missing): its peer id, and with --port its address, "
        "stay the same across restarts (default: a new identity every start)",
    )


def prepare_process(log_level: str | None = None) -> None:
    """First thing a networked subcommand does: hivemind environment, then logging."""
    from swarmtrain.net.engine import prepare_environment
    from swarmtrain.utils.logging import setup_logging

    prepare_environment()
    setup_logging(log_level)


def add_client_mode_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client-mode",
        action="store_true",
        help="accept no incoming connections (behind a NAT with no relay): this peer dials others, "
        "stores nothing in the DHT, and averages in hivemind's client mode",
    )


def start_client_dht(args: argparse.Namespace):
    """A client-mode DHT node for a command that only reads the swarm (`status`, `monitor`); its forked
    children die with this process."""
    from swarmtrain.net.engine import start_dht, validate_initial_peers
    from swarmtrain.runtime.procs import forked_children_die_with_me

    forked_children_die_with_me()
    return start_dht(validate_initial_peers(args.initial_peers), network_from_args(args), client_mode=True)


def network_from_args(args: argparse.Namespace):
    """The peer's network settings from its command line (the run key read and checked here)."""
    from swarmtrain.net.auth import RunKey
    from swarmtrain.net.engine import NetworkError, PeerNetwork

    if args.auto_relay and args.no_relay:
        raise NetworkError("--auto-relay and --no-relay contradict each other; pick one")
    return PeerNetwork(
        host=args.host,
        port=args.port,
        identity_path=getattr(args, "identity_path", None),
        run_key=RunKey.load(args.run_key) if args.run_key else None,
        announce_addrs=tuple(args.announce_addr),
        use_relay=not args.no_relay,
        use_auto_relay=args.auto_relay,
        client_mode=getattr(args, "client_mode", False),
    )
