"""`swarmtrain server --stage N`: host one pipeline stage of a SWARM run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from swarmtrain.cli.common import (
    add_command,
    add_device_args,
    add_run_config_args,
    add_state_download_args,
    compute_device_from_args,
    download_rule_from_args,
    non_negative_float,
    positive_int,
    require_swarm_model,
    run_config_from_args,
)
from swarmtrain.cli.net_args import add_identity_arg, add_network_args, network_from_args, prepare_process
from swarmtrain.config.run import EXCHANGE_COMPRESSION_CHOICES

HELP = "serve one pipeline stage (forward/backward RPCs, intra-stage averaging)"

if TYPE_CHECKING:  # torch is imported inside `run` only: `swarmtrain --help` stays fast
    from swarmtrain.runtime.faults import FaultHooks


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "server",
        run,
        HELP,
        ". Announces itself in the DHT, downloads the stage state from its replicas if "
        "they have already trained, and serves until Ctrl-C or SIGTERM.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--stage",
        type=_stage_arg,
        help="stage index, 0 .. num_stages-1, or `auto`: the stage with the least capacity among the "
        "peers announced in the DHT (empty stages first)",
    )
    where.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="serve the stage a placement plan (`swarmtrain plan ... --json`) gives --device-index, with "
        "the plan's stage cut (trainers take the same --plan)",
    )
    parser.add_argument("--device-index", type=int, metavar="I", help="this machine's device index in --plan")
    add_run_config_args(parser)
    add_network_args(parser)
    add_identity_arg(parser)
    parser.add_argument(
        "--data-plane",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take hand-offs from the previous stage's servers over a direct TCP data plane (default) or, "
        'with --no-data-plane, over libp2p only (slower on slow links: README "Across the internet"). '
        "A server behind a NAT (--auto-relay) listens on none",
    )
    parser.add_argument(
        "--data-port",
        type=int,
        default=0,
        metavar="PORT",
        help="TCP port of the data plane (default: any free port; announced in the DHT). Open it like "
        "--port when a firewall is in the way",
    )
    parser.add_argument(
        "--data-plane-cc",
        default="cubic",
        metavar="NAME",
        help="TCP congestion control of the data plane's connections, where the system permits it "
        "(default: cubic, loss-based: with both directions of a link busy BBR stalled on the test bed; "
        "`system`: the system's default)",
    )
    parser.add_argument(
        "--request-memory-mb",
        type=positive_int,
        metavar="MB",
        help="memory lent to callers' requests: the micro-batches and bundles held at once, arriving or "
        "awaiting their answer, over the data plane and libp2p together (default: a quarter of the memory "
        "available when a stage starts serving). The frame, bundle and held-byte bounds are the smaller of "
        "this and what the run needs, never below one fp32 micro-batch; the server prints them when it "
        "starts serving",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the stage (parameters, optimizer, step) in DIR/stage<N>/ and resume from its newest "
        "checkpoint on start; replicas may share DIR (default: the run config's swarm.checkpoint_dir; "
        "none if empty)",
    )
    parser.add_argument(
        "--checkpoint-every-steps",
        type=int,
        metavar="N",
        help="save every N global steps, 0: never by steps (default: swarm.checkpoint_every_steps, 50)",
    )
    parser.add_argument(
        "--checkpoint-every-s",
        type=non_negative_float,
        metavar="S",
        help="also save at the first step after S seconds, 0: never by time (default: swarm.checkpoint_every_s, 0)",
    )
    add_state_download_args(
        parser, "the stage's state (parameters and optimizer)", "serves from the stage's newest checkpoint"
    )
    parser.add_argument(
        "--fresh-start",
        action="store_true",
        help="serve initial weights even though the swarm has already trained and this stage has no live "
        "replica or checkpoint (its training so far is lost); without it such a server refuses to start",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="torch CPU threads for the host's tensor work (default: 1 on CPU, where a swarm's servers share "
        "a machine's cores; on CUDA min(4, this process's cores), for what stays on the host: the stage "
        "exchange's gradient sums and their robust mean). The server prints it when it is ready",
    )
    parser.add_argument(
        "--cache-size",
        type=positive_int,
        default=64,
        help="micro-batches whose activations are kept for the backward (default: 64)",
    )
    parser.add_argument(
        "--cache-mb",
        type=positive_int,
        default=None,
        help="memory for those activations, estimated from the model shape and --dtype; the oldest are "
        "dropped first and recomputed if their backward comes (default: on CUDA the device memory free once "
        "the stage is built, less 10%% of the card and two micro-batches' room; on CPU 512). The server "
        "prints it when it is ready",
    )
    parser.add_argument(
        "--ledger", metavar="PATH", help="append a JSON line per accumulated/applied micro-batch"
    )
    parser.add_argument("--metrics-period-s", type=float, default=5.0, help="metrics publish/log period")
    parser.add_argument(
        "--rebalance-period-s",
        type=non_negative_float,
        metavar="S",
        help="every S seconds (jittered) check whether this server should move to the bottleneck stage "
        "(default: swarm.rebalance_period_s, 60; 0: never move). A server moves only after serving two periods, "
        "and only when the move raises the slowest stage's capacity by more than swarm.rebalance_margin "
        "(10%%), so a balanced swarm stays put",
    )
    parser.add_argument(
        "--exchange-compression",
        choices=EXCHANGE_COMPRESSION_CHOICES,
        help="codec of the gradient sums this server sends its stage peers each step (default: "
        "swarm.exchange_compression, none). 8bit sends ~3.9x fewer bytes: worth it when the stage's "
        "replicas are linked by less than a few hundred Mbit/s. What the rounding drops is added to the "
        "next step's sums, and the replicas still apply identical steps whatever each one sends",
    )
    parser.add_argument(
        "--matchmaking-time-s",
        type=float,
        default=1.0,
        help="how long a replica waits for its stage peers to join an averaging round",
    )
    add_device_args(parser, what="the stage")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        metavar="N",
        help="request batching: queued micro-batches of one kind and step (several trainers' forwards, "
        "backwards, evaluations) run as one call of up to N tokens, their results split back (default 0: "
        "off; it pays with several trainers and small micro-batches, e.g. 4 micro-batches' worth)",
    )


def run(args: argparse.Namespace, faults: FaultHooks | None = None) -> int:
    """`faults`: a faulty peer's hooks; only tests pass any (through `swarmtrain.cli.faulty`)."""
    from swarmtrain.config.errors import UserError

    prepare_process()
    from swarmtrain.model.device import server_threads
    from swarmtrain.net.engine import validate_initial_peers
    from swarmtrain.runtime.faults import NO_FAULTS
    from swarmtrain.runtime.server.server_process import ServerOptions, ServerProcess
    from swarmtrain.runtime.server.stage_service import StageOptions

    if args.dtype == "fp16":
        # a loss scale must be one for the whole pipeline (the last stage scales, every stage unscales
        # and all skip an overflowing step together); the swarm has no such agreement
        raise UserError("--dtype fp16 is for whole-model commands; a stage server computes in fp32 or bf16")
    if args.max_batch_tokens < 0:
        raise UserError("--max-batch-tokens must be >= 0 (0 turns batching off)")
    if not 0 <= args.data_port < 65536:
        raise UserError(f"--data-port {args.data_port} is not a TCP port (1-65535, or 0 for any free one)")
    if args.data_port and not args.data_plane:
        raise UserError("--data-port is the port of the data plane, which --no-data-plane turns off")
    compute = compute_device_from_args(args)
    cfg = _with_checkpoint_overrides(run_config_from_args(args), args)
    initial_peers = validate_initial_peers(args.initial_peers)
    network = network_from_args(args)
    stage, choice = args.stage, None
    if args.plan is not None:
        cfg, stage = _from_plan(cfg, args)
    elif args.device_index is not None:
        raise UserError("--device-index needs --plan")
    require_swarm_model(cfg, args)
    if stage == "auto":
        from swarmtrain.runtime.server.stage_choice import choose_stage_live

        choice = choose_stage_live(cfg, initial_peers, network)
        stage = choice.stage
    stage_options = StageOptions(
        cache_size=args.cache_size,
        cache_max_bytes=None if args.cache_mb is None else args.cache_mb << 20,
        min_matchmaking_time_s=args.matchmaking_time_s,
        checkpoint_dir=args.checkpoint_dir,
        fresh_start=args.fresh_start,
        init_from_hf=args.init_from_hf,
        compute=compute,
        max_batch_tokens=args.max_batch_tokens,
        download_rule=download_rule_from_args(args),
    )
    options = ServerOptions(
        stage=stage,
        initial_peers=initial_peers,
        network=network,
        threads=args.threads or server_threads(compute.device),
        ledger_path=args.ledger,
        stage_choice=choice,
        metrics_period_s=args.metrics_period_s,
        stage_options=stage_options,
        faults=faults or NO_FAULTS,
        data_port=args.data_port if args.data_plane else None,
        data_congestion=None if args.data_plane_cc == "system" else args.data_plane_cc,
        request_memory_bytes=None if args.request_memory_mb is None else args.request_memory_mb << 20,
    )
    # one process for its whole life: a move to another stage happens inside `run()`
    return ServerProcess(cfg, options).run()


def _with_checkpoint_overrides(cfg, args: argparse.Namespace):
    import dataclasses

    overrides = {
        "checkpoint_every_steps": args.checkpoint_every_steps,
        "checkpoint_every_s": args.checkpoint_every_s,
        "rebalance_period_s": args.rebalance_period_s,
        "exchange_compression": args.exchange_compression,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return cfg
    return dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, **overrides))


def _stage_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a stage index or `auto`, got {text!r}") from None


def _from_plan(cfg, args: argparse.Namespace):
    from swarmtrain.config.errors import UserError
    from swarmtrain.planner.plan_file import config_from_plan, load_plan, stage_of_device

    if args.device_index is None:
        raise UserError("--plan needs --device-index (this machine's index among the plan's devices)")
    plan = load_plan(args.plan)
    return config_from_plan(cfg, plan), stage_of_device(plan, args.device_index)
