"""`swarmtrain` entry point: dispatches to one module per subcommand and turns user errors into exit 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from swarmtrain.config.errors import UserError

# (subcommand, module). Each module defines `register(subparsers)`, which adds its parser and sets
# `func(args) -> int`. Modules import heavy dependencies (torch, hivemind) inside `func` only, so
# `swarmtrain --help` stays fast.
SUBCOMMANDS = (
    ("demo", "swarmtrain.cli.demo"),
    ("train-local", "swarmtrain.cli.train_local"),
    ("dht", "swarmtrain.cli.dht"),
    ("server", "swarmtrain.cli.server"),
    ("trainer", "swarmtrain.cli.trainer"),
    ("replica", "swarmtrain.cli.replica"),
    ("status", "swarmtrain.cli.status"),
    ("keygen", "swarmtrain.cli.keygen"),
    ("monitor", "swarmtrain.cli.monitor"),
    ("export", "swarmtrain.cli.export"),
    ("tokenizer", "swarmtrain.cli.tokenizer"),
    ("tokenize", "swarmtrain.cli.tokenize"),
    ("boundary-table", "swarmtrain.cli.boundary_table"),
    ("plan", "swarmtrain.cli.plan"),
    ("simulate", "swarmtrain.cli.simulate"),
)

DESCRIPTION = """\
Train large models on the compute you can get: preemptible GPUs, machines in different regions,
volunteers' consumer GPUs. SWARM parallelism (stage swarms, stochastic wiring, 8-bit activations),
heterogeneity-aware placement, and a simulator for fleets you do not have.

Start here:  swarmtrain demo            (a complete local swarm on this machine)
             swarmtrain train-local     (the single-process reference run)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(args, lambda: args.func(args))


def run_command(args: argparse.Namespace, call) -> int:
    """`call()`'s exit code, a user's error as one line and exit 2, Ctrl-C as exit 130."""
    try:
        return int(call() or 0)
    except UserError as exc:
        print(f"swarmtrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"swarmtrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line, as every log here (utils/logging.py); debug shows where
        if os.environ.get("SWARMTRAIN_LOGLEVEL", "").upper() == "DEBUG":
            raise
        from swarmtrain.utils.logging import describe

        print(
            f"swarmtrain {args.command}: internal error: {describe(exc)} "
            "(a bug; SWARMTRAIN_LOGLEVEL=DEBUG shows its traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
