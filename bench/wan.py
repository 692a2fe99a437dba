"""The swarm against PyTorch's own pipelining (GPipe) over rate-limited links, and how the swarm's data
paths and codecs change what a sample costs on the wire.

    python bench/wan.py [--preset small | --config RUN.toml] [--rates 10,50,inf] [--duration-s 40]
                        [--configs gpipe-fp32,relay-fp32,relay-8bit,direct-fp32,direct-8bit]
                        [--time-to-target [--target-loss L] [--ttt-eval-every 4]]
                        [--summary-json PATH] [--keep-logs DIR]

Needs root and the WAN test bed (`runtime/harness/netbed.py`); otherwise it prints one line saying why
and exits 0 ("skipped"). At each link rate (Mbit/s per peer, the same up and down; `inf`: no limit), the
configurations run one after the other, each from scratch, every process in its own network namespace
behind `tc tbf` at that rate:
- gpipe-fp32: `bench/gpipe_rank.py`, `torch.distributed.pipelining.ScheduleGPipe` over gloo, one rank per
  stage (fp32, the run's global batch as global / micro_batch_size micro-batches, 1 torch thread, one
  untimed warm-up step); it trains exactly as `swarmtrain train-local` does;
- relay-fp32, relay-8bit, direct-fp32, direct-8bit: a DHT, `swarmtrain server --stage S --threads 1` per
  stage and one `swarmtrain trainer --hand-off H --compression C` (trainer defaults otherwise). relay:
  every activation and gradient goes through the trainer; direct: the servers hand them to each other,
  over their direct data plane (net/data_plane.py; server defaults: cubic congestion control where the
  system permits it, which as root it does, while GPipe's gloo sockets keep the system's default).
Each runs --duration-s seconds of training (after the servers are ready; GPipe: after its warm-up step),
then to the end of the step in progress. Configurations are a registry (`REGISTRY`) that more codecs
and model boundary layers plug into; `--configs` selects.

Printed per rate (rows; configurations of a rate run back to back):
- samples/s of every configuration (columns): the trainer's summary (`samples_per_s`: its samples over
  its training loop, first step included), GPipe's timed steps (after its warm-up step);
- ratios measured in the same run: direct-8bit / relay-8bit and direct-fp32 / gpipe-fp32 (samples/s),
  and, per direct configuration, the trainer's bytes per sample / a stage server's (the servers' mean);
- the last stage's counted bytes per sample of every direct configuration against direct-fp32's: the
  messages its transport received and sent (libp2p and the data plane: the boundary both ways with
  labels, ids and message headers, the trainer's step closes), from its last metrics line (the server's
  own `bytes_in`, `bytes_out` and `samples_forward`), without the DHT and TCP/IP traffic the wire adds;
- bytes per sample of every role (trainer, stage-S server or GPipe rank, DHT): sent + received on the
  namespace's interfaces (/proc/net/dev inside it: payloads, RPC and DHT traffic, TCP/IP headers), from
  the moment the servers are ready (GPipe: before its ranks start) to the trainer's exit, / the samples
  trained meanwhile (the trainer's own start-up and GPipe's warm-up step included). The summary JSON has
  both directions;
- link use at limited rates: every role's bytes sent and received over the same interval / what its
  link could carry in that time (rate x seconds; start-up and the last step's drain count as unused).

--time-to-target (optional: ~30-40 minutes on `small` on 2 cores) scores each configuration as Protocol NanoGPT
scores compressed pipelines: steps to a target validation loss x time per step at 10 Mbit/s (--ttt-rate).
- target: --target-loss, or the validation loss train-local reaches at 60% of training.max_samples;
- steps to target, per math: GPipe's is train-local's (the same model, data order and optimizer:
  `runtime/local.py`'s LocalTrainer, evaluated every --ttt-eval-every steps); the swarm's is measured
  once per codec on loopback without rate limits (relay and direct compute the same thing, so one swarm
  per codec serves both): a DHT, one server per stage and a trainer started again for every evaluation
  (`--max-samples` of --ttt-eval-every steps and `--eval-samples`; a restarted trainer continues at the
  swarm's step), evaluations from 75% of train-local's steps to target on. The swarm's fp32 math is not
  exactly train-local's: each stage clips its own gradient norm (train-local and GPipe: the whole
  model's), and its evaluation goes through the codec. The crossing is interpolated
  linearly between the last evaluation above the target and the first at or below it (`<=`: the first
  evaluation was already below it);
- time per step: global batch / samples/s of that configuration at --ttt-rate in the sweep above;
  a second table does the same at every rate of the sweep, with each row's time against direct-8bit's
  at that rate and against direct-fp32's on unlimited links, and its steps against direct-fp32's.

Not measured: latency, jitter and loss (the kernel has no netem: a link here is narrow but answers as
fast as loopback), so these are bandwidth-bound results; machines of different speeds (every process
shares this machine's cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.config import get_preset, load_run_config
from swarmtrain.config.run import LOWBIT_COMPRESSION
from swarmtrain.runtime.harness import netbed
from swarmtrain.runtime.harness.local_swarm import (
    LocalSwarm,
    SwarmStartError,
    derived_run_toml,
    write_run_toml,
)
from swarmtrain.runtime.procs import ManagedProcess
from swarmtrain.runtime.server.server_metrics import metrics_from_log
from swarmtrain.runtime.trainer.trainer_metrics import trainer_metrics_from_log

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replicas_vs_swarm import (  # noqa: E402
    fmt_bw,
    machine_info,
    namespace_bytes,
    parse_bandwidths,
)

BENCH = Path(__file__).resolve().parent
GPIPE_RANK = BENCH / "gpipe_rank.py"
DEFAULT_RATES = "10,50,inf"
DEFAULT_DURATION_S = 40.0
GPIPE_PORT = 29500  # every GPipe run has fresh namespaces: no other process holds it there
GPIPE_WARMUP_STEPS = 1
GPIPE_MAX_STEPS = 100_000  # --duration-s ends the run
SERVER_READY_TIMEOUT_S = 180.0
TABLE_TIMEOUT_S = 180.0  # `swarmtrain boundary-table` on a run's own tokens: seconds on the presets
PROGRESS_EVERY_S = 10.0
POLL_S = 0.5
TTT_RATE_MBIT_S = 10.0
TTT_TARGET_FRACTION = 0.6  # of training.max_samples: where train-local's loss is the default target
TTT_SWARM_FROM = 0.75  # of train-local's steps to target: the swarm's first evaluation
RATIO_PAIRS = (("direct-8bit", "relay-8bit"), ("direct-fp32", "gpipe-fp32"))


class RunFailed(RuntimeError):
    pass


# configurations ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What every run of this invocation shares."""

    config_path: Path
    num_stages: int
    global_batch: int
    duration_s: float
    run_timeout_s: float
    eval_samples: int
    d_model: int = 0  # the model's hidden size: boundary layers are sized as a fraction of it
    in_flight: int | None = None  # the trainer's --in-flight; None: its default


