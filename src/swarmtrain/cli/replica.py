"""`swarmtrain replica`: train the whole model on this peer and synchronize rarely with the others (DiLoCo)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from swarmtrain.cli.common import (
    add_command,
    add_device_args,
    add_run_config_args,
    add_shard_arg,
    add_state_download_args,
    compute_device_from_args,
    download_rule_from_args,
    positive_int,
    run_config_from_args,
    shard_from_args,
    write_summary_json,
)
from swarmtrain.cli.net_args import (
    add_client_mode_arg,
    add_identity_arg,
    add_network_args,
    network_from_args,
    prepare_process,
)

HELP = "an asynchronous full replica: local steps, a rare averaged outer step (DiLoCo) with the others"

DESCRIPTION = """\
Train the whole model on this peer's data shard and, every diloco.inner_steps local steps, average
the change since the last round (the pseudo-gradient) with every replica that reaches the same round
(hivemind all-reduce, weighted by samples, compressed with diloco.compression), then take one outer
step (SGD with Nesterov momentum: diloco.outer_learning_rate, diloco.outer_momentum). For slow
networks: a replica sends its model once per round instead of activations every micro-batch.

Replica K of N (--shard K/N) trains global_batch_size / N samples per local step, and local step s uses
the learning rate of global step s, so N replicas follow one process's schedule. A replica waits at most
diloco.matchmaking_time_s for the others at a round's end; a late joiner downloads the current state
from a live replica and trains from the others' position. SIGTERM: a last round with the others, the
summary, exit 0 (Ctrl-C also stops the libp2p daemon of the process group: that last round is alone).

Start the first one with --initial-peers of a `swarmtrain dht`; every replica of a run must use the
same config ([training], [model], [diloco] in --config).
"""

if TYPE_CHECKING:  # torch is imported inside `run` only: `swarmtrain --help` stays fast
    from swarmtrain.runtime.faults import FaultHooks


def register(subparsers) -> None:
    parser = add_command(subparsers, "replica", run, HELP, description=DESCRIPTION)
    add_run_config_args(parser)
    add_network_args(parser)
    add_identity_arg(parser)
    add_client_mode_arg(parser)
    add_shard_arg(parser, "replica")
    parser.add_argument(
        "--max-samples",
        type=positive_int,
        metavar="N",
        help="stop when the run has trained N samples, i.e. at local step N / global_batch_size "
        "(each of the N replicas trains N / shards of them; default: training.max_samples)",
    )
    parser.add_argument(
        "--wait-for-replicas",
        type=positive_int,
        default=1,
        metavar="N",
        help="start training once N replicas (this one included) are in the swarm, so replicas started "
        "together begin together (default 1: at once; a late one joins the others by download)",
    )
    parser.add_argument("--duration-s", type=float, help="stop after this many seconds (a last round first)")
    parser.add_argument(
        "--eval-samples", type=int, default=0, help="at the end, the validation loss on this many samples"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="torch CPU threads (default: torch's choice, one per core: a replica trains a whole model; "
        "pass 1 where several replicas or servers share a machine's cores)",
    )
    parser.add_argument(
        "--offload-budget-mb",
        type=float,
        metavar="MB",
        help="keep the model in host memory and stream its blocks through --device in groups that fit "
        "MB of device memory (ATOM's model swapping; default: the model is resident)",
    )
    add_device_args(parser, what="the model (or, with --offload-budget-mb, its streamed blocks)")
    add_state_download_args(
        parser, "the replicas' state (model, outer momentum and optimizer)", "trains on from what it holds"
    )
    parser.add_argument("--log-period-s", type=float, default=5.0, help="progress line period (default 5)")
    parser.add_argument("--summary-json", metavar="PATH", help="write the run summary here")


def run(args: argparse.Namespace, faults: FaultHooks | None = None) -> int:
    """`faults`: a faulty peer's hooks; only tests pass any (through `swarmtrain.cli.faulty`)."""
    from swarmtrain.config.errors import UserError

    shard_index, shard_count = shard_from_args(args)
    if not 0 <= shard_index < shard_count:
        raise UserError(f"--shard {args.shard}: K must be in 0..N-1")
    if args.duration_s is not None and args.duration_s <= 0:
        raise UserError("--duration-s must be positive")
    if args.log_period_s <= 0:
        raise UserError("--log-period-s must be positive")
    if args.offload_budget_mb is not None and args.offload_budget_mb <= 0:
        raise UserError("--offload-budget-mb must be positive")
    if args.offload_budget_mb is not None and args.dtype != "fp32":
        raise UserError("--offload-budget-mb: the layer swapper computes in fp32 (use --dtype fp32)")
    compute = compute_device_from_args(args)
    cfg = run_config_from_args(args)
    from swarmtrain.runtime.replica.replica_inner import replica_batch_samples

    replica_batch_samples(cfg, shard_count)  # a bad split is a config error before any process starts
    prepare_process()
    from swarmtrain.net.engine import validate_initial_peers
    from swarmtrain.runtime.faults import NO_FAULTS
    from swarmtrain.runtime.replica.replica_peer import ReplicaOptions, run_replica

    options = ReplicaOptions(
        shard_index=shard_index,
        shard_count=shard_count,
        max_samples=args.max_samples,
        wait_for_replicas=args.wait_for_replicas,
        duration_s=args.duration_s,
        eval_samples=args.eval_samples,
        log_period_s=args.log_period_s,
        threads=args.threads,
        swap_budget_bytes=args.offload_budget_mb * 2**20 if args.offload_budget_mb else None,
        compute=compute,
        init_from_hf=args.init_from_hf,
        download_rule=download_rule_from_args(args),
        faults=faults or NO_FAULTS,
    )
    peers = validate_initial_peers(args.initial_peers)
    summary = run_replica(cfg, options, peers, network_from_args(args))
    print(
        f"replica {summary['shard']}: {summary['inner_steps']} local steps ({summary['samples']} samples, "
        f"{summary['samples_per_s']:.1f} samples/s), outer step {summary['outer_steps']}, rounds averaged "
        f"{summary['rounds_averaged']} alone {summary['rounds_alone']} resynced {summary['rounds_resynced']}"
        + (
            f" (partial {summary['rounds_partial']}, repaired {summary['rounds_repaired']})"
            if summary["rounds_partial"]
            else ""
        )
        + (f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "")
    )
    write_summary_json(args.summary_json, summary)
    return 0
