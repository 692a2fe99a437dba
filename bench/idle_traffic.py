"""What an idle swarm's control plane costs on slow links: bytes per second per peer with no training.

    python bench/idle_traffic.py [--preset tiny] [--replicas 1] [--rate-mbit-s 10] [--settle-s 45]
                                 [--duration-s 60] [--server-args "..."] [--summary-json PATH]
                                 [--keep-logs DIR]

Needs root and the WAN test bed (`runtime/harness/netbed.py`); otherwise it prints one line saying why
and exits 0 ("skipped"). A DHT node and `--replicas` servers per stage of the preset (`tiny`: two
stages), every one in its own network namespace behind `tc tbf` at `--rate-mbit-s` each way, server
defaults otherwise (rebalancing, metrics period, announce period as `swarmtrain server --stage N` runs
them). No trainer: what the swarm costs while nobody trains, the floor every slow link pays.

After the servers are ready and `--settle-s` more (joins, first announcements), the bed's interface
counters (`WanTestbed.link_bytes`: whole frames, headers included, on the bridge's end of each peer's
veth; traffic between a peer and its own p2pd stays on its loopback and is not counted) are read
before and after `--duration-s` of idleness. `--bare-dht` runs `swarmtrain dht` nodes in the servers'
places instead: what hivemind's DHT maintenance and libp2p cost with no records at all. Printed: one row per peer, bytes/s up and down and the
share of the link that is; the summary JSON has the same. Issue 55's bar: <= 10 kB/s each way per
server at default settings.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from swarmtrain.config import get_preset
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, SwarmStartError, write_run_toml

SERVER_READY_TIMEOUT_S = 180.0
TARGET_BYTES_PER_S = 10_000  # issue 55: an idle server's control traffic, each way


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--replicas", type=int, default=1, help="servers per stage")
    parser.add_argument("--rate-mbit-s", type=float, default=10.0, help="every peer's link, each way")
    parser.add_argument("--settle-s", type=float, default=45.0, help="after ready, before counting")
    parser.add_argument("--duration-s", type=float, default=60.0, help="the counted idle window")
    parser.add_argument("--server-args", default="", help="extra `swarmtrain server` arguments")
    parser.add_argument(
        "--bare-dht",
        action="store_true",
        help="`swarmtrain dht` nodes in the servers' places: the floor (hivemind's and libp2p's own traffic)",
    )
    parser.add_argument("--summary-json", default=None)
    parser.add_argument("--keep-logs", default=None, help="keep the peers' logs in this directory")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, dict[str, float]]:
    """peer -> {up_bytes_per_s, down_bytes_per_s} over the idle window."""
    num_stages = get_preset(args.preset).swarm.num_stages
    servers = [(f"stage{s}r{r}", s) for s in range(num_stages) for r in range(args.replicas)]
    roles = ["dht", *(name for name, _ in servers)]
    index = {name: i for i, name in enumerate(roles)}
    run_file = write_run_toml(workdir / "run.toml", args.preset)
    with ExitStack() as stack:
        rate = args.rate_mbit_s or None
        bed = stack.enter_context(netbed.WanTestbed(len(roles), up_mbit_s=rate, down_mbit_s=rate))
        swarm = stack.enter_context(LocalSwarm(workdir, run_file, netbed=bed, netbed_peers=index))
        swarm.start_dht()
        for name, stage in servers:
            if args.bare_dht:
                swarm.start_dht_peer(name)
            else:
                swarm.start_server(name, stage, "--threads", "1", *shlex.split(args.server_args))
        if not args.bare_dht:
            swarm.wait_ready([name for name, _ in servers], timeout_s=SERVER_READY_TIMEOUT_S)
        time.sleep(args.settle_s)
        before, began_s = [bed.link_bytes(i) for i in range(len(roles))], time.monotonic()
        time.sleep(args.duration_s)
        after, elapsed_s = [bed.link_bytes(i) for i in range(len(roles))], time.monotonic() - began_s
        dead = [name for name, proc in swarm.processes.items() if not proc.alive]
        if dead:
            raise SwarmStartError(f"{dead} exited during the idle window")
    return {
        role: {"up_bytes_per_s": (a[0] - b[0]) / elapsed_s, "down_bytes_per_s": (a[1] - b[1]) / elapsed_s}
        for role, b, a in zip(roles, before, after, strict=True)
    }


def table(rates: dict[str, dict[str, float]], rate_mbit_s: float) -> str:
    link_bytes_per_s = rate_mbit_s * 1e6 / 8 if rate_mbit_s else None
    lines = [f"{'peer':<10} {'up kB/s':>9} {'down kB/s':>10} {'link share':>11}"]
    for role, r in rates.items():
        up, down = r["up_bytes_per_s"], r["down_bytes_per_s"]
        share = f"{max(up, down) / link_bytes_per_s:.1%}" if link_bytes_per_s else "-"
        lines.append(f"{role:<10} {up / 1e3:>9.1f} {down / 1e3:>10.1f} {share:>11}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = netbed.available()
    if not ok:
        print(f"skipped: {why}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    with ExitStack() as stack:
        if args.keep_logs:
            workdir = Path(args.keep_logs)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="idle-traffic-")))
        try:
            rates = measure(args, workdir)
        except (SwarmStartError, netbed.NetbedError) as exc:
            print(f"failed: {exc}")
            return 1
    what = "bare DHT nodes" if args.bare_dht else "server(s)"
    print(
        f"idle swarm ({args.preset}, {args.replicas} {what} per stage, {args.rate_mbit_s:g} Mbit/s "
        f"links, {args.duration_s:g} s counted after {args.settle_s:g} s)"
    )
    print(table(rates, args.rate_mbit_s))
    servers = {role: r for role, r in rates.items() if role != "dht"}
    worst = max(max(r.values()) for r in servers.values())
    verdict = "within" if worst <= TARGET_BYTES_PER_S else "over"
    print(f"worst server direction: {worst / 1e3:.1f} kB/s ({verdict} {TARGET_BYTES_PER_S / 1e3:g} kB/s)")
    if args.summary_json:
        summary = {"args": vars(args), "bytes_per_s": rates, "worst_server_bytes_per_s": worst}
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
