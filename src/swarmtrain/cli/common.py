"""Arguments shared by several subcommands and the one way to turn them into a `RunConfig`.

`--init-from-hf DIR` is one of them: every command that computes the run's config digest (server, trainer,
replica, train-local, status, monitor, export) derives the model from DIR's config.json the same way
here, so peers started from the same DIR agree on the digest and a peer started without it is refused
by the digest checks. Commands that hold weights also fill them from DIR (`args.init_from_hf`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarmtrain.config import RunConfig, get_preset, load_run_config, preset_names
from swarmtrain.config.errors import ConfigError, UserError
from swarmtrain.config.hf_config import model_config_from_hf, read_hf_config
from swarmtrain.config.model import BOUNDARY_CHOICES, SUBSPACE
from swarmtrain.config.run import COMPRESSION_CHOICES


def add_run_config_args(
    parser: argparse.ArgumentParser, default_preset: str = "tiny", compression: bool = True
) -> None:
    """`--preset`, `--config`, `--init-from-hf`, the boundary flags and (`compression`: commands whose
    peers send activations, or that find a run by its digest) `--compression`; `run_config_from_args`
    applies them."""
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
    parser.add_argument(
        "--init-from-hf",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory (config.json + model.safetensors or shards; Llama or "
        "GPT-2): its config.json replaces the run's [model], and peers that hold weights start from "
        "its weights (a server still takes a trained stage's state from its replicas or checkpoints "
        "first). Every peer of the run passes the same DIR",
    )
    add_boundary_args(parser)
    if compression:
        add_compression_arg(parser)
    parser.set_defaults(default_preset=default_preset)


def add_compression_arg(parser: argparse.ArgumentParser) -> None:
    """`--compression CODEC`: the run file's `swarm.compression`, read by `with_compression`."""
    parser.add_argument(
        "--compression",
        choices=COMPRESSION_CHOICES,
        default=None,
        help="codec of the activations and gradients between stages (replaces the run file's "
        "swarm.compression; default there: 8bit). One below 8 bits (4bit, 3bit, 2bit and their -rht forms) "
        "is part of the run digest: every peer passes the same",
    )


def with_compression(cfg: RunConfig, codec: str | None) -> RunConfig:
    """`cfg` with `--compression CODEC` applied (None: the run file's own)."""
    if codec is None:
        return cfg
    return cfg.replace(swarm=dataclasses.replace(cfg.swarm, compression=codec))


def add_boundary_args(parser: argparse.ArgumentParser) -> None:
    """`--boundary KIND --boundary-dim K`: the run file's `[model] boundary` and `boundary_dim`, read by
    `with_boundary`. Part of the run digest: every peer of a run passes the same."""
    parser.add_argument(
        "--boundary",
        choices=BOUNDARY_CHOICES,
        default=None,
        help="what crosses a stage boundary (replaces the run file's model.boundary): none, boundary "
        "layers (bottleneck, maxout, lowrank, lowrank-embed) or subspace (exact: k coordinates and the "
        "token ids; exports as a plain model). Needs --boundary-dim but for none; every peer passes the same",
    )
    parser.add_argument(
        "--boundary-dim",
        type=positive_int,
        default=None,
        metavar="K",
        help="values per token a boundary sends (replaces model.boundary_dim), below d_model",
    )
    parser.add_argument(
        "--boundary-table",
        default=None,
        metavar="FILE",
        help="with --boundary subspace: the fixed token table made by `swarmtrain boundary-table` from the "
        "training data (replaces model.boundary_table; default: drawn from the seed). Every peer passes a "
        "file of the same content",
    )


def with_boundary(cfg: RunConfig, kind: str | None, dim: int | None, table: str | None = None) -> RunConfig:
    """`cfg` with `--boundary KIND --boundary-dim K --boundary-table FILE` applied (None: the run file's
    own). A boundary other than subspace drops the run file's table."""
    if kind is None and dim is None and table is None:
        return cfg
    needs_subspace = "--boundary-table needs --boundary subspace (it is a subspace run's token table)"
    if kind is None:
        if cfg.model.boundary == "none":
            if dim is None:
                raise UserError(needs_subspace)
            raise UserError("--boundary-dim needs --boundary KIND (the run sets no model.boundary)")
        kind = cfg.model.boundary
    if table is not None and kind != SUBSPACE:
        raise UserError(needs_subspace)
    if kind == "none":
        if dim is not None:
            raise UserError("--boundary none takes no --boundary-dim")
        return cfg.replace(
            model=dataclasses.replace(cfg.model, boundary="none", boundary_dim=0, boundary_table="")
        )
    if dim is None and cfg.model.boundary != kind:
        raise UserError(f"--boundary {kind} needs --boundary-dim K (values per token, below d_model)")
    dim = dim if dim is not None else cfg.model.boundary_dim
    if table is None:
        table = cfg.model.boundary_table if kind == SUBSPACE else ""
    return cfg.replace(
        model=dataclasses.replace(cfg.model, boundary=kind, boundary_dim=dim, boundary_table=table)
    )


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.config:
        cfg = load_run_config(args.config, preset=args.preset)
    else:
        cfg = get_preset(args.preset or args.default_preset)
    cfg = with_boundary(
        cfg,
        getattr(args, "boundary", None),
        getattr(args, "boundary_dim", None),
        getattr(args, "boundary_table", None),
    )
    cfg = with_compression(cfg, getattr(args, "compression", None))
    model_dir = getattr(args, "init_from_hf", None)
    return with_hf_model(cfg, model_dir) if model_dir else cfg