@dataclass(frozen=True)
class BenchConfig:
    """One column of the table. `runner(config, setup, mbit_s, workdir) -> result` runs it at one rate
    (inf: no limit). `math`: configurations with the same one train identically (one
    steps-to-target measurement serves them all)."""

    name: str
    runner: Callable[[BenchConfig, Setup, float, Path], dict]
    description: str
    math: str
    hand_off: str | None = None
    codec: str | None = None
    server_args: tuple[str, ...] = ()
    trainer_args: tuple[str, ...] = ()
    # boundary layers between the stages ([model] boundary): (kind, divisor): boundary_dim = d_model / divisor
    boundary: tuple[str, int] | None = None
    table: bool = False  # subspace only: E0 from the training data (`swarmtrain boundary-table`)

    def run_file(self, setup: Setup, workdir: Path) -> Path:
        """The run file of this configuration: the setup's, plus a codec below 8 bits and boundary
        layers, which are part of the run digest (every peer's run file names them)."""
        overrides: dict[str, dict] = {}
        if self.codec in LOWBIT_COMPRESSION:
            overrides["swarm"] = {"compression": self.codec}
        if self.boundary:
            kind, divisor = self.boundary
            overrides["model"] = {"boundary": kind, "boundary_dim": setup.d_model // divisor}
            if self.table:
                overrides["model"]["boundary_table"] = str(boundary_table_file(setup))
        if not overrides:
            return setup.config_path
        workdir.mkdir(parents=True, exist_ok=True)
        return derived_run_toml(setup.config_path, workdir / "run.toml", overrides)


def boundary_table_file(setup: Setup) -> Path:
    """The setup's subspace token table, made once beside its run file from the tokens its runs train on
    (training.max_samples sequences: a table from more data than the run sees would compare unequally)."""
    path = setup.config_path.parent / "boundary-table.safetensors"
    if not path.exists():
        cfg = load_run_config(setup.config_path)
        tokens = cfg.training.max_samples * cfg.model.seq_len
        argv = [
            sys.executable,
            "-m",
            "swarmtrain.cli.main",
            "boundary-table",
            "--config",
            str(setup.config_path),
        ]
        argv += ["--max-tokens", str(tokens), "--out", str(path)]
        subprocess.run(argv, check=True, timeout=TABLE_TIMEOUT_S)
    return path


# counters and processes ----------------------------------------------------------------------------
def all_counters(bed, peers: int) -> list[tuple[int, int]]:
    """(sent, received) bytes of every peer's namespace."""
    return [namespace_bytes(bed, i) for i in range(peers)]


def bytes_by_role(roles: list[str], before, after) -> dict[str, dict[str, int]]:
    return {
        role: {"sent": a[0] - b[0], "received": a[1] - b[1]}
        for role, b, a in zip(roles, before, after, strict=True)
    }


def per_sample(by_role: dict[str, dict[str, int]], samples: int) -> dict[str, float | None]:
    """Sent + received bytes per sample of every role."""
    return {role: (v["sent"] + v["received"]) / samples if samples else None for role, v in by_role.items()}


def namespace_ifname(bed, i: int) -> str:
    """The veth inside peer i's namespace (gloo must use it, not loopback)."""
    text = subprocess.run(
        ["ip", "-n", bed.namespace(i), "-o", "link", "show"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in text.splitlines() if line.count(":") >= 2]
    links = [name for name in names if name != "lo"]
    if len(links) != 1:
        raise RunFailed(f"namespace {bed.namespace(i)} has links {names}: expected lo and one veth")
    return links[0]


def wait_workers(workers: dict, keep_alive: dict, timeout_s: float, label: str, progress) -> None:
    """Until every process of `workers` exited 0; RunFailed when one fails, one of `keep_alive` exits
    first, or after `timeout_s`. A progress line every PROGRESS_EVERY_S."""
    start = time.monotonic()
    next_print = start + PROGRESS_EVERY_S
    while True:
        codes = {name: proc.proc.poll() for name, proc in workers.items()}
        gone = {name: proc.proc.poll() for name, proc in keep_alive.items() if not proc.alive}
        bad = {n: c for n, c in codes.items() if c not in (None, 0)} | gone
        if bad:
            name = next(iter(bad))
            proc = workers.get(name) or keep_alive[name]
            raise RunFailed(f"{name} exited with {bad[name]}:\n{proc.log_text()[-3000:]}")
        if all(code == 0 for code in codes.values()):
            return
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            raise RunFailed(f"{label}: still running after {timeout_s:.0f}s")
        if time.monotonic() >= next_print:
            next_print += PROGRESS_EVERY_S
            print(f"      {label} {elapsed:5.0f}s  {progress()}", flush=True)
        time.sleep(POLL_S)


def trainer_progress(log_text: str) -> str:
    found = trainer_metrics_from_log(log_text)
    if not found:
        return "(trainer: no progress line yet)"
    m = found[-1]
    return f"{m.samples} samples, loss {m.loss:.3f}, {m.samples_per_s:.1f} samples/s"


def gpipe_progress(log_text: str) -> str:
    lines = [line for line in log_text.splitlines() if line.startswith("step ")]
    return lines[-1] if lines else "(gpipe: no step yet)"


# one run -------------------------------------------------------------------------------------------
def _rate(mbit_s: float) -> float | None:
    """The test bed's limit: None for `inf`."""
    return None if math.isinf(mbit_s) else mbit_s


def run_swarm(config: BenchConfig, setup: Setup, mbit_s: float, workdir: Path) -> dict:
    """A DHT, a server per stage and a trainer, each in its own namespace at `mbit_s`."""
    servers = [f"stage{s}" for s in range(setup.num_stages)]
    roles = ["dht", *servers, "trainer"]
    index = {name: i for i, name in enumerate(roles)}
    label = f"{config.name} @ {fmt_bw(mbit_s)}"
    with ExitStack() as stack:
        rate = _rate(mbit_s)
        bed = stack.enter_context(netbed.WanTestbed(len(roles), up_mbit_s=rate, down_mbit_s=rate))
        # entered after the test bed: every process is stopped before the test bed goes
        run_file = config.run_file(setup, workdir)
        swarm = stack.enter_context(LocalSwarm(workdir, run_file, netbed=bed, netbed_peers=index))
        try:
            swarm.start_dht()
            for stage, name in enumerate(servers):
                swarm.start_server(name, stage, "--threads", "1", *config.server_args)
            swarm.wait_ready(servers, timeout_s=SERVER_READY_TIMEOUT_S)
        except SwarmStartError as exc:
            raise RunFailed(f"start-up failed: {exc}") from None
        before, began_s = all_counters(bed, len(roles)), time.monotonic()
        swarm.start_trainer(
            "trainer",
            *("--duration-s", f"{setup.duration_s:g}", "--hand-off", config.hand_off),
            *("--compression", config.codec, "--log-period-s", "5", *config.trainer_args),
            *(("--in-flight", str(setup.in_flight)) if setup.in_flight else ()),
        )
        procs = swarm.processes
        wait_workers(
            {"trainer": procs["trainer"]},
            {n: procs[n] for n in ["dht", *servers]},
            setup.duration_s + setup.run_timeout_s,
            label,
            lambda: trainer_progress(procs["trainer"].log_text()),
        )
        after, elapsed_s = all_counters(bed, len(roles)), time.monotonic() - began_s
        summary = json.loads(swarm.summary_path("trainer").read_text())
        counted = counted_bytes_per_sample(procs[servers[-1]].log_text())
    by_role = bytes_by_role(roles, before, after)
    result = _result(
        summary["samples"], summary["samples_per_s"], by_role, link_use(by_role, mbit_s, elapsed_s)
    )
    return dict(result, last_stage_counted_bytes_per_sample=counted)


def counted_bytes_per_sample(server_log: str) -> float | None:
    """A server's transport bytes (received + sent: its messages, headers included) / the samples of its
    training forwards, at its last metrics line; None before it logged one with samples. Forwards, not
    applied steps: a slow run applies one or two steps, and the micro-batches of the step in progress
    would count as bytes without samples (`small` fp32 at 10 Mbit/s: twice the bytes per sample)."""
    found = metrics_from_log(server_log)
    if not found or not found[-1].samples_forward:
        return None
    return (found[-1].bytes_in + found[-1].bytes_out) / found[-1].samples_forward


def _gpipe_argv(setup: Setup, bed, rank: int, ifname: str, summary: Path) -> list[str]:
    return bed.wrap(
        rank,
        [
            sys.executable,
            str(GPIPE_RANK),
            *("--rank", str(rank), "--world-size", str(setup.num_stages)),
            *("--master-addr", bed.host(0), "--master-port", str(GPIPE_PORT), "--ifname", ifname),
            *("--config", str(setup.config_path), "--threads", "1"),
            *("--warmup-steps", str(GPIPE_WARMUP_STEPS), "--steps", str(GPIPE_MAX_STEPS)),
            *("--duration-s", f"{setup.duration_s:g}", "--summary-json", str(summary)),
        ],
    )


def run_gpipe(config: BenchConfig, setup: Setup, mbit_s: float, workdir: Path) -> dict:
    """One gpipe_rank.py per stage, each in its own namespace at `mbit_s`."""
    roles = [f"stage{r}" for r in range(setup.num_stages)]
    summary_path = workdir / "gpipe.summary.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with ExitStack() as stack:
        rate = _rate(mbit_s)
        bed = stack.enter_context(netbed.WanTestbed(len(roles), up_mbit_s=rate, down_mbit_s=rate))
        workdir.mkdir(parents=True, exist_ok=True)
        before, began_s = all_counters(bed, len(roles)), time.monotonic()
        ranks: dict[str, ManagedProcess] = {}
        for r in range(len(roles)):
            argv = _gpipe_argv(setup, bed, r, namespace_ifname(bed, r), summary_path)
            ranks[f"rank{r}"] = ManagedProcess(f"rank{r}", argv, workdir / f"rank{r}.log", env=env)
            stack.callback(ranks[f"rank{r}"].stop)  # before the test bed goes (LIFO)
        wait_workers(
            ranks,
            {},
            setup.duration_s + setup.run_timeout_s,
            f"{config.name} @ {fmt_bw(mbit_s)}",
            lambda: gpipe_progress(ranks["rank0"].log_text()),
        )
        after, elapsed_s = all_counters(bed, len(roles)), time.monotonic() - began_s
    summary = json.loads(summary_path.read_text())
    by_role = bytes_by_role(roles, before, after)
    use = link_use(by_role, mbit_s, elapsed_s)
    result = _result(summary["samples"], summary["samples_per_s"], by_role, use)
    result.update(timed_steps=summary["timed_steps"], mean_loss=summary["mean_loss"])
    return result


def link_use(by_role: dict[str, dict[str, int]], mbit_s: float, elapsed_s: float) -> dict | None:
    """Each role's bytes sent and received as a fraction of its link's rate over `elapsed_s` (None on
    unlimited links): how much of the link the run left unused, start-up and the last step included."""
    if math.isinf(mbit_s) or elapsed_s <= 0:
        return None
    capacity = mbit_s * 1e6 / 8 * elapsed_s
    return {
        role: {"up": v["sent"] / capacity, "down": v["received"] / capacity} for role, v in by_role.items()
    }


def _result(samples: int, samples_per_s: float, by_role: dict, use: dict | None) -> dict:
    return {
        "samples": samples,
        "samples_per_s": samples_per_s,
        "bytes": by_role,
        "bytes_per_sample": per_sample(by_role, samples),
        "link_use": use,
    }


# the registry: codecs and model boundary layers plug in here
def _swarm_config(
    hand_off: str, codec: str, boundary: tuple[str, int] | None = None, table: bool = False
) -> BenchConfig:
    label = ("fp32" if codec == "none" else codec) + (f"-{boundary[0]}{boundary[1]}" if boundary else "")
    label += "-table" if table else ""
    return BenchConfig(
        name=f"{hand_off}-{label}",
        runner=run_swarm,
        description=f"swarm, --hand-off {hand_off} --compression {codec}"
        + (f", {boundary[0]} boundary of d_model/{boundary[1]}" if boundary else "")
        + (", token table from the data" if table else ""),
        math=f"swarm-{label}",
        hand_off=hand_off,
        codec=codec,
        boundary=boundary,
        table=table,
    )


REGISTRY: list[BenchConfig] = [
    BenchConfig("gpipe-fp32", run_gpipe, "torch.distributed.pipelining ScheduleGPipe over gloo", "local"),
    _swarm_config("relay", "none"),
    _swarm_config("relay", "8bit"),
    _swarm_config("direct", "none"),
    _swarm_config("direct", "8bit"),
    # below 8 bits (net/codec.py), and boundary layers of d_model / 2 with a codec on top (model/boundary.py)
    _swarm_config("direct", "4bit"),
    _swarm_config("direct", "4bit-rht"),
    _swarm_config("direct", "3bit"),
    _swarm_config("direct", "3bit-rht"),
    _swarm_config("direct", "2bit"),
    _swarm_config("direct", "2bit-rht"),
    _swarm_config("direct", "4bit", ("lowrank", 2)),
    _swarm_config("direct", "4bit", ("lowrank-embed", 2)),
    _swarm_config("direct", "4bit", ("lowrank-embed", 4)),
    _swarm_config("direct", "4bit", ("bottleneck", 2)),
    _swarm_config("direct", "4bit", ("maxout", 2)),
    # exact subspace boundaries (model/subspace.py): k = d_model / 16 coordinates and the token ids
    _swarm_config("direct", "4bit", ("subspace", 16)),
    _swarm_config("direct", "8bit", ("subspace", 16)),
    _swarm_config("direct", "4bit", ("subspace", 8)),
    # ... with the fixed token table made from the training data (data/token_table.py)
    _swarm_config("direct", "4bit", ("subspace", 16), table=True),
    _swarm_config("direct", "8bit", ("subspace", 16), table=True),
    _swarm_config("direct", "4bit", ("subspace", 8), table=True),
]
# what runs without --configs: GPipe and the swarm's data paths at fp32 and 8-bit
DEFAULT_CONFIGS = "gpipe-fp32,relay-fp32,relay-8bit,direct-fp32,direct-8bit"


def config_names() -> list[str]:
    return [c.name for c in REGISTRY]


def parse_configs(text: str) -> list[BenchConfig]:
    """Comma-separated registry names, returned in registry order."""
    wanted = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in wanted if name not in config_names()]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(config_names())}"
        )
    return [c for c in REGISTRY if c.name in wanted]


