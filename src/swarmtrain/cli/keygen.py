"""`swarmtrain keygen FILE`: a new run key for a private run."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import add_command

HELP = "write a new run key: every peer of a private run takes it with --run-key FILE"


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "keygen",
        run,
        HELP,
        ". Peers without it cannot serve, train, average or download state in the run, "
        "and their DHT records are ignored. Copy the file to the run's peers over a channel you trust; "
        "anyone holding it is a full member.",
    )
    parser.add_argument("path", metavar="FILE", help="where to write the key (created with mode 600)")
    parser.add_argument("--force", action="store_true", help="replace an existing key file")


def run(args: argparse.Namespace) -> int:
    from swarmtrain.net.auth import generate_key_file

    path = generate_key_file(args.path, overwrite=args.force)
    print(f"run key written to {path}; start every peer of the run with --run-key {path}")
    return 0
