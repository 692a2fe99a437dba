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
