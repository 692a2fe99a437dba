"""`swarmtrain monitor`: a web page showing the swarm live (or a simulator run replayed), with its data
as JSON (`/api/swarm`) and Prometheus metrics (`/metrics`)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from swarmtrain.cli.common import (
    add_command,
    add_run_config_args,
    positive_float,
    positive_int,
    run_config_from_args,
)
from swarmtrain.cli.net_args import add_network_args, prepare_process, start_client_dht
from swarmtrain.config.errors import UserError
from swarmtrain.utils.files import write_text_atomically

HELP = "serve a web page showing the swarm live: stages, bottleneck, loss, throughput, events"
DEFAULT_HTTP_PORT = 8080
DESCRIPTION = f"""\
{HELP}.

Polls the DHT every --interval-s and keeps a bounded history in memory (--history-points). The page
shows each stage's peers (throughput, queue, step), the bottleneck stage, every trainer's loss and
samples/s over time, lost and retried work, and recent events (joins, leaves, moves between stages,
state downloads, restores). Give the run's --preset/--config as to `swarmtrain status`.

endpoints:  /            the page (refreshes itself)
            /api/swarm   JSON: {{snapshot, points, events, event_counts, polls, error, source, simulated}}
            /metrics     Prometheus text format (swarmtrain_stage_*, swarmtrain_peer_*, swarmtrain_trainer_*, ...)

examples:
  swarmtrain monitor --initial-peers /ip4/HOST/tcp/31337/p2p/PEER --preset small --port 8080
  swarmtrain simulate --num-peers 200 --churn preemptible --duration-s 600 --timeline-json sim.json
  swarmtrain monitor --replay sim.json --port 8080
"""


def register(subparsers) -> None:
    # `resolve`: the shared network options' --port is the DHT's; here --port is the page's (args.http_port),
    # and the monitor's client DHT always takes a free port (args.port = 0)
    parser = add_command(
        subparsers, "monitor", run, HELP, description=DESCRIPTION, conflict_handler="resolve"
    )
    add_run_config_args(parser)
    add_network_args(parser, needs_peers=False)
    parser.add_argument(
        "--port",
        dest="http_port",
        type=_port,
        default=DEFAULT_HTTP_PORT,
        help=f"HTTP port of the page (default {DEFAULT_HTTP_PORT}; 0: any free port, printed at start)",
    )
    parser.set_defaults(port=0)  # the client DHT's port, for the shared network options: any free one
    parser.add_argument(
        "--interval-s", type=positive_float, default=2.0, help="seconds between snapshots (default 2)"
    )
    parser.add_argument(
        "--history-points",
        type=positive_int,
        default=1800,
        metavar="N",
        help="snapshots kept for the charts (default 1800: an hour at 2 s)",
    )
    parser.add_argument(
        "--url-file",
        metavar="PATH",
        help="also write the page's URL here once it serves (scripts wait for the file, not the output)",
    )
    parser.add_argument(
        "--replay",
        metavar="TIMELINE",
        help="show a simulator run instead of a live swarm: a file from `swarmtrain simulate --timeline-json`",
    )


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port number 0-65535, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.replay:
        if args.initial_peers:
            raise UserError("--replay shows a recorded simulator run; drop --initial-peers")
        return _replay(args)
    if not args.initial_peers:
        raise UserError("give --initial-peers (a running swarm) or --replay TIMELINE (a simulator run)")
    return _live(args)


def _replay(args: argparse.Namespace) -> int:
    from swarmtrain.monitor.page import PageMeta
    from swarmtrain.monitor.replay import load_timeline, replay_history
    from swarmtrain.monitor.web import build_app, server_url, start_http_server

    timeline = load_timeline(args.replay)
    history = replay_history(timeline)
    source = (
        f"replay of {Path(args.replay).name}: {timeline.get('description') or timeline.get('mode', 'simulation')}, "
        f"{len(timeline['frames'])} frames"
    )
    server = start_http_server(
        build_app(history, PageMeta(source, None, simulated=True)), args.host, args.http_port
    )
    _serve(server, server_url(server, args.host), args.url_file)
    return 0


def _live(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    prepare_process("WARNING")
    from swarmtrain.monitor.history import SwarmHistory
    from swarmtrain.monitor.page import PageMeta
    from swarmtrain.monitor.poller import Poller
    from swarmtrain.monitor.snapshot import monitor_snapshot
    from swarmtrain.monitor.web import build_app, server_url, start_http_server
    from swarmtrain.net.dht_records import RunRecords
    from swarmtrain.net.engine import shutdown_quietly
    from swarmtrain.runtime.procs import reap_own_group

    history = SwarmHistory(max_points=args.history_points)
    meta = PageMeta(f"DHT via {' '.join(args.initial_peers)}", args.interval_s)
    server = start_http_server(
        build_app(history, meta), args.host, args.http_port
    )  # a taken port: fail first
    dht = poller = None
    try:
        dht = start_client_dht(args)
        records = RunRecords(dht, cfg.swarm.run_id)
        poller = Poller(lambda: monitor_snapshot(cfg, records), history, args.interval_s)
        poller.start()
        _serve(server, server_url(server, args.host), args.url_file)
    finally:
        if poller is not None:
            poller.stop()
        server.server_close()
        shutdown_quietly(dht)
        reap_own_group()
    return 0


def _serve(server, url: str, url_file: str | None) -> None:
    """Serve until Ctrl-C or SIGTERM; `url_file` (scripts and tests wait for it) gets the URL first."""

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    if url_file:
        write_text_atomically(url_file, url + "\n")
    print(f"monitor: {url}  (JSON: {url}api/swarm, Prometheus: {url}metrics; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        print("monitor: stopped", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
