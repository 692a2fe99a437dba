"""`swarmtrain trainer`: stream data through the swarm's stages and report the loss."""

from __future__ import annotations

import argparse
import sys

from swarmtrain.cli.common import (
    add_command,
    add_run_config_args,
    add_shard_arg,
    positive_int,
    require_swarm_model,
    run_config_from_args,
    shard_from_args,
    write_summary_json,
)
from swarmtrain.cli.net_args import add_identity_arg, add_network_args, network_from_args, prepare_process

TRAINER_THREADS = 2

HELP = "drive micro-batches through the swarm (stochastic wiring, retries, compression)"


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "trainer",
        run,
        HELP,
        ". Runs until --max-samples, --duration-s or Ctrl-C (in-flight micro-batches finish first).",
    )
    add_run_config_args(parser)
    add_network_args(parser)
    add_identity_arg(parser)
    parser.add_argument(
        "--max-samples",
        type=positive_int,
        help="stop after starting this many samples of this trainer's own (with --shard K/N each trainer "
        "contributes 1/N of every step, so a run of S samples is S/N per trainer); default, without "
        "--duration-s: until the run reaches training.max_samples, wherever this trainer joined it",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        help="stop starting micro-batches after this many seconds, at a step boundary; with --shard K/N, "
        "every shard stops at the same step once the first one's time is up (the run's last step is "
        "then a whole global batch)",
    )
    parser.add_argument(
        "--in-flight",
        type=positive_int,
        help="micro-batches in flight (default: 4 per stage of the run: enough to keep a GPU stage busy "
        "while the others' messages are on the way)",
    )
    parser.add_argument(
        "--hand-off",
        choices=("direct", "relay"),
        default="direct",
        help="direct (default): each micro-batch goes to a stage-0 server with its route and the servers "
        "pass activations and gradients to each other, so this trainer's link carries token ids, labels "
        "and small reports; relay: every activation and gradient goes through this trainer",
    )
    parser.add_argument(
        "--data-plane",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --hand-off direct, send each micro-batch to its first server over that server's direct "
        "TCP data plane where it announces one (default; libp2p where it does not, or while a dial to it "
        "fails) or, with --no-data-plane, over libp2p only",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="at the end, compute the validation loss on this many samples through the swarm",
    )
    add_shard_arg(parser, "trainer")
    parser.add_argument("--trainer-id", help="prefix of this trainer's micro-batch ids (default: random)")
    parser.add_argument(
        "--plan", metavar="PLAN.json", help="the placement plan the servers were started with (its stage cut)"
    )
    parser.add_argument(
        "--ledger", metavar="PATH", help="append a JSON line per started/completed micro-batch"
    )
    parser.add_argument("--log-period-s", type=float, default=5.0, help="progress/metrics period")
    parser.add_argument("--summary-json", metavar="PATH", help="write the run summary here")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=TRAINER_THREADS,
        help=f"torch threads for the trainer's own tensor work: token ids, labels, relayed activations "
        f"(default {TRAINER_THREADS}: it computes no model, and torch's default, a thread per core, "
        "competes with the servers beside it)",
    )


def run(args: argparse.Namespace) -> int:
    shard_index, shard_count = shard_from_args(args)
    cfg = run_config_from_args(args)  # the trainer holds no weights: --init-from-hf only sets the model
    if args.plan:
        from swarmtrain.planner.plan_file import config_from_plan, load_plan

        cfg = config_from_plan(cfg, load_plan(args.plan))
    require_swarm_model(cfg, args)  # a config mistake is one line before any process starts
    prepare_process()
    import torch

    torch.set_num_threads(args.threads)
    from swarmtrain.net.engine import validate_initial_peers
    from swarmtrain.planner.in_flight import default_in_flight
    from swarmtrain.runtime.trainer.swarm_trainer import TrainerOptions, run_trainer

    options = TrainerOptions(
        codec=args.compression,
        max_in_flight=args.in_flight or default_in_flight(cfg.swarm.num_stages),
        max_samples=args.max_samples,
        duration_s=args.duration_s,
        eval_samples=args.eval_samples,
        ledger_path=args.ledger,
        shard_index=shard_index,
        shard_count=shard_count,
        log_period_s=args.log_period_s,
        network=network_from_args(args),
        hand_off=args.hand_off,
        data_plane=args.data_plane,
    )
    if args.trainer_id:
        options.trainer_id = args.trainer_id
    if options.max_samples is None and options.duration_s is None:
        # the run's horizon, not this trainer's: N shards each running max_samples would train N times
        # the schedule's samples
        t = cfg.training
        options.until_step = -(-t.max_samples // t.global_batch_size)
    summary = run_trainer(cfg, options, validate_initial_peers(args.initial_peers))
    print(
        f"trainer {options.trainer_id}: {summary['microbatches_completed']} micro-batches, "
        f"loss {summary['initial_loss']} -> {summary['final_loss']}, {summary['samples_per_s']:.1f} samples/s"
        + (f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "")
    )
    write_summary_json(args.summary_json, summary)
    if summary.get("validation_error"):  # trained, but the val loss asked for is not measured
        print(f"swarmtrain trainer: validation failed: {summary['validation_error']}", file=sys.stderr)
        return 1
    return 0
