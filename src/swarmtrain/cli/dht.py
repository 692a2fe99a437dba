"""`swarmtrain dht`: a bootstrap DHT node; prints the addresses other peers pass as --initial-peers."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import add_command
from swarmtrain.cli.net_args import add_identity_arg, add_network_args, network_from_args, prepare_process
from swarmtrain.utils.files import write_text_atomically

HELP = "start a bootstrap DHT node and print its address for --initial-peers"


def register(subparsers) -> None:
    parser = add_command(subparsers, "dht", run, HELP, ". Runs until Ctrl-C or SIGTERM.")
    add_network_args(parser, needs_peers=False)
    add_identity_arg(parser)
    parser.add_argument("--address-file", metavar="PATH", help="also write the addresses here, one per line")


def run(args: argparse.Namespace) -> int:
    prepare_process()
    import signal
    import threading

    from swarmtrain.net.engine import shutdown_quietly, start_dht, validate_initial_peers, visible_addresses
    from swarmtrain.runtime.procs import forked_children_die_with_me, reap_own_group, remember_group_sockets

    forked_children_die_with_me()
    peers = validate_initial_peers(args.initial_peers)
    dht = start_dht(peers, network_from_args(args))
    remember_group_sockets()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        addresses = visible_addresses(dht)
        print("DHT node running. Start servers and trainers with:", flush=True)
        print(f"  --initial-peers {' '.join(addresses)}", flush=True)
        if args.address_file:
            write_text_atomically(args.address_file, "\n".join(addresses) + "\n")
        while not stop.wait(1.0):
            pass
    finally:
        shutdown_quietly(dht)
        reap_own_group()
    return 0
