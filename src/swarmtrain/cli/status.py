"""`swarmtrain status`: the swarm as its DHT sees it (stages, bottleneck, trainers, replicas)."""

from __future__ import annotations

import argparse
import json

from swarmtrain.cli.common import add_command, add_run_config_args, run_config_from_args
from swarmtrain.cli.net_args import add_network_args, prepare_process, start_client_dht

HELP = "show the swarm as the DHT sees it: each stage's peers, the bottleneck, trainers, replicas"


def register(subparsers) -> None:
    parser = add_command(
        subparsers,
        "status",
        run,
        HELP,
        ". Give the run's --preset/--config (run id, stages and the config digest "
        "peers announce). --json prints {stages: [{index, peers: [{peer_id, throughput_samples_per_s (the "
        "capacity it announces), limit (the resource that limits it), queue, epoch, state, same_config, "
        "addresses}], throughput_samples_per_s}], bottleneck, rebalance: {period_s, margin, plan: [{peer_id, "
        "from, to, expected_samples_per_s}]} (the moves every server's balancer plans on these records "
        "now), trainers, replicas, run_id, digest, time}.",
    )
    add_run_config_args(parser)
    add_network_args(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    prepare_process("ERROR")
    from swarmtrain.monitor.snapshot import format_snapshot, swarm_snapshot
    from swarmtrain.net.dht_records import RunRecords
    from swarmtrain.net.engine import shutdown_quietly
    from swarmtrain.runtime.procs import reap_own_group

    dht = start_client_dht(args)
    try:
        snapshot = swarm_snapshot(cfg, RunRecords(dht, cfg.swarm.run_id))
    finally:
        shutdown_quietly(dht)
        reap_own_group()
    print(json.dumps(snapshot, indent=2) if args.json else format_snapshot(snapshot))
    return 0
