"""`swarmtrain train-local`: the single-process reference run."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import (
    add_command,
    add_device_args,
    add_run_config_args,
    compute_device_from_args,
    positive_int,
    run_config_from_args,
    write_summary_json,
)

HELP = "train on one process (the baseline every distributed mode is compared against)"


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "train-local",
        run,
        HELP,
        ". AdamW, warmup + cosine, gradient clipping, "
        "accumulation to the global batch, periodic validation, checkpoint and resume.",
    )
    add_run_config_args(parser, compression=False)
    parser.add_argument(
        "--max-samples", type=positive_int, metavar="N", help="train on N samples (overrides config)"
    )
    parser.add_argument(
        "--data", metavar="PATH", help="text file or folder to train on (default: Python's stdlib sources)"
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save here periodically; resume from here if present"
    )
    parser.add_argument(
        "--init-from",
        metavar="FILE",
        help="start from these weights (a whole-model .safetensors, e.g. from `swarmtrain export`); "
        "fresh optimizer and schedule",
    )
    parser.add_argument(
        "--threads", type=positive_int, metavar="N", help="torch CPU threads (default: torch's choice)"
    )
    add_device_args(parser)
    parser.add_argument(
        "--summary-json",
        metavar="PATH",
        help='write {"initial_val_loss", "final_val_loss", "samples", "samples_per_s"} here',
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    if args.init_from and args.init_from_hf:
        from swarmtrain.config.errors import UserError

        raise UserError("start from one set of weights: --init-from or --init-from-hf, not both")
    cfg = run_config_from_args(args)
    if args.max_samples:
        training = dataclasses.replace(cfg.training, max_samples=args.max_samples)
        cfg = cfg.replace(training=training)
    if args.data:
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, source=args.data))
    if cfg.training.max_samples < cfg.training.global_batch_size:
        from swarmtrain.config import ConfigError

        raise ConfigError(
            f"max samples ({cfg.training.max_samples}) is less than one global batch ({cfg.training.global_batch_size})"
        )

    compute = compute_device_from_args(args)
    import torch

    from swarmtrain.data import unigram_entropy_nats
    from swarmtrain.runtime.local import LocalTrainer
    from swarmtrain.utils.logging import setup_logging

    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = LocalTrainer(
        cfg,
        checkpoint_dir=args.checkpoint_dir,
        progress=not args.no_progress,
        init_from=args.init_from,
        init_from_hf=args.init_from_hf,
        compute=compute,
    )
    result = trainer.train()
    summary = result.summary()
    # The loss of predicting bytes by their frequency alone: a model must beat it to have learned context.
    summary["unigram_val_loss"] = unigram_entropy_nats(trainer.val_set)
    print(
        f"preset {cfg.preset} on {compute.describe()}: val loss {result.initial_val_loss:.4f} -> {result.final_val_loss:.4f} "
        f"after {result.samples} samples ({result.samples_per_s:.1f} samples/s); "
        f"byte-frequency baseline {summary['unigram_val_loss']:.4f}"
    )
    write_summary_json(args.summary_json, summary)
    return 0
