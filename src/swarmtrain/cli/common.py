"""Arguments shared by several subcommands and the one way to turn them into a `RunConfig`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swarmtrain.config import RunConfig, get_preset, load_run_config, preset_names
from swarmtrain.config.errors import UserError


def add_run_config_args(parser: argparse.ArgumentParser, default_preset: str = "tiny") -> None:
    parser.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help=f"named model/training preset: {', '.join(preset_names())} (default: {default_preset})",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML run file: `preset = ...` plus [model], [training], [data], [swarm] overrides",
    )
    parser.set_defaults(default_preset=default_preset)


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.config:
        return load_run_config(args.config, preset=args.preset)
    return get_preset(args.preset or args.default_preset)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def write_summary_json(path: str | None, summary: dict) -> None:
    """Write a run summary; a directory that does not exist is created, an unwritable path is a user error."""
    if not path:
        return
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write summary to {target}: {exc.strerror}") from None