def run_config(config: BenchConfig, setup: Setup, mbit_s: float, workdir: Path) -> dict:
    """A run, its failure recorded instead of raised."""
    began = time.monotonic()
    try:
        result = config.runner(config, setup, mbit_s, workdir)
    except (RunFailed, netbed.NetbedError, OSError, ValueError, KeyError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["wall_s"] = time.monotonic() - began
    return result


# ratios and tables ---------------------------------------------------------------------------------
def _samples_per_s(runs: dict, name: str) -> float | None:
    run = runs.get(name) or {}
    return None if run.get("error") else run.get("samples_per_s")


def trainer_to_server_bytes(run: dict) -> float | None:
    """The trainer's bytes per sample / the stage servers' mean bytes per sample."""
    bps = run.get("bytes_per_sample") or {}
    servers = [v for role, v in bps.items() if role.startswith("stage") and v]
    if run.get("error") or not servers or bps.get("trainer") is None:
        return None
    return bps["trainer"] / (sum(servers) / len(servers))


def ratios(runs: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for a, b in RATIO_PAIRS:
        if a in runs and b in runs:
            sa, sb = _samples_per_s(runs, a), _samples_per_s(runs, b)
            out[f"{a} / {b}"] = sa / sb if sa and sb else None
    for name in ("direct-fp32", "direct-8bit"):
        if name in runs:
            out[f"trainer / server bytes, {name}"] = trainer_to_server_bytes(runs[name])
    for name in runs:  # codecs below 8 bits and boundary layers: against 8-bit's speed and fp32's bytes
        if not name.startswith("direct-") or name in ("direct-fp32", "direct-8bit"):
            continue
        if "direct-8bit" in runs:
            sa, sb = _samples_per_s(runs, name), _samples_per_s(runs, "direct-8bit")
            out[f"{name} / direct-8bit"] = sa / sb if sa and sb else None
        if "direct-fp32" in runs:
            out[f"last-stage bytes, direct-fp32 / {name}"] = last_stage_bytes_ratio(
                runs["direct-fp32"], runs[name]
            )
            out[f"last-stage counted bytes, direct-fp32 / {name}"] = counted_bytes_ratio(
                runs["direct-fp32"], runs[name]
            )
    return out


def counted_bytes_ratio(reference: dict, run: dict) -> float | None:
    """The last stage's counted bytes per sample (`counted_bytes_per_sample`) in `reference` / in `run`."""
    key = "last_stage_counted_bytes_per_sample"
    a, b = reference.get(key), run.get(key)
    return a / b if a and b and not (reference.get("error") or run.get("error")) else None


def last_stage_bytes_ratio(reference: dict, run: dict) -> float | None:
    """The last stage's bytes per sample (its link carries the boundary both ways, its labels, control
    messages and DHT traffic, with TCP/IP headers) in `reference` / in `run`."""
    if reference.get("error") or run.get("error"):
        return None
    last = max((role for role in run.get("bytes_per_sample") or {} if role.startswith("stage")), default=None)
    a, b = (reference.get("bytes_per_sample") or {}).get(last), run["bytes_per_sample"].get(last)
    return a / b if a and b else None


def _f(value, spec: str, width: int) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def _table(header: list[str], rows: list[list[str]], first_width: int = 10) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    widths[0] = max(widths[0], first_width)
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return [line(header), "-" * len(line(header)), *(line(r) for r in rows)]


def _cell(run: dict | None, value: str) -> str:
    if run is None:
        return "-"
    return "FAILED" if run.get("error") else value


def throughput_lines(report: dict) -> list[str]:
    names = report["configs"]
    rows = [
        [point["rate"]]
        + [_cell(point["runs"].get(n), _f(_samples_per_s(point["runs"], n), ".1f", 0)) for n in names]
        for point in report["points"]
    ]
    return ["samples/s (rows: Mbit/s per peer, up and down)", *_table(["Mbit/s", *names], rows)]


def ratio_lines(report: dict) -> list[str]:
    labels = list(dict.fromkeys(k for p in report["points"] for k in p.get("ratios", {})))
    if not labels:
        return []
    rows = [
        [p["rate"]] + [_f(p.get("ratios", {}).get(k), ".2f", 0) for k in labels] for p in report["points"]
    ]
    return ["ratios, measured in the same run", *_table(["Mbit/s", *labels], rows)]


def _role_rows(report: dict, cell, keep=lambda run: True) -> list[list[str]]:
    """A row per (rate, configuration) that ran and `keep`s: rate, name, `cell(run, role)` per role."""
    rows = []
    for point in report["points"]:
        for name in report["configs"]:
            run = point["runs"].get(name)
            if run is not None and keep(run):
                rows.append([point["rate"], name, *(_cell(run, cell(run, r)) for r in report["roles"])])
    return rows


def _kb_per_sample(run: dict, role: str) -> str:
    value = (run.get("bytes_per_sample") or {}).get(role)
    return _f(value / 1e3 if value is not None else None, ",.1f", 0)


def _use(run: dict, role: str) -> str:
    use = (run.get("link_use") or {}).get(role)
    return f"{use['up']:.0%} / {use['down']:.0%}" if use else "-"


def bytes_lines(report: dict) -> list[str]:
    title = "kB per sample, sent + received, per role (gpipe: rank S in the stageS column)"
    rows = _role_rows(report, _kb_per_sample)
    return [title, *_table(["Mbit/s", "config", *report["roles"]], rows)]


def link_use_lines(report: dict) -> list[str]:
    rows = _role_rows(report, _use, keep=lambda run: run.get("link_use") is not None or run.get("error"))
    if not rows:
        return []
    title = "link use, up / down: bytes on the link / (its rate x the run's time), per role"
    return [title, *_table(["Mbit/s", "config", *report["roles"]], rows)]


def ttt_lines(ttt: dict) -> list[str]:
    if not ttt:
        return []
    lines = [
        f"time to validation loss {ttt['target_loss']:.4f} ({ttt['target_source']}) at {fmt_bw(ttt['rate_mbit_s'])} "
        "Mbit/s = steps to target x s/step",
        "steps to target: " + "; ".join(f"{m}: {describe_steps(s)}" for m, s in ttt["steps"].items()),
        f"({ttt['note']})",
    ]
    rows = [
        [
            name,
            describe_steps(row["steps"]),
            _f(row["s_per_step"], ".3f", 0),
            _f(row["minutes"], ".2f", 0),
            _f(_relative(row, ttt["configs"].get("direct-8bit")), ".2f", 0),
        ]
        for name, row in ttt["configs"].items()
    ]
    lines += _table(["config", "steps", "s/step", "minutes", "direct-8bit / this"], rows)
    lines += minutes_by_rate_lines(ttt)
    for name, m in (ttt.get("matched") or {}).items():
        lines.append(
            f"{name}: {m['parameters']:,} parameters (plain model {m['plain_parameters']:,}); the plain model "
            f"of {m['matched_parameters']:,} (d_ff {m['matched_d_ff']}) reaches {m['target']:.4f} at the "
            f"target step; {name} gets there in {describe_steps(m['steps'])}"
        )
    return lines


def minutes_by_rate_lines(ttt: dict) -> list[str]:
    """Minutes to the target at every rate of the sweep, how many times sooner than direct-8bit at the
    same rate, and against direct-fp32 on unlimited links (does the link still show?); steps against
    direct-fp32's."""
    by_rate = ttt.get("minutes_by_rate") or {}
    if not by_rate:
        return []
    names = list(next(iter(by_rate.values())))
    fp32_steps = (ttt["configs"].get("direct-fp32") or {}).get("steps", {}).get("steps")
    fp32_free = (by_rate.get("inf") or {}).get("direct-fp32")
    header = ["config", "steps / fp32's"]
    for rate in by_rate:
        header += [f"min at {rate}", f"8-bit/this at {rate}", f"this at {rate} / fp32 at inf"]
    rows = []
    for name in names:
        n = ttt["configs"][name]["steps"].get("steps")
        row = [name, _f(n / fp32_steps if n is not None and fp32_steps else None, ".2f", 0)]
        for minutes in by_rate.values():
            eight = minutes.get("direct-8bit")
            mine = minutes[name]
            row += [
                _f(mine, ".2f", 0),
                _f(eight / mine if eight and mine else None, ".2f", 0),
                _f(mine / fp32_free if mine and fp32_free else None, ".2f", 0),
            ]
        rows.append(row)
    return ["", "time to target at every rate of the sweep (the same steps, each rate's s/step):"] + _table(
        header, rows
    )


def _relative(row: dict, reference: dict | None) -> float | None:
    """How many times faster to the target than `reference` (direct-8bit), in the same run."""
    if not reference or not reference.get("minutes") or not row.get("minutes"):
        return None
    return reference["minutes"] / row["minutes"]


def describe_steps(steps: dict) -> str:
    if steps.get("steps") is None:
        return steps.get("note") or "not reached"
    return ("<=" if steps.get("bound") else "") + f"{steps['steps']:.1f}"


def report_lines(report: dict) -> list[str]:
    blocks = [
        throughput_lines(report),
        ratio_lines(report),
        bytes_lines(report),
        link_use_lines(report),
        ttt_lines(report.get("ttt")),
    ]
    lines: list[str] = []
    for block in blocks:
        if block:
            lines += ["", *block]
    return lines


# time to target -------------------------------------------------------------------------------------
def steps_to_target(history: list[tuple[int, float]], target: float) -> dict:
    """The first crossing of `target` in (step, val loss) evaluations: interpolated linearly between the
    last evaluation above it and the first at or below it; `bound` when the first evaluation is already
    at or below (the crossing is at most that step)."""
    previous = None
    for step, loss in history:
        if loss <= target:
            if previous is None:
                return {"steps": float(step), "bound": True}
            s0, l0 = previous
            return {"steps": s0 + (l0 - target) / (l0 - loss) * (step - s0), "bound": False}
        previous = (step, loss)
    last = history[-1][0] if history else 0
    return {"steps": None, "bound": False, "note": f"not reached in {last} steps"}


def local_history(cfg, stop_step: int, every: int, target: float | None = None) -> list[tuple[int, float]]:
    """train-local's validation loss at step 0, then every `every` steps up to `stop_step` (and at it),
    or until at or below `target`."""
    from swarmtrain.data import iterate_batches
    from swarmtrain.runtime.local import LocalTrainer

    trainer = LocalTrainer(cfg, progress=False)
    t = cfg.training
    batches = iterate_batches(trainer.train_set, t.micro_batch_size, seed=t.seed)
    history = [(0, trainer.val_loss())]
    start = time.monotonic()
    for step in range(1, stop_step + 1):
        trainer.step(batches)
        if step % every and step != stop_step:
            continue
        history.append((step, trainer.val_loss()))
        print(
            f"      train-local: step {step}/{stop_step}, val {history[-1][1]:.4f}, "
            f"{time.monotonic() - start:.0f}s",
            flush=True,
        )
        if target is not None and history[-1][1] <= target:
            break
    return history


def _wait_for_announce(cfg) -> None:
    """Servers announce their step periodically: a new trainer must see the step just closed."""
    time.sleep(2.5 * cfg.swarm.announce_period_s)


def _trainer_chunk(
    swarm: LocalSwarm, codec: str, steps: int, setup: Setup, expected_step: int, name: str
) -> dict:
    """One trainer invocation: `steps` steps, then the validation loss through the swarm (`name`: the
    configuration's, for progress lines)."""
    swarm.start_trainer(
        "trainer",
        *("--max-samples", str(steps * setup.global_batch), "--eval-samples", str(setup.eval_samples)),
        *("--compression", codec, "--log-period-s", "10"),
    )
    procs = swarm.processes
    servers = {n: p for n, p in procs.items() if n.startswith("stage")}
    timeout = steps * 60.0 + setup.run_timeout_s
    label, log = f"time to target, {name}", procs["trainer"].log_text
    wait_workers({"trainer": procs["trainer"]}, servers, timeout, label, lambda: trainer_progress(log()))
    procs["trainer"].kill()  # exited: closes its log
    summary = json.loads(swarm.summary_path("trainer").read_text())
    if summary["start_step"] != expected_step:
        raise RunFailed(f"the trainer started at step {summary['start_step']}, expected {expected_step}")
    if summary.get("val_loss") is None:
        raise RunFailed(f"the trainer evaluated nothing after step {expected_step + summary['steps']}")
    return summary


def swarm_history(
    config: BenchConfig, setup: Setup, cfg, first: int, every: int, max_steps: int, target: float, workdir
):
    """(step, val loss) of a loopback swarm of `config` (its codec and boundary layers), evaluated at
    `first`, then every `every` steps until at or below `target` or `max_steps`."""
    servers = [f"stage{s}" for s in range(setup.num_stages)]
    history: list[tuple[int, float]] = []
    start = time.monotonic()
    codec = config.codec or "none"
    with LocalSwarm(workdir, config.run_file(setup, workdir)) as swarm:
        swarm.start_dht()
        for stage, name in enumerate(servers):
            swarm.start_server(name, stage, "--threads", "1")
        swarm.wait_ready(servers, timeout_s=SERVER_READY_TIMEOUT_S)
        step = 0
        while step < max_steps and not (history and history[-1][1] <= target):
            chunk = min(first if step == 0 else every, max_steps - step)
            summary = _trainer_chunk(swarm, codec, chunk, setup, step, config.math)
            step += summary["steps"]
            history.append((step, summary["val_loss"]))
            print(
                f"      {config.math}: step {step}, val {summary['val_loss']:.4f} (target {target:.4f}), "
                f"{time.monotonic() - start:.0f}s",
                flush=True,
            )
            _wait_for_announce(cfg)
    return history


def parameter_count(cfg) -> int:
    """Trained parameters of the run's whole model (boundary layers, subspace coordinates at its cuts; a
    subspace's fixed token table and basis are no parameters)."""
    from swarmtrain.model.hf_checkpoint import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(cfg.model, cfg.boundary_cuts()).values())


def matched_plain(cfg):
    """The plain model (no boundary) with the parameter count of `cfg`'s model, by the MLP's width alone
    (d_ff, nearest, at least 1; every other field as it is): what a boundary is compared with at equal
    parameters. Where the embedding dominates (`llama-tiny`: 131k of 447k) no d_ff reaches a subspace
    model's count; the report prints both counts."""
    plain = dataclasses.replace(cfg.model, boundary="none", boundary_dim=0, boundary_table="")

    def count(d_ff: int) -> int:
        return parameter_count(cfg.replace(model=dataclasses.replace(plain, d_ff=d_ff)))

    per_unit = count(plain.d_ff + 1) - count(plain.d_ff)
    d_ff = max(1, round(plain.d_ff + (parameter_count(cfg) - count(plain.d_ff)) / per_unit))
    return cfg.replace(model=dataclasses.replace(plain, d_ff=d_ff))


def boundary_run(config: BenchConfig, setup: Setup, cfg):
    """`cfg` with `config`'s boundary, as its run file has it."""
    kind, divisor = config.boundary or ("none", 1)
    dim = setup.d_model // divisor if kind != "none" else 0
    return cfg.replace(model=dataclasses.replace(cfg.model, boundary=kind, boundary_dim=dim))


def matched_reference(config: BenchConfig, setup: Setup, cfg, args, stop_step: int) -> dict:
    """The plain model of `config`'s parameter count, trained by train-local to the target step: its
    validation loss there is the target `config` is also scored against (--ttt-matched)."""
    boundary = boundary_run(config, setup, cfg)
    matched = matched_plain(boundary)
    print(f"time to target: train-local of {config.name}'s parameter count (d_ff {matched.model.d_ff}) ...")
    history = local_history(matched, stop_step, args.ttt_eval_every)
    return {
        "parameters": parameter_count(boundary),
        "plain_parameters": parameter_count(cfg),
        "matched_parameters": parameter_count(matched),
        "matched_d_ff": matched.model.d_ff,
        "target": history[-1][1],
        "history": history,
    }


def time_to_target(args, setup: Setup, cfg, configs: list[BenchConfig], report: dict, root: Path) -> dict:
    t = cfg.training
    max_steps = t.max_samples // t.global_batch_size
    target_step = max(1, round(TTT_TARGET_FRACTION * max_steps))
    given = args.target_loss
    stop_step = max_steps if given is not None else target_step  # a given target: until reached
    print(f"time to target: train-local to step {stop_step} of {max_steps} ...", flush=True)
    local = local_history(cfg, stop_step, args.ttt_eval_every, given)
    target = given if given is not None else local[-1][1]
    source = "--target-loss" if given is not None else f"train-local at step {target_step}"
    steps = {"local": steps_to_target(local, target)}
    histories = {"local": local}
    reference = steps["local"]["steps"] or target_step
    first = max(1, int(TTT_SWARM_FROM * reference))
    matched = {
        c.name: matched_reference(c, setup, cfg, args, stop_step)
        for c in configs
        if args.ttt_matched and c.boundary
    }
    for config in configs:
        if config.math in steps:
            continue
        print(
            f"time to target: swarm, {config.math} (loopback), evaluations from step {first} ...", flush=True
        )
        # with a matched reference, on until both targets are crossed
        until = min(
            [target]
            + [matched[c.name]["target"] for c in configs if c.math == config.math and c.name in matched]
        )
        histories[config.math] = swarm_history(
            config,
            setup,
            cfg,
            first,
            args.ttt_eval_every,
            max_steps,
            until,
            root / f"ttt-{config.math}",
        )
        steps[config.math] = steps_to_target(histories[config.math], target)
    for config in configs:
        if config.name in matched:
            matched[config.name]["steps"] = steps_to_target(
                histories[config.math], matched[config.name]["target"]
            )
    summary = ttt_summary(target, source, args.ttt_rate, steps, histories, configs, report)
    return dict(summary, matched=matched) if matched else summary


def ttt_summary(target, source, rate, steps, histories, configs, report) -> dict:
    point = next((p for p in report["points"] if p["mbit_s"] == rate), None)
    rows = {}
    for config in configs:
        sps = _samples_per_s(point["runs"], config.name) if point else None
        s_per_step = report["global_batch"] / sps if sps else None
        n = steps[config.math].get("steps")
        rows[config.name] = {
            "steps": steps[config.math],
            "s_per_step": s_per_step,
            "minutes": n * s_per_step / 60 if n is not None and s_per_step else None,
        }
    note = (
        "GPipe's steps are train-local's (same math); the swarm's measured once per codec on loopback, "
        "relay and direct computing the same thing"
        + ("" if point else f"; no s/step: {fmt_bw(rate)} Mbit/s not in --rates")
    )
    return {
        "target_loss": target,
        "target_source": source,
        "rate_mbit_s": rate,
        "steps": steps,
        "histories": histories,
        "configs": rows,
        "minutes_by_rate": minutes_by_rate(steps, configs, report),
        "note": note,
    }


def minutes_by_rate(steps: dict, configs, report: dict) -> dict[str, dict[str, float | None]]:
    """Minutes to the target of every configuration at every rate of the sweep (rate as `fmt_bw` writes
    it -> configuration -> minutes; None where it missed the target or its run failed): the same steps
    to target, each rate's own seconds per step."""
    table: dict[str, dict[str, float | None]] = {}
    for point in report["points"]:
        row: dict[str, float | None] = {}
        for config in configs:
            sps = _samples_per_s(point["runs"], config.name)
            n = steps[config.math].get("steps")
            row[config.name] = n * report["global_batch"] / sps / 60 if n is not None and sps else None
        table[fmt_bw(point["mbit_s"])] = row
    return table


# main -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", help="named preset (default small)")
    parser.add_argument("--config", metavar="FILE", help="TOML run file instead of a preset")
    parser.add_argument(
        "--rates",
        type=parse_bandwidths,
        default=parse_bandwidths(DEFAULT_RATES),
        help=f"Mbit/s per peer, up and down, comma-separated; `inf`: no limit (default {DEFAULT_RATES})",
    )
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=parse_configs(DEFAULT_CONFIGS),
        help=f"comma-separated, from {', '.join(config_names())} (default: {DEFAULT_CONFIGS})",
    )
    parser.add_argument(
        "--duration-s", type=float, default=DEFAULT_DURATION_S, help="training time per run (default 40)"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        help="the swarm trainer's micro-batches in flight (default: the trainer's own default)",
    )
    parser.add_argument(
        "--run-timeout-s", type=float, default=600.0, help="give up on a run this long after --duration-s"
    )
    parser.add_argument("--time-to-target", action="store_true", help="also score time to a target loss")
    parser.add_argument("--target-loss", type=float, help="default: train-local's at 60%% of max_samples")
    parser.add_argument(
        "--ttt-eval-every",
        type=int,
        default=4,
        help="steps between evaluations for time to target (default 4)",
    )
    parser.add_argument(
        "--ttt-rate", type=float, default=TTT_RATE_MBIT_S, help="rate of the time per step (default 10)"
    )
    parser.add_argument(
        "--ttt-matched",
        action="store_true",
        help="time to target: also score each boundary configuration against the plain model of its "
        "parameter count (d_ff matched; train-local to the target step gives that model's target)",
    )
    parser.add_argument("--summary-json", metavar="PATH", help="every run's figures, both directions' bytes")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep the runs' logs and summaries in DIR")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.ttt_eval_every < 1:
        parser.error("--duration-s must be > 0 and --ttt-eval-every >= 1")
    if args.preset and args.config:
        parser.error("--preset or --config, not both (every process reads the same run file)")
    return args


