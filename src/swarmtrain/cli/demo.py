"""`swarmtrain demo`: a complete local swarm (DHT, stage servers, a trainer) as separate processes."""

from __future__ import annotations

import argparse
import os

from swarmtrain.cli.common import (
    add_boundary_args,
    add_command,
    add_compression_arg,
    add_device_args,
    compute_device_from_args,
    positive_float,
    positive_int,
    with_boundary,
    with_compression,
    with_hf_model,
    write_summary_json,
)
from swarmtrain.config import preset_names

HELP = "run a complete swarm on this machine: DHT, stage servers (2 replicas of stage 0), a trainer"


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "demo",
        run,
        HELP,
        ". Shows loss, samples/s and peers per stage live, SIGKILLs one stage-0 replica "
        "halfway to show training routing around it, then stops every process and prints a summary.",
    )
    parser.add_argument(
        "--preset", default="tiny", choices=preset_names(), help="model/training preset (default: tiny)"
    )
    parser.add_argument("--config", metavar="FILE", help="TOML run file instead of --preset")
    parser.add_argument("--duration-s", type=positive_float, default=60.0, help="training time (default: 60)")
    parser.add_argument("--no-kill", action="store_true", help="do not kill a replica mid-run")
    parser.add_argument("--replicas", type=positive_int, default=2, help="replicas of stage 0 (default: 2)")
    parser.add_argument(
        "--in-flight", type=positive_int, help="micro-batches in flight (default: the trainer's, 4 per stage)"
    )
    parser.add_argument(
        "--workdir", metavar="DIR", help="where logs and ledgers go (default: a new temp dir)"
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the one-process reference: after the swarm stops, the demo trains one process on the "
        "samples the swarm trained (same initial weights, data order and schedule; ~10-30 s on tiny) and "
        "prints its validation loss next to the swarm's",
    )
    parser.add_argument(
        "--monitor-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the live web page (`swarmtrain monitor`, its URL is printed; default: any free port)",
    )
    parser.add_argument("--no-monitor", action="store_true", help="do not start the live web page")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="the servers write stage checkpoints into DIR (every 50 steps and when they stop); "
        "`swarmtrain export --checkpoint-dir DIR --hf-out OUT` then writes a Hugging Face model",
    )
    parser.add_argument(
        "--init-from-hf",
        metavar="DIR",
        help="a local Hugging Face model directory (Llama or GPT-2): the run's model is DIR's config.json "
        "and the servers (and the one-process reference) start from its weights",
    )
    add_boundary_args(parser)  # these two written into the demo's run file, which every peer reads
    add_compression_arg(parser)
    add_device_args(parser, what="the stage servers and the one-process reference")
    parser.add_argument(
        "--summary-json",
        metavar="PATH",
        help='write {"initial_loss", "final_loss", "samples", "microbatches_started", "microbatches_completed", '
        '"microbatches_failed", "samples_lost_with_dead_peers", "peers_killed", "val_loss" (through the swarm), '
        '"byte_frequency_val_loss", "local_val_loss" (one process, same samples), "val_loss_gap" '
        "(val_loss / local_val_loss - 1)} here; losses are null when not measured",
    )


def run(args: argparse.Namespace) -> int:
    from swarmtrain.config.errors import UserError
    from swarmtrain.runtime.harness.demo import DemoOptions, run_demo

    if args.replicas < 2 and not args.no_kill:
        raise UserError("killing a replica needs --replicas >= 2 (or pass --no-kill)")
    if args.dtype == "fp16":  # the servers would refuse it (one loss scale for a whole pipeline: none)
        raise UserError(
            "--dtype fp16 is for whole-model commands (train-local, replica); the demo's stage servers "
            "compute in fp32 or bf16"
        )
    cfg = _swarm_config(args)
    cfg.require_swarm_model()  # one line before any process starts
    compute = compute_device_from_args(args)  # likewise: --device cuda where torch sees none
    options = DemoOptions(
        preset=args.preset,
        duration_s=args.duration_s,
        kill=not args.no_kill,
        replicas=args.replicas,
        in_flight=args.in_flight,
        workdir=args.workdir,
        config_path=args.config,
        reference=not args.no_reference,
        monitor_port=None if args.no_monitor else args.monitor_port,
        checkpoint_dir=args.checkpoint_dir,
        init_from_hf=args.init_from_hf,
        overrides=_overrides(args, cfg),
        device=str(compute.device),  # resolved once: every server and the reference on the same device
        dtype=compute.dtype,
    )
    summary = run_demo(options)
    write_summary_json(args.summary_json, summary)
    return 0 if summary["microbatches_completed"] else 1


def _swarm_config(args: argparse.Namespace):
    """The run config the demo's peers will use (its swarm timings aside, which change no model)."""
    from swarmtrain.config import get_preset, load_run_config

    cfg = load_run_config(args.config) if args.config else get_preset(args.preset)
    cfg = with_compression(
        with_boundary(cfg, args.boundary, args.boundary_dim, args.boundary_table), args.compression
    )
    return with_hf_model(cfg, args.init_from_hf) if args.init_from_hf else cfg


def _overrides(args: argparse.Namespace, cfg) -> dict[str, dict]:
    """What the demo's run file sets from the command line: the boundary (its table as an absolute
    path, since the peers run elsewhere) and the codec."""
    model = {}
    if args.boundary or args.boundary_dim or args.boundary_table:
        table = cfg.model.boundary_table
        model = {
            "boundary": cfg.model.boundary,
            "boundary_dim": cfg.model.boundary_dim,
            "boundary_table": os.path.abspath(table) if table else "",
        }
    swarm = {"compression": args.compression} if args.compression else {}
    return {"model": model, "swarm": swarm}
