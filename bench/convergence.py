"""Does the swarm learn as well as one process at equal samples? Validation loss of real local swarms
vs. `swarmtrain train-local`, over a matrix of replicas per stage x codec x micro-batches in flight.

    python bench/convergence.py [--rows 0,2,5 | --rows 2x1/8bit/4] [--samples 8192] [--preset tiny]
                                [--server-dtype fp32|bf16] [--max-batch-tokens N]
                                [--summary-json PATH] [--keep-logs DIR]

Every row is one swarm on this machine, started from scratch and stopped before the next row (rows
never overlap): a DHT, `swarmtrain server --stage N` per replica (default threads), and one
`swarmtrain trainer --max-samples S --eval-samples E --in-flight K --compression C`. The run TOML sets
`training.max_samples = S`, so the swarm's learning-rate schedule has the same horizon as the local
reference. The reference is `LocalTrainer` (= train-local, 1 torch thread) on the same config and
the same S samples, computed once per run (it is deterministic). Both losses are on the same first
E validation samples (E = the preset's training.eval_samples; 256 on tiny).
`--server-dtype` and `--max-batch-tokens` go to every server (`swarmtrain server --dtype`, request
batching); the local reference is always fp32, so a bf16 row is measured against fp32 train-local.

Columns:
- servers: replicas per stage (stage0xstage1); codec: activations/gradients on the wire; in flight: K;
- swarm val / local val: validation loss after S samples (the swarm's through the swarm, forward only);
- gap %: (swarm / local - 1) * 100; negative means the swarm ended lower;
- <=2%: "yes" when gap % <= the tolerance (2 by default; a swarm that ends lower is also "yes");
- samples/s: the trainer's S / wall time of its training loop (warm-up included; on a shared
  2-core machine read it as a relative number between rows, not as a throughput benchmark);
- steps: optimizer steps each stage took (its server's epoch), stage0/stage1;
- smp/step: samples the stage applied per step (samples_seen / epoch). The local reference takes
  S / global_batch_size steps of global_batch_size samples (printed above the table): a stage that
  took fewer, larger steps, or more, smaller ones, trained on a different schedule than local.
  With 2 replicas the first replica's values are shown; `*` marks a stage whose replicas disagree.
Server counters are read with an info call after the trainer has exited, once they stop changing.
Below the table, rows that differ only in stage 0's replica count are paired: their samples/s ratio
(e.g. 2x1/8bit/4 / 1x1/8bit/4). On one machine, read it with `--cpus-per-server`: without a quota an
added replica brings no cores of its own, only another process competing for the same ones.

A row that fails (a peer does not start, the trainer exits non-zero or times out) is reported with
its log tail and the run goes on; the exit status is then 1. Ctrl-C stops the current swarm, prints
the rows done so far and writes them to --summary-json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmtrain.config import RunConfig, get_preset, load_run_config
from swarmtrain.config.run import COMPRESSION_CHOICES, LOWBIT_COMPRESSION
from swarmtrain.runtime.harness.cpu_quota import CpuQuota, CpuQuotaError
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, derived_run_toml, write_run_toml
from swarmtrain.runtime.local import LocalTrainer
from swarmtrain.runtime.trainer.trainer_metrics import trainer_metrics_from_log

CODECS = COMPRESSION_CHOICES
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    servers: tuple[int, ...]  # replicas per stage
    codec: str
    in_flight: int

    @property
    def label(self) -> str:
        """Also the readable form `--rows` accepts, e.g. 2x1/8bit/4."""
        return f"{'x'.join(map(str, self.servers))}/{self.codec}/{self.in_flight}"


MATRIX = [
    Row((1, 1), "none", 1),
    Row((1, 1), "8bit", 1),
    Row((1, 1), "none", 4),
    Row((1, 1), "8bit", 4),
    Row((2, 1), "8bit", 1),
    Row((2, 1), "8bit", 4),
    Row((1, 1), "8bit", 8),
    Row((2, 1), "8bit", 8),
]

ROWS_HELP = (
    "rows to run, comma-separated: indices into the matrix (0-based), ranges (2-5), `all`, or a "
    "readable spec SERVERSxSERVERS/CODEC/IN_FLIGHT (e.g. 2x1/8bit/4, also outside the matrix). "
    "Matrix: " + ", ".join(f"{i}={row.label}" for i, row in enumerate(MATRIX)) + " (default: all)"
)


def parse_rows(text: str) -> list[Row]:
    rows: list[Row] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item == "all":
            rows += MATRIX
        elif re.fullmatch(r"\d+", item):
            rows.append(_matrix_row(int(item)))
        elif m := re.fullmatch(r"(\d+)-(\d+)", item):
            rows += [_matrix_row(i) for i in range(int(m[1]), int(m[2]) + 1)]
        elif m := re.fullmatch(r"(\d+(?:x\d+)*)/([\w-]+)/(\d+)", item):
            servers = tuple(int(n) for n in m[1].split("x"))
            if m[2] not in CODECS or int(m[3]) < 1 or min(servers) < 1:
                raise argparse.ArgumentTypeError(f"bad row {item!r}: codec in {CODECS}, counts >= 1")
            rows.append(Row(servers, m[2], int(m[3])))
        else:
            raise argparse.ArgumentTypeError(
                f"bad row {item!r}: an index 0..{len(MATRIX) - 1}, a range like 2-5, `all`, or like 2x1/8bit/4"
            )
    if not rows:
        raise argparse.ArgumentTypeError("no rows selected")
    return rows


def parse_boundary(text: str) -> tuple[str, int]:
    from swarmtrain.config.model import BOUNDARY_CHOICES

    kind, _, dim = text.partition(":")
    if kind not in BOUNDARY_CHOICES[1:] or not dim.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected KIND:DIM with KIND in {BOUNDARY_CHOICES[1:]}, got {text!r}"
        )
    return kind, int(dim)


def _matrix_row(index: int) -> Row:
    if not 0 <= index < len(MATRIX):
        raise argparse.ArgumentTypeError(f"row index {index} out of range 0..{len(MATRIX) - 1}")
    return MATRIX[index]


def server_names(servers: tuple[int, ...]) -> list[tuple[str, int]]:
    """(name, stage) per server: s0, s1 for single replicas; s0a, s0b, ... for replicas."""
    names = []
    for stage, count in enumerate(servers):
        if count == 1:
            names.append((f"s{stage}", stage))
        else:
            names += [(f"s{stage}{chr(ord('a') + i)}", stage) for i in range(count)]
    return names


# the local reference ----------------------------------------------------------------------------
def local_reference(cfg: RunConfig) -> dict:
    torch.set_num_threads(1)
    cfg = cfg.replace(training=dataclasses.replace(cfg.training, eval_every_samples=0))
    trainer = LocalTrainer(cfg, progress=False)
    start = time.perf_counter()
    result = trainer.train()
    summary = result.summary()
    summary.update(
        wall_s=time.perf_counter() - start,
        steps=trainer.samples_seen // cfg.training.global_batch_size,
        samples_per_step=cfg.training.global_batch_size,
        eval_samples=cfg.training.eval_samples,
    )
    return summary


# one swarm row ------------------------------------------------------------------------------------
class RowFailed(RuntimeError):
    pass


def wait_trainer(swarm: LocalSwarm, timeout_s: float, samples: int, every_s: float = 20.0) -> int | None:
    """Wait for the trainer to exit, printing its latest progress line every `every_s` seconds."""
    proc = swarm.processes["trainer"]
    start = time.monotonic()
    next_print = start + every_s
    while True:
        try:
            return proc.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > timeout_s:
            return None
        if now >= next_print:
            next_print += every_s
            found = trainer_metrics_from_log(proc.log_text())
            if found:
                m = found[-1]
                print(
                    f"    {now - start:5.0f}s  {m.samples:6d}/{samples} samples  "
                    f"loss {m.loss:.3f}  {m.samples_per_s:.1f} samples/s",
                    flush=True,
                )
            else:
                print(f"    {now - start:5.0f}s  (no progress line yet)", flush=True)


def peer_ids_from_ledgers(swarm: LocalSwarm, names: list[tuple[str, int]]) -> dict[str, str]:
    """peer id -> server name, from each server's ledger `ready` event for its stage."""
    found = {}
    for name, stage in names:
        for ready in swarm.ledger_events(name, "ready"):
            if ready["stage"] == stage:
                found[ready["peer"]] = name
    return found