def load_setup(args: argparse.Namespace, root: Path) -> tuple[Setup, object]:
    if args.config:
        config_path = Path(args.config).resolve()
        cfg = load_run_config(config_path)
    else:
        config_path = write_run_toml(root / "run.toml", args.preset or "small")
        cfg = get_preset(args.preset or "small")
    t = cfg.training
    setup = Setup(
        config_path=config_path,
        num_stages=cfg.swarm.num_stages,
        global_batch=t.global_batch_size,
        duration_s=args.duration_s,
        run_timeout_s=args.run_timeout_s,
        eval_samples=t.eval_samples,
        d_model=cfg.model.d_model,
        in_flight=args.in_flight,
    )
    return setup, cfg


def new_report(args, setup: Setup, cfg) -> dict:
    roles = ["trainer", *(f"stage{s}" for s in range(setup.num_stages)), "dht"]
    return {
        "preset": cfg.preset,
        "config_path": str(setup.config_path),
        "global_batch": setup.global_batch,
        "micro_batch": cfg.training.micro_batch_size,
        "duration_s": setup.duration_s,
        "configs": [c.name for c in args.configs],
        "roles": roles,
        "rates_mbit_s": [None if math.isinf(r) else r for r in args.rates],
        "machine": machine_info(),
        "points": [],
    }


