"""Test-only entry point: a `server` or `replica` with a faulty peer's hooks (runtime/faults.py).

    python -m swarmtrain.cli.faulty --grad-scale 1e6 --nan-every 3 -- server --stage 0 ...

The test harness launches it (`LocalSwarm.start_server(..., faults=...)`, `start_replica`); it is not a
`swarmtrain` subcommand, and no production command reads fault settings from anywhere, so a real
server cannot be made byzantine by its environment.
"""

from __future__ import annotations

import argparse
import sys

from swarmtrain.cli.main import build_parser, run_command

FAULTY_COMMANDS = ("server", "replica")


def _fault_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m swarmtrain.cli.faulty",
        description="(tests) run `server` or `replica` as a faulty peer; the command follows `--`",
    )
    parser.add_argument("--grad-scale", type=float, default=1.0, help="scale of its gradient sums")
    parser.add_argument("--nan-every", type=int, default=0, help="every k-th step or round sent as NaN")
    parser.add_argument(
        "--drop-results-in", type=int, default=0, help="the all-reduce whose results it withholds"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from swarmtrain.runtime.faults import FaultHooks

    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    faults_args = _fault_parser().parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command or command[0] not in FAULTY_COMMANDS:
        _fault_parser().error(f"the command after -- must be one of {', '.join(FAULTY_COMMANDS)}")
    hooks = FaultHooks(faults_args.grad_scale, faults_args.nan_every, faults_args.drop_results_in)
    args = build_parser().parse_args(command)
    return run_command(args, lambda: args.func(args, faults=hooks))


if __name__ == "__main__":
    sys.exit(main())