def server_counters(
    cfg: RunConfig, swarm: LocalSwarm, names: list[tuple[str, int]], settle_s: float = 45.0
) -> dict[str, dict]:
    """Each server's info counters once they stop changing (the last round may still be running when
    the trainer exits). Returns name -> {stage, peer, epoch, samples_seen, pending_samples}."""
    from swarmtrain.runtime.harness.probe import SwarmProbe

    counts = [0] * cfg.swarm.num_stages
    for _, stage in names:
        counts[stage] += 1
    name_of = peer_ids_from_ledgers(swarm, names)
    probe = SwarmProbe(cfg, [swarm.address])
    try:
        probe.wait_for_peers(counts, timeout_s=60)
        peers = [(peer, stage) for stage in range(len(counts)) for peer in probe.peers(stage)]
        deadline = time.monotonic() + settle_s
        previous, unchanged = None, 0
        while True:
            infos = {}
            for i, (peer, stage) in enumerate(peers):
                header = probe.info(peer).header
                name = name_of.get(peer, f"stage{stage}#{i}")
                infos[name] = {
                    "stage": stage,
                    "peer": peer,
                    "epoch": header.get("epoch"),
                    "samples_seen": header.get("samples_seen"),
                    "pending_samples": header.get("pending_samples"),
                }
            snapshot = {n: (v["epoch"], v["samples_seen"]) for n, v in infos.items()}
            unchanged = unchanged + 1 if snapshot == previous else 0
            previous = snapshot
            settled = all(not v["pending_samples"] for v in infos.values()) and not any(
                s["replicas_disagree"] for s in per_stage(infos, len(counts))
            )
            if (settled and unchanged >= 2) or unchanged >= 5 or time.monotonic() > deadline:
                return dict(sorted(infos.items()))
            time.sleep(1.0)
    finally:
        probe.close()