def sweep(args, setup: Setup, report: dict, root: Path, save) -> None:
    total = len(args.rates) * len(args.configs)
    n = 0
    for mbit_s in args.rates:
        point = {"rate": fmt_bw(mbit_s), "mbit_s": mbit_s, "runs": {}}
        report["points"].append(point)
        for config in args.configs:
            n += 1
            print(f"[{n}/{total}] {config.name} @ {fmt_bw(mbit_s)} Mbit/s ...", flush=True)
            run = run_config(config, setup, mbit_s, root / f"{fmt_bw(mbit_s)}-{config.name}")
            point["runs"][config.name] = run
            point["ratios"] = ratios(point["runs"])
            print(f"      {describe_run(run)}", flush=True)
            save()


def describe_run(run: dict) -> str:
    if run.get("error"):
        return f"FAILED after {run['wall_s']:.0f}s: {run['error'][:2000]}"
    bps = run["bytes_per_sample"]
    sizes = ", ".join(f"{role} {v / 1e3:,.1f}" for role, v in bps.items() if v is not None)
    return f"done in {run['wall_s']:.0f}s: {run['samples_per_s']:.1f} samples/s; kB/sample {sizes}"


def _json_ready(report: dict) -> dict:
    """Infinite rates as null (JSON has no infinity)."""
    points = [dict(p, mbit_s=None if math.isinf(p["mbit_s"]) else p["mbit_s"]) for p in report["points"]]
    out = dict(report, points=points)
    if out.get("ttt"):
        out["ttt"] = dict(out["ttt"], rate_mbit_s=_finite(out["ttt"]["rate_mbit_s"]))
    return out


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = netbed.available()
    if not ok:
        print(f"skipped: {why}")
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with ExitStack() as stack:
            if args.keep_logs:
                root = Path(args.keep_logs)
                root.mkdir(parents=True, exist_ok=True)
            else:
                root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wan-bench-")))
            setup, cfg = load_setup(args, root)
            report = new_report(args, setup, cfg)
            return run_all(args, setup, cfg, report, root)
    except KeyboardInterrupt:  # before the first run (run_all reports the others)
        print("\ninterrupted", flush=True)
        return 130