def require_swarm_model(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The swarm commands' check of the model (`RunConfig.require_swarm_model`), saying where a tied
    model came from when it came from --init-from-hf (its [model] cannot be edited in the run file)."""
    model_dir = getattr(args, "init_from_hf", None)
    if model_dir and cfg.model.tie_embeddings and cfg.swarm.num_stages > 1:
        raise ConfigError(
            f"--init-from-hf {model_dir}: this model ties its LM head to its token embedding "
            f"(tie_word_embeddings = true), which a swarm of {cfg.swarm.num_stages} stages cannot train "
            f"(they sit on different stages); train it with train-local or replica, which hold the whole model"
        )
    cfg.require_swarm_model()


def with_hf_model(cfg: RunConfig, model_dir: str) -> RunConfig:
    """`cfg` with the model a Hugging Face directory's config.json describes; fields it does not carry
    (the padding label, the sequence length when the model allows longer) come from `cfg.model`."""
    raw = read_hf_config(model_dir)
    return cfg.replace(model=model_config_from_hf(raw, cfg.model, source=f"{model_dir}/config.json"))


def checked_number(convert: Callable[[str], Any], ok: Callable[[Any], bool], expected: str, name: str):
    """An argparse `type` that converts with `convert` and accepts what `ok` allows; its error says
    `expected ...` (the text when it does not convert, the value when `ok` refuses it)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    parse.__name__ = parse.__qualname__ = name  # what argparse names the type by
    return parse


# `not value > 0` / `not value >= 0`: a float NaN fails both, so it is refused too
positive_int = checked_number(int, lambda value: value > 0, "a positive integer", "positive_int")
non_negative_int = checked_number(int, lambda value: value >= 0, "an integer >= 0", "non_negative_int")
positive_float = checked_number(float, lambda value: value > 0, "a positive number", "positive_float")
non_negative_float = checked_number(float, lambda value: value >= 0, "a number >= 0", "non_negative_float")
# a deadline's parts: inf would make it none (the download unbounded again), which no flag may ask for
_mbit = checked_number(float, lambda value: 0 < value < math.inf, "a rate in Mbit/s > 0", "mbit")
_seconds = checked_number(float, lambda value: 0 <= value < math.inf, "seconds >= 0", "seconds")


def add_command(
    subparsers, name: str, run: Callable, summary: str, more: str = "", description: str = "", **kw
):
    """The subparser of command `name`, carried out by `run(args)`: `summary` is its line in `swarmtrain
    --help` and opens its own --help, followed by `more`; a `description` (preformatted text, kept as
    written) replaces both in its own --help. `kw` goes to argparse as it is."""
    if description:
        kw.update(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        kw.update(description=summary + more)
    parser = subparsers.add_parser(name, help=summary, **kw)
    parser.set_defaults(func=run)
    return parser


def add_shard_arg(parser: argparse.ArgumentParser, who: str) -> None:
    """`--shard K/N`, read by `shard_from_args` (kept a string here: a malformed one is the user error
    `shard_from_args` words, not argparse's)."""
    parser.add_argument(
        "--shard", default="0/1", metavar="K/N", help=f"data shard of this {who} (default 0/1)"
    )


def shard_from_args(args: argparse.Namespace) -> tuple[int, int]:
    """`--shard K/N` as (K, N); a malformed value is a user error."""
    try:
        shard_index, shard_count = (int(x) for x in args.shard.split("/"))
    except ValueError:
        raise UserError(f"--shard must look like K/N, got {args.shard!r}") from None
    return shard_index, shard_count


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


def add_device_args(parser: argparse.ArgumentParser, what: str = "the model") -> None:
    """`--device` and `--dtype`, the same on every command that computes (model/device.py)."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help=f"where {what} computes: auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N; "
        "asking for CUDA where there is none is an error (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="compute precision: parameters and optimizer state stay fp32 and the compute runs under "
        "autocast in this dtype (fp16 adds a loss scaler; bf16 also runs on CPU) (default: fp32)",
    )


def compute_device_from_args(args: argparse.Namespace):
    """The `ComputeDevice` of `--device`/`--dtype` (a one-line error for a device this machine lacks)."""
    from swarmtrain.model.device import ComputeDevice

    return ComputeDevice.from_names(args.device, args.dtype)


def add_state_download_args(parser: argparse.ArgumentParser, what: str, then: str) -> None:
    """`--state-download-min-mbit` and `--state-download-base-s`: how long this peer waits for each donor
    of `what` (planner/download_deadline.py) before it does `then`. This peer's own settings, not the run's: peers on other
    links set other ones, and the config digest does not include them."""
    parser.add_argument(
        "--state-download-min-mbit",
        type=_mbit,
        metavar="M",
        help=f"when this peer downloads {what} from a live peer (joining, or resyncing), each donor must "
        "deliver it at M Mbit/s on average or is cut at its deadline (--state-download-base-s + the state's "
        f"size at M), and the next one (at most 3) is tried; then it {then}. Set it below this machine's download rate: at the default 100 a joiner on a 10 Mbit/s "
        "home link never gets a large state (llama-8b's first stage, 11.5 GB, needs 2.6 h at 10 Mbit/s "
        "and would get 953 s). This peer's own setting, not part of the run's config (default: 100)",
    )
    parser.add_argument(
        "--state-download-base-s",
        type=_seconds,
        metavar="S",
        help="the part of each donor's deadline that does not grow with the state: the donor's snapshot "
        "of its state and the stream's opening (over 2 s on a busy CPU-limited donor). Lower it to give "
        "up on unresponsive donors sooner (default: 30)",
    )


def download_rule_from_args(args: argparse.Namespace):
    """The `DownloadRule` of `add_state_download_args`' flags (unset: the default's parts)."""
    from swarmtrain.planner.download_deadline import DownloadRule

    return DownloadRule.of(args.state_download_min_mbit, args.state_download_base_s)