def per_stage(servers: dict[str, dict], num_stages: int) -> list[dict]:
    """Steps and samples per step of each stage: its first replica's (by name), and whether replicas differ."""
    stages = []
    for stage in range(num_stages):
        replicas = [v for _, v in sorted(servers.items()) if v["stage"] == stage]
        if not replicas:
            stages.append({"steps": None, "samples_per_step": None, "replicas_disagree": False})
            continue
        first = replicas[0]
        epoch, seen = first["epoch"], first["samples_seen"]
        stages.append(
            {
                "steps": epoch,
                "samples_seen": seen,
                "samples_per_step": seen / epoch if epoch and seen is not None else None,
                "replicas_disagree": any(
                    (r["epoch"], r["samples_seen"]) != (epoch, seen) for r in replicas[1:]
                ),
            }
        )
    return stages


def run_row(
    row: Row,
    config_path: Path,
    cfg: RunConfig,
    workdir: Path,
    timeout_s: float,
    cpus_per_server: float | None,
    server_args: tuple[str, ...] = (),
) -> dict:
    t = cfg.training
    names = server_names(row.servers)
    if row.codec in LOWBIT_COMPRESSION:  # part of the digest: the servers' run file names it too
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = derived_run_toml(
            config_path, workdir / "run.toml", {"swarm": {"compression": row.codec}}
        )
        cfg = cfg.replace(swarm=dataclasses.replace(cfg.swarm, compression=row.codec))
    with LocalSwarm(workdir, config_path, cpus_per_server=cpus_per_server) as swarm:
        try:
            swarm.start_dht()
            for name, stage in names:
                swarm.start_server(name, stage, *server_args)
            swarm.wait_ready([n for n, _ in names], timeout_s=180)
        except Exception as exc:
            raise RowFailed(f"swarm start-up failed: {exc}") from None
        start = time.monotonic()
        swarm.start_trainer(
            "trainer",
            "--max-samples",
            str(t.max_samples),
            "--eval-samples",
            str(t.eval_samples),
            "--in-flight",
            str(row.in_flight),
            "--compression",
            row.codec,
        )
        code = wait_trainer(swarm, timeout_s, t.max_samples)
        wall_s = time.monotonic() - start
        if code != 0:
            what = f"timed out after {timeout_s:.0f}s" if code is None else f"exited with {code}"
            raise RowFailed(f"trainer {what}:\n{swarm.processes['trainer'].log_text()[-3000:]}")
        summary = json.loads((workdir / "trainer.summary.json").read_text())
        try:
            servers = server_counters(cfg, swarm, names)
        except Exception as exc:
            raise RowFailed(f"info calls to the servers failed: {type(exc).__name__}: {exc}") from None
    return {
        "trainer_wall_s": wall_s,
        "val_loss": summary.get("val_loss"),
        "samples_per_s": summary.get("samples_per_s"),
        "samples": summary.get("samples"),
        "microbatches_completed": summary.get("microbatches_completed"),
        "microbatches_failed": summary.get("microbatches_failed"),
        "retries": summary.get("retries"),
        "timeouts": summary.get("timeouts"),
        "servers": servers,
        "stages": per_stage(servers, cfg.swarm.num_stages),
    }