def run_all(args, setup: Setup, cfg, report: dict, root: Path) -> int:
    def save() -> None:
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(_json_ready(report), indent=2, default=str) + "\n")

    print(
        f"preset {cfg.preset}: {setup.num_stages} stages, global batch {setup.global_batch}, "
        f"{args.duration_s:g} s per run; configurations {', '.join(report['configs'])}; rates "
        f"{', '.join(fmt_bw(r) for r in args.rates)} Mbit/s (tc tbf up and down per peer, no added latency)",
        flush=True,
    )
    interrupted = False
    try:
        sweep(args, setup, report, root, save)
        if args.time_to_target:
            report["ttt"] = time_to_target(args, setup, cfg, args.configs, report, root)
    except KeyboardInterrupt:
        interrupted = report["interrupted"] = True
        print("\ninterrupted: processes stopped, test bed removed", flush=True)
    except (RunFailed, SwarmStartError) as exc:
        report["ttt_error"] = str(exc)
        print(f"time to target FAILED: {exc}", flush=True)
    save()
    print("\n".join(report_lines(report)))
    if interrupted:
        return 130
    failed = any(run.get("error") for p in report["points"] for run in p["runs"].values())
    return 1 if failed or report.get("ttt_error") else 0


if __name__ == "__main__":
    sys.exit(main())