# reporting ----------------------------------------------------------------------------------------
def machine_info() -> dict:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    try:
        from importlib.metadata import version

        hivemind_version = version("hivemind")
    except Exception:
        hivemind_version = None
    status = git("status", "--porcelain", "--", "src")
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "hivemind": hivemind_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "src_modified": bool(status) if status is not None else None,
    }


def gap_pct(swarm: float | None, local: float) -> float | None:
    return (swarm / local - 1.0) * 100.0 if swarm is not None else None


def _fmt(value, spec: str, width: int) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def _stage_cell(stage: dict, key: str, spec: str) -> str:
    value = stage[key]
    return ("-" if value is None else format(value, spec)) + ("*" if stage["replicas_disagree"] else "")


def print_table(results: list[dict], local: dict, tolerance_pct: float) -> None:
    header = (
        f"{'#':>2s} {'servers':>7s} {'codec':>5s} {'in flight':>9s} {'swarm val':>9s} {'local val':>9s} "
        f"{'gap %':>7s} {'<=' + format(tolerance_pct, 'g') + '%':>5s} {'samples/s':>9s} "
        f"{'steps':>11s} {'smp/step':>13s}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        row = r["row"]
        prefix = f"{r['index']:>2} {row['label'].split('/')[0]:>7s} {row['codec']:>5s} {row['in_flight']:>9d}"
        if r.get("error"):
            print(f"{prefix} FAILED: {r['error'].splitlines()[0][:80]}")
            continue
        steps = "/".join(_stage_cell(s, "steps", "d") for s in r["stages"])
        per_step = "/".join(_stage_cell(s, "samples_per_step", ".1f") for s in r["stages"])
        ok = "-" if r["gap_pct"] is None else ("yes" if r["within_tolerance"] else "no")
        print(
            f"{prefix} {_fmt(r['val_loss'], '.4f', 9)} {local['final_val_loss']:9.4f} "
            f"{_fmt(r['gap_pct'], '+.2f', 7)} {ok:>5s} {_fmt(r['samples_per_s'], '.1f', 9)} "
            f"{steps:>11s} {per_step:>13s}"
        )
    if any(s["replicas_disagree"] for r in results if not r.get("error") for s in r["stages"]):
        print("* replicas of this stage disagree (epoch or samples_seen); the first replica's value is shown")


def replica_speedups(results: list[dict]) -> list[dict]:
    """Rows that differ only in stage 0's replica count (same codec and in flight, the other stages
    equal), paired: the samples/s ratio of the larger count to the smaller, measured in this run."""
    done = [r for r in results if not r.get("error") and r.get("samples_per_s")]
    pairs = []
    for more in done:
        for fewer in done:
            a, b = more["row"], fewer["row"]
            same_rest = a["servers"][1:] == b["servers"][1:] and a["codec"] == b["codec"]
            if same_rest and a["in_flight"] == b["in_flight"] and a["servers"][0] > b["servers"][0]:
                ratio = more["samples_per_s"] / fewer["samples_per_s"]
                pairs.append({"more": a["label"], "fewer": b["label"], "ratio": round(ratio, 3)})
    return pairs


def print_speedups(pairs: list[dict]) -> None:
    for p in pairs:
        print(f"samples/s {p['more']} / {p['fewer']}: x{p['ratio']:.2f} (replicas of stage 0, same run)")


def parse_layer_cut(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 3,1, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every stage needs at least one block, got {text!r}")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=parse_rows, default=list(MATRIX), help=ROWS_HELP)
    parser.add_argument(
        "--local-steps",
        type=int,
        default=1,
        metavar="H",
        help="swarm.local_steps for every row: a stage's replicas step on their own gradients and "
        "average pseudo-gradients every H steps (default 1: every step)",
    )
    parser.add_argument(
        "--samples", type=int, default=8192, help="training samples, swarm and local (default 8192)"
    )
    parser.add_argument("--preset", default="tiny", help="model/training preset (default tiny)")
    parser.add_argument(
        "--tolerance-pct", type=float, default=2.0, help="the <=%% column's bound (default 2)"
    )
    parser.add_argument(
        "--row-timeout-s",
        type=float,
        help="give up on a row's trainer after this long (default 180 + 0.1 s per sample)",
    )
    parser.add_argument(
        "--cpus-per-server",
        type=float,
        metavar="CPUS",
        help="run each server in its own cgroup limited to CPUS cores (root; e.g. 0.5), so servers act as "
        "separate equal machines and an added replica brings its own compute; default: no limit "
        "(on a 2-core machine every server then shares the same 2 cores)",
    )
    parser.add_argument(
        "--layers-per-stage",
        type=parse_layer_cut,
        metavar="A,B",
        help="the model's blocks per stage (model.num_layers becomes their sum), e.g. 3,1 to make stage 0 "
        "the bottleneck, where a second stage-0 replica should add throughput; default: the preset's cut",
    )
    parser.add_argument(
        "--server-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="every server's --dtype (the local reference stays fp32: the bound is against fp32 train-local)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        metavar="N",
        help="every server's --max-batch-tokens (request batching; default 0: off)",
    )
    parser.add_argument(
        "--boundary",
        type=parse_boundary,
        metavar="KIND:DIM",
        help="boundary layers between the swarm's stages for every row ([model] boundary and boundary_dim, "
        "e.g. lowrank:16); the local reference stays the plain model, so the gap is the whole cost",
    )
    parser.add_argument("--summary-json", metavar="PATH", help="all rows, the local reference, machine info")
    parser.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep each row's run TOML, peer logs, ledgers and trainer summary in DIR/rowN-... "
        "(those subfolders are replaced when they exist)",
    )
    args = parser.parse_args()

    cfg = get_preset(args.preset)
    g = cfg.training.global_batch_size
    if args.layers_per_stage and len(args.layers_per_stage) != cfg.swarm.num_stages:
        parser.error(f"--layers-per-stage needs {cfg.swarm.num_stages} counts on {args.preset}")
    if args.samples < g or args.samples % g:
        parser.error(f"--samples must be a positive multiple of the global batch ({g} on {args.preset})")
    too_many = [r.label for r in args.rows if len(r.servers) > cfg.swarm.num_stages]
    if too_many:
        parser.error(f"rows {too_many} name more stages than {args.preset} has ({cfg.swarm.num_stages})")
    rows = [
        dataclasses.replace(r, servers=r.servers + (1,) * (cfg.swarm.num_stages - len(r.servers)))
        for r in args.rows
    ]
    timeout_s = args.row_timeout_s or 180.0 + 0.1 * args.samples
    if args.max_batch_tokens < 0:
        parser.error("--max-batch-tokens must be >= 0")
    server_args = ("--dtype", args.server_dtype, "--max-batch-tokens", str(args.max_batch_tokens))
    if args.cpus_per_server is not None:
        try:  # fail now, not in every row
            CpuQuota("check", args.cpus_per_server).remove()
        except CpuQuotaError as exc:
            parser.error(str(exc))

    def on_sigterm(signum, frame):  # stop the swarm as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    from swarmtrain.runtime.procs import forked_children_die_with_me

    forked_children_die_with_me()  # the probe's DHT fork dies with this process

    keep = Path(args.keep_logs) if args.keep_logs else None
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="convergence-")
    base = keep or Path(tmp.name)
    base.mkdir(parents=True, exist_ok=True)
    overrides = {
        "training": {"max_samples": args.samples},
        # rebalancing off: every row runs the same fleet (a move changes who computes, not what)
        "swarm": {"announce_period_s": 1.0, "local_steps": args.local_steps, "rebalance_period_s": 0.0},
    }
    if args.layers_per_stage:
        overrides["model"] = {"num_layers": sum(args.layers_per_stage)}
        overrides["swarm"]["layers_per_stage"] = list(args.layers_per_stage)
    # the local reference is the plain model: boundary layers are part of what the swarm is judged on
    local_cfg = load_run_config(write_run_toml(base / "local.toml", args.preset, overrides))
    if args.boundary:
        kind, dim = args.boundary
        overrides.setdefault("model", {}).update({"boundary": kind, "boundary_dim": dim})
    config_path = write_run_toml(base / "run.toml", args.preset, overrides)
    cfg = load_run_config(config_path)
    t = cfg.training

    report: dict = {
        "preset": args.preset,
        "samples": args.samples,
        "eval_samples": t.eval_samples,
        "global_batch_size": g,
        "micro_batch_size": t.micro_batch_size,
        "tolerance_pct": args.tolerance_pct,
        "cpus_per_server": args.cpus_per_server,
        "server_dtype": args.server_dtype,
        "max_batch_tokens": args.max_batch_tokens,
        "boundary": list(args.boundary) if args.boundary else None,
        "run_toml": config_path.read_text(),
        "machine": machine_info(),
        "local": None,
        "rows": [],
    }

    def save() -> None:
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(report, indent=2) + "\n")

    results = report["rows"]
    interrupted = False
    try:
        print(
            f"preset {args.preset}, {args.samples} samples, val loss on {t.eval_samples} samples; "
            f"{len(rows)} row(s), one swarm at a time"
            + (f"; boundary layers {args.boundary[0]}:{args.boundary[1]}" if args.boundary else "")
            + (
                "" if args.cpus_per_server is None else f"; each server limited to {args.cpus_per_server} CPU"
            ),
            flush=True,
        )
        print("local reference (train-local, 1 thread) ...", flush=True)
        local = report["local"] = local_reference(local_cfg)
        print(
            f"local: val loss {local['initial_val_loss']:.4f} -> {local['final_val_loss']:.4f}, "
            f"{local['steps']} steps of {g} samples, {local['samples_per_s']:.1f} samples/s "
            f"({local['wall_s']:.0f}s)",
            flush=True,
        )
        save()
        for n, row in enumerate(rows):
            index = MATRIX.index(row) if row in MATRIX else None
            tag = f"row{index}" if index is not None else "row"
            workdir = base / f"{tag}-{row.label.replace('/', '-')}"
            if keep and workdir.exists():
                shutil.rmtree(workdir)
            print(
                f"[{n + 1}/{len(rows)}] {tag} {row.label}: servers {row.servers}, codec {row.codec}, "
                f"{row.in_flight} in flight ...",
                flush=True,
            )
            entry = {
                "index": index if index is not None else "-",
                "row": {
                    "label": row.label,
                    "servers": list(row.servers),
                    "codec": row.codec,
                    "in_flight": row.in_flight,
                },
            }
            start = time.monotonic()
            try:
                entry.update(
                    run_row(row, config_path, cfg, workdir, timeout_s, args.cpus_per_server, server_args)
                )
                entry["gap_pct"] = gap_pct(entry["val_loss"], local["final_val_loss"])
                entry["within_tolerance"] = (
                    entry["gap_pct"] is not None and entry["gap_pct"] <= args.tolerance_pct
                )
                steps = " ".join(
                    f"stage{i} {s['steps']} steps x {s['samples_per_step'] or 0:.1f}"
                    + (" (replicas disagree)" if s["replicas_disagree"] else "")
                    for i, s in enumerate(entry["stages"])
                )
                val = entry["val_loss"]
                print(
                    f"    done in {time.monotonic() - start:.0f}s: swarm val "
                    + (f"{val:.4f} (gap {entry['gap_pct']:+.2f}%)" if val is not None else "n/a")
                    + f", {entry['samples_per_s'] or 0:.1f} samples/s; {steps}",
                    flush=True,
                )
            except RowFailed as exc:
                entry["error"] = str(exc)
                print(f"    FAILED after {time.monotonic() - start:.0f}s: {exc}", flush=True)
                if keep:
                    print(f"    logs: {workdir}", flush=True)
            entry["row_wall_s"] = time.monotonic() - start
            results.append(entry)
            save()
    except KeyboardInterrupt:
        interrupted = report["interrupted"] = True
        print("\ninterrupted: swarm stopped", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["replica_speedups"] = replica_speedups(results)
    save()
    if report["local"] is not None and results:
        print()
        print(
            f"local reference: val loss {report['local']['final_val_loss']:.4f} after {args.samples} samples, "
            f"{report['local']['steps']} steps x {g} samples"
        )
        print_table(results, report["local"], args.tolerance_pct)
        print_speedups(report["replica_speedups"])
    if interrupted:
        return 130
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
