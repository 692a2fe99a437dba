"""A stage served through the swarm vs the same stage computed locally on the same device, in fp32 and
bf16; request batching off vs on with several trainers; on CUDA, the layer swapper vs the resident model.

    python bench/device_stage.py [--device auto|cpu|cuda[:N]] [--dtypes fp32,bf16] [--trainers 1,4,8]
                                 [--duration-s 30] [--quick] [--summary-json PATH] [--keep-logs DIR]

Rows, all measured in this one invocation, one after the other (the bench runs nothing beside a
measurement but the processes it names; the machine itself may be shared, see the local rows):
- local stage S: stage S of --preset built with `swarmtrain.model.build_stage` in this process on the
  device, `--threads` torch threads (the servers' count; default what a server takes without it, 1 on
  CPU and min(4, cores) on CUDA), forward + backward of random micro-batches of the row's size
  (compute under the dtype's autocast, fp32 master weights, the optimizer step once per global batch:
  what a server computes), for --local-duration-s of wall time after 2 untimed ones;
  samples/s. For the served rows it runs right before and right after the swarm and the two are averaged
  (a warning is printed when they differ by more than 20%: the machine's load changed meanwhile);
- served: a DHT, one `swarmtrain server --stage S --threads T --device D --dtype X` per stage and one
  `swarmtrain trainer` with its defaults (4 in flight per stage, direct hand-off, the run's codec) on the preset's
  micro-batch, batching off. samples/s: samples of the micro-batches the trainers completed within a
  window of --duration-s (from their ledgers' `done` lines, wall clock) that opens --warmup-s after every
  trainer completed its first micro-batch; the trainers are then stopped. served / local: that over the
  slower local stage (the swarm cannot beat its bottleneck stage), so 1.0 would be serving for free;
- batching off / on: the same swarm at micro-batch --batch-micro-batch (fp32) with N trainer shards
  (`--shard k/N`, --in-flight micro-batches in flight each, default the trainer's) for each N of
  --trainers, servers with `--max-batch-tokens 0` then `--max-batch-tokens M` (M: --max-batch-tokens, or
  by default max(4, N) micro-batches' tokens), each from scratch with the same run file, threads and
  window. on / off is the ratio of the two windows' samples/s (issue 24: >= 1.3 with 4+ trainers of
  micro-batch 2 on CPU, printed as met or not). The global batch is the preset's, rounded up so that
  every N trainers' shards split it into whole micro-batches. Beside them: the local stages at that
  micro-batch and in one call of the most micro-batches a batched call takes (how much faster the
  model alone is in batched calls on this device), each row over the shared bound, and the samples
  that batched graphs back-propagated with zero gradient (a member whose backward came back without
  the others';
- swapper vs resident (CUDA only): ms per micro-batch of forward + backward of the whole model (fp32),
  resident on the device vs `swarmtrain.offload.whole_model.SwappedGPT` with a budget of
  --swap-budget-fraction of the resident step's peak device memory. On CPU it is skipped: the swapper
  streams layers from host memory to an accelerator, and on CPU the host memory is the device.

Every swarm row also reports the cores each role used in its window (CPU seconds of every process in
the role's process groups, p2pd daemons included, / window seconds), the micro-batches that failed, and
from the servers' last metrics log line (totals since their start) the requests that shared a call, the
hand-offs that went to the next stage as one bundle of several micro-batches, and the backwards that
recomputed their forward (no graph kept: evicted, or another replica ran the forward; a batched
forward's graph serves its members' backwards whenever they come back).
The trainers are not given cores of their own: on a small machine (2 cores here) they compete with the
servers, each trainer being a Python process and a p2pd daemon (~70 MB, some CPU for its RPCs), so with
many trainers the servers get less than their threads and a lower on/off ratio can be the trainers' CPU
rather than the batching's. That is why --trainers is configurable (8 trainers is 16 processes beside 2
servers on 2 cores). --quick: fp32 and 4 trainers only (unless --dtypes/--trainers say otherwise), a
10 s window after 3 s: a smoke run of every code path in about 2-3 minutes on 2 cores, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmtrain.config import RunConfig, StageSpec, get_preset, load_run_config
from swarmtrain.model import build_model, build_stage
from swarmtrain.model.device import ComputeDevice, DeviceError, resolve_device, server_threads
from swarmtrain.model.optim import build_optimizer
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, SwarmStartError, write_run_toml
from swarmtrain.runtime.ledger import read_ledger
from swarmtrain.runtime.procs import group_members

ROWS = ("served", "batching", "swap")
SERVER_DTYPES = ("fp32", "bf16")  # servers refuse fp16 (its loss scaler is for whole-model commands)
DEFAULT_TRAINERS = "1,4,8"
QUICK_TRAINERS = "4"
DEFAULT_DURATION_S, QUICK_DURATION_S = 30.0, 10.0
DEFAULT_WARMUP_S, QUICK_WARMUP_S = 5.0, 3.0
DEFAULT_LOCAL_DURATION_S, QUICK_LOCAL_DURATION_S = 5.0, 2.0
LOCAL_WARMUP_MICRO_BATCHES = 2
MIN_BATCH_MICRO_BATCHES = 4  # the default --max-batch-tokens: this many micro-batches, or N for N trainers
SERVER_READY_TIMEOUT_S = 180.0
TRAINERS_RUNNING_TIMEOUT_S = 180.0  # until every trainer completed a micro-batch (8 start-ups on 2 cores)
TRAINER_SELF_STOP_MARGIN_S = 600.0  # the bench stops the trainers; --duration-s is only a backstop
ANNOUNCE_PERIOD_S = 1.0  # peers find each other sooner than with the default 2 s
POLL_S = 0.5
SWAP_STEPS = 10
METRICS_PREFIX = "metrics "  # a server's metrics log line (runtime/server/server_metrics.py)
# issue 24: on CPU, batching with 4+ trainers of micro-batch 2 gives >= 1.3x the samples/s of batching off
CRITERION_RATIO, CRITERION_MIN_TRAINERS, CRITERION_MICRO_BATCH = 1.3, 4, 2
LOCAL_SPREAD_WARNING = 0.2  # local before/after differing more than this: the machine was busy
# what the servers' last metrics lines are summed for (runtime/server/server_metrics.py)
SERVER_COUNTS = (
    "backward",
    "recomputed",
    "batched_requests",
    "bundles_sent",
    "samples_forward",
    "padded_samples",
)
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class RunFailed(RuntimeError):
    pass


# pure helpers --------------------------------------------------------------------------------------
def parse_counts(text: str, minimum: int = 1) -> list[int]:
    """Counts from "1,4,8": at least `minimum`, sorted, each once."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum} like 1,4,8, got {text!r}")
    return counts


def parse_in_flight(text: str) -> list[int]:
    """'0,16' -> [0, 16]: 0 is the trainer's own default."""
    return parse_counts(text, minimum=0)


def parse_rows(text: str) -> list[str]:
    rows = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [row for row in rows if row not in ROWS]
    if not rows or unknown:
        raise argparse.ArgumentTypeError(f"rows are some of {','.join(ROWS)}, got {text!r}")
    return rows


def parse_dtypes(text: str) -> list[str]:
    """Dtypes from "bf16,fp32", in SERVER_DTYPES order."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    unknown = names - set(SERVER_DTYPES)
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(SERVER_DTYPES)} (servers refuse fp16), got {text!r}"
        )
    return [d for d in SERVER_DTYPES if d in names]


def batching_global_batch(global_batch: int, micro_batch: int, trainer_counts: Iterable[int]) -> int:
    """The smallest multiple of every N trainers' micro_batch * N that is >= `global_batch`: each
    trainer shard then gives every step whole micro-batches, with the same run file for every N."""
    unit = math.lcm(*(micro_batch * n for n in trainer_counts))
    return -(-global_batch // unit) * unit


def batch_micro_batches(trainers: int) -> int:
    """Micro-batches per batched call by default: one per trainer (their micro-batches of a step reach
    a stage at about the same time), at least MIN_BATCH_MICRO_BATCHES."""
    return max(MIN_BATCH_MICRO_BATCHES, trainers)


def max_batch_tokens(micro_batch: int, seq_len: int, micro_batches: int) -> int:
    return micro_batch * seq_len * micro_batches


def trainers_running(ledgers: Iterable[list[dict]]) -> bool:
    """Every trainer completed a micro-batch: all of them are past start-up and training."""
    return all(any(e.get("e") == "done" for e in events) for events in ledgers)


def window_samples(ledgers: Iterable[list[dict]], t0_s: float, t1_s: float) -> int:
    """Samples of the micro-batches completed in (t0_s, t1_s] (ledger `done` lines, wall clock)."""
    return sum(
        int(e["n"]) for events in ledgers for e in events if e.get("e") == "done" and t0_s < e["t"] <= t1_s
    )


def summary_totals(summaries: Iterable[dict | None]) -> dict:
    """Failed micro-batches, retries and timeouts of all trainers (a trainer without a summary, e.g.
    killed at the end, counts in `missing`)."""
    totals = {"failed": 0, "retries": 0, "timeouts": 0, "missing": 0}
    for summary in summaries:
        if summary is None:
            totals["missing"] += 1
            continue
        totals["failed"] += int(summary.get("microbatches_failed", 0))
        totals["retries"] += int(summary.get("retries", 0))
        totals["timeouts"] += int(summary.get("timeouts", 0))
    return totals


def last_metrics(log_text: str) -> dict | None:
    """The last `metrics {json}` line of a server's log as a dict (runtime/server/server_metrics.py;
    read as plain JSON so that a field added or renamed there breaks nothing here)."""
    for line in reversed(log_text.splitlines()):
        start = line.find(METRICS_PREFIX + "{")
        if start < 0:
            continue
        try:
            return json.loads(line[start + len(METRICS_PREFIX) :])
        except ValueError:
            continue  # a line cut off by the stop
    return None


def server_counts(metrics: Iterable[dict | None]) -> dict:
    """Backwards, recomputed backwards, requests that shared a call, bundled hand-offs, forward samples
    and the zero-gradient samples of batched graphs' backwards, summed over the servers (each since its
    start, at its last metrics line); None where no server reports it."""
    present = [m for m in metrics if m is not None]
    totals: dict = {}
    for key in SERVER_COUNTS:
        values = [m[key] for m in present if key in m]
        totals[key] = sum(values) if values else None
    return totals


def local_spread(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The largest |after - before| / mean of a local stage: how much the machine changed around a run."""
    spreads = [
        abs(after[s] - before[s]) / ((after[s] + before[s]) / 2)
        for s in before
        if s in after and after[s] + before[s] > 0
    ]
    return max(spreads) if spreads else None


def role_of(name: str) -> str:
    """The role of a peer of a bench swarm by its name: trainerK, stageS, dht."""
    for role in ("trainer", "stage", "dht"):
        if name.startswith(role):
            return {"stage": "servers", "trainer": "trainers"}.get(role, role)
    return "other"


def cores_used(before_s: dict[str, float], after_s: dict[str, float], window_s: float) -> dict[str, float]:
    """CPU seconds per role between two readings (peer name -> CPU s) / the window's seconds."""
    cores: dict[str, float] = {}
    for name, after in after_s.items():
        role = role_of(name)
        cores[role] = cores.get(role, 0.0) + (after - before_s.get(name, 0.0)) / window_s
    return cores


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def mean_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def bottleneck_stage(local_by_stage: dict[str, float]) -> tuple[str | None, float | None]:
    """The slowest local stage (samples/s): what a swarm of one server per stage is bounded by."""
    if not local_by_stage:
        return None, None
    stage = min(local_by_stage, key=local_by_stage.__getitem__)
    return stage, local_by_stage[stage]


def served_entry(dtype: str, in_flight: int, local_before: dict, local_after: dict, run: dict) -> dict:
    """One served row: the local stages (mean of before/after), the swarm run with `in_flight`
    micro-batches in flight (0: the trainer's default), served / bottleneck."""
    stages = sorted(set(local_before) | set(local_after))
    local = {s: mean_or_none([local_before.get(s), local_after.get(s)]) for s in stages}
    stage, local_sps = bottleneck_stage({s: v for s, v in local.items() if v is not None})
    return {
        "dtype": dtype,
        "in_flight": in_flight or None,
        "local_samples_per_s": local,
        "local_before": local_before,
        "local_after": local_after,
        "bottleneck_stage": stage,
        "local_spread": local_spread(local_before, local_after),
        "run": run,
        "served_over_local": ratio(run.get("samples_per_s"), local_sps),
        "shared_bound": shared_bound(local),
        "served_over_shared_bound": ratio(run.get("samples_per_s"), shared_bound(local)),
        "recomputed_share": ratio(
            (run.get("servers") or {}).get("recomputed"), (run.get("servers") or {}).get("backward")
        ),
    }


def shared_bound(local_by_stage: dict[str, float | None]) -> float | None:
    """What servers that share one device can serve together, samples/s: each sample takes every
    stage's local time on it in turn, so 1 / sum(1 / local samples/s of each stage). The slowest stage
    alone bounds a swarm whose servers each have a device of their own."""
    rates = list(local_by_stage.values())
    if not rates or any(r is None or r <= 0 for r in rates):
        return None
    return 1.0 / sum(1.0 / r for r in rates if r is not None)


def batching_entry(trainers: int, tokens: int, off: dict, on: dict) -> dict:
    return {
        "trainers": trainers,
        "max_batch_tokens": tokens,
        "off": off,
        "on": on,
        "on_over_off": ratio(on.get("samples_per_s"), off.get("samples_per_s")),
    }


def batching_verdict(report: dict) -> str | None:
    """Issue 24's criterion on the rows that test it: batching on / off >= CRITERION_RATIO with
    CRITERION_MIN_TRAINERS+ trainers of micro-batch CRITERION_MICRO_BATCH (None: no such row)."""
    setup = report["setup"]
    if setup["batch_micro_batch"] != CRITERION_MICRO_BATCH:
        return None
    rows = [e for e in report["batching"] if e["trainers"] >= CRITERION_MIN_TRAINERS]
    if not rows:
        return None
    ratios = [e["on_over_off"] for e in rows]
    met = all(r is not None and r >= CRITERION_RATIO for r in ratios)
    shown = ", ".join(f"{e['trainers']}: {_num(e['on_over_off'], '.2f', 1)}" for e in rows)
    where = (
        "" if setup["device"] == "cpu" else f" (the criterion is stated for CPU; device {setup['device']})"
    )
    return (
        f"on/off >= {CRITERION_RATIO} with {CRITERION_MIN_TRAINERS}+ trainers of micro-batch "
        f"{CRITERION_MICRO_BATCH}: {'met' if met else 'NOT met'} ({shown}){where}"
    )


def _num(value: float | None, spec: str, width: int) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def _cores(run: dict) -> str:
    cores = run.get("cores") or {}
    return f"{_num(cores.get('servers'), '.2f', 4)}/{_num(cores.get('trainers'), '.2f', 4)}"


def _sps(run: dict) -> str:
    return "FAILED".rjust(9) if run.get("error") else _num(run.get("samples_per_s"), ".1f", 9)


def _count(run: dict, key: str) -> str:
    value = (run.get("servers") or {}).get(key)
    return "-" if value is None else str(value)


def _failed(run: dict) -> str:
    totals = run.get("totals") or {}
    return _num(totals.get("failed"), "d", 3) if "failed" in totals else "  -"


def served_lines(report: dict) -> list[str]:
    s = report["setup"]
    lines = [
        f"served vs local (micro-batch {s['micro_batch']}, 1 trainer, batching off; samples/s)",
        f"  {'dtype':5s} {'local stage' + ' / stage'.join(str(i) for i in range(s['num_stages'])):>26s} "
        f"{'in flight':>9s} {'served':>9s} {'served/local':>12s} {'shared bound':>12s} {'served/bound':>12s} "
        f"{'recomp':>6s} {'cores srv/trn':>13s} {'fail':>4s}",
    ]
    for entry in report["served"]:
        local = entry["local_samples_per_s"]
        locals_text = " / ".join(_num(local.get(str(i)), ".1f", 7) for i in range(s["num_stages"]))
        run = entry["run"]
        lines.append(
            f"  {entry['dtype']:5s} {locals_text:>26s} {entry.get('in_flight') or 'default':>9} {_sps(run)} "
            f"{_num(entry['served_over_local'], '.3f', 12)} {_num(entry.get('shared_bound'), '.1f', 12)} "
            f"{_num(entry.get('served_over_shared_bound'), '.3f', 12)} "
            f"{_num(entry.get('recomputed_share'), '.0%', 6)} {_cores(run):>13s} {_failed(run):>4s}"
        )
    lines.append(
        "  served/local: over the slowest local stage (servers with a device each); shared bound: "
        "1 / sum(1 / local) (servers sharing one device, as here); recomp: backwards that recomputed"
    )
    for entry in report["served"]:
        if (entry.get("local_spread") or 0.0) > LOCAL_SPREAD_WARNING:
            lines.append(
                f"  ! {entry['dtype']}: local before and after the swarm differ by up to "
                f"{entry['local_spread']:.0%}: the machine's load changed (their mean is used)"
            )
    lines.extend(_errors(e["run"] for e in report["served"]))
    return lines


def padded_share(run: dict) -> float | None:
    """Zero-gradient samples of batched graphs' backwards per forward sample, over the servers: 0 when
    every group's members came back together, up to (members - 1) when each came back alone."""
    servers = run.get("servers") or {}
    return ratio(servers.get("padded_samples"), servers.get("samples_forward"))


def batching_lines(report: dict) -> list[str]:
    s = report["setup"]
    local = report.get("local_batch_micro_batch") or {}
    local_text = " / ".join(_num(local.get(str(i)), ".1f", 1) for i in range(s["num_stages"]))
    bound = shared_bound(local)
    per_call, batched = report.get("batched_call_micro_batches"), report.get("local_batched_call") or {}
    batched_text = " / ".join(_num(batched.get(str(i)), ".1f", 1) for i in range(s["num_stages"]))
    gain = ratio(shared_bound(batched), bound)
    lines = [
        f"request batching (fp32, micro-batch {s['batch_micro_batch']}, global batch "
        f"{s['batch_global_batch']}, in flight {s.get('batch_in_flight') or 'default'} per trainer; "
        "samples/s)",
        f"  local stage {' / '.join(str(i) for i in range(s['num_stages']))} at this micro-batch: "
        f"{local_text}; shared bound {_num(bound, '.1f', 1)}",
        f"  local in one call of {per_call or '-'} micro-batches: {batched_text}; shared bound "
        f"{_num(shared_bound(batched), '.1f', 1)}: the model alone {_num(gain, '.2f', 1)}x as fast (what "
        "batching saves besides per-request work)",
        f"  {'trainers':>8s} {'max tokens':>10s} {'off':>9s} {'on':>9s} {'on/off':>7s} "
        f"{'off/bound':>9s} {'on/bound':>8s} {'cores off srv/trn':>17s} {'cores on srv/trn':>16s} "
        f"{'fail off/on':>11s} {'shared on':>9s} {'bundles on':>10s} {'padded on':>9s} {'recomp off/on':>13s}",
    ]
    for entry in report["batching"]:
        off, on = entry["off"], entry["on"]
        lines.append(
            f"  {entry['trainers']:8d} {entry['max_batch_tokens']:10d} {_sps(off)} {_sps(on)} "
            f"{_num(entry['on_over_off'], '.2f', 7)} {_num(ratio(off.get('samples_per_s'), bound), '.2f', 9)} "
            f"{_num(ratio(on.get('samples_per_s'), bound), '.2f', 8)} {_cores(off):>17s} {_cores(on):>16s} "
            f"{_failed(off) + '/' + _failed(on).strip():>11s} {_count(on, 'batched_requests'):>9s} "
            f"{_count(on, 'bundles_sent'):>10s} {_num(padded_share(on), '.2f', 9)} "
            f"{_count(off, 'recomputed') + '/' + _count(on, 'recomputed'):>13s}"
        )
    lines += [
        "  shared: requests that ran in one call with others; recomp: backwards that recomputed their",
        "  forward (no graph kept); bundles: hand-offs to the next stage that carried several",
        "  micro-batches in one message; these summed over the servers since their start;",
        "  padded: samples a batched forward's graph back-propagated with zero gradient (a member's",
        "  backward that came without the others costs the whole group's), per forward sample;",
        "  bound: the shared bound at this micro-batch, 1 / sum(1 / local) (servers sharing one device)",
    ]
    verdict = batching_verdict(report)
    if verdict is not None:
        lines.append(f"  {verdict}")
    lines.extend(_errors(run for e in report["batching"] for run in (e["off"], e["on"])))
    return lines


def swap_lines(report: dict) -> list[str]:
    swap = report.get("swap") or {}
    if swap.get("skipped"):
        return [f"swapper vs resident: skipped ({swap['skipped']})"]
    if swap.get("error"):
        return [f"swapper vs resident: FAILED: {swap['error']}"]
    if not swap:
        return ["swapper vs resident: not run"]
    peak = swap.get("resident_peak_bytes")
    of_peak = f" of a {peak / 2**20:.1f} MiB resident peak" if peak else ""
    return [
        f"swapper vs resident (fp32, micro-batch {swap['micro_batch']}, budget "
        f"{swap['budget_bytes'] / 2**20:.1f} MiB{of_peak})",
        f"  ms per micro-batch: resident {swap['resident_ms']:.2f}, swapped {swap['swapped_ms']:.2f}, "
        f"swapped / resident {swap['swapped_over_resident']:.2f}",
        f"  {swap.get('groups', '?')} group(s), the last one's forward graph "
        f"{'kept (not recomputed)' if swap.get('last_graph_kept') else 'recomputed'}",
    ]


def _errors(runs: Iterable[dict]) -> list[str]:
    return [f"  ! {run['label']}: {run['error'][:1500]}" for run in runs if run.get("error")]


def report_lines(report: dict) -> list[str]:
    s = report["setup"]
    lines = [
        f"device {s['device']}, preset {s['preset']}: {s['num_stages']} stages, seq {s['seq_len']}; "
        f"{s['threads']} torch thread(s) per server and for the local rows; window {s['duration_s']:g} s "
        f"after {s['warmup_s']:g} s{' (quick: a smoke run)' if s.get('quick') else ''}",
    ]
    if report.get("served"):
        lines += ["", *served_lines(report)]
    if report.get("batching"):
        lines += ["", *batching_lines(report)]
    lines += ["", *swap_lines(report)]
    if report.get("interrupted"):
        lines += ["", "interrupted: the rows above are what ran"]
    return lines


# local measurements --------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: the clock must wait for them
        torch.cuda.synchronize(device)


def _fake_micro_batch(cfg: RunConfig, spec: StageSpec, micro_batch: int, device: torch.device):
    """(inputs, labels, grad of the outputs) of the shapes a server of `spec` receives."""
    m, gen = cfg.model, torch.Generator().manual_seed(0)
    if spec.is_first:
        inputs = torch.randint(0, m.vocab_size, (micro_batch, m.seq_len), generator=gen)
    else:
        inputs = torch.randn(micro_batch, m.seq_len, m.d_model, generator=gen)
    labels = torch.randint(0, m.vocab_size, (micro_batch, m.seq_len), generator=gen)
    grad = None if spec.is_last else torch.randn(micro_batch, m.seq_len, m.d_model, generator=gen)
    return inputs.to(device), labels.to(device), None if grad is None else grad.to(device)


def measure_local_stage(
    cfg: RunConfig, spec: StageSpec, compute: ComputeDevice, micro_batch: int, duration_s: float
) -> float:
    """Samples/s of forward + backward of stage `spec` in this process (see the module docstring)."""
    module = build_stage(cfg.model, spec, seed=cfg.training.seed).to(compute.device).train()
    optimizer = build_optimizer(module, cfg.training)
    per_step = max(1, cfg.training.global_batch_size // micro_batch)
    inputs, labels, grad_outputs = _fake_micro_batch(cfg, spec, micro_batch, compute.device)

    def one(i: int) -> None:
        # non-first stages receive hidden states and owe the previous stage their gradient
        x = inputs if spec.is_first else inputs.detach().requires_grad_(True)
        with compute.autocast():  # the backward runs outside it, as on a server
            out = module(x, labels) if spec.is_last else module(x)
        if spec.is_last:
            (out * micro_batch).backward()  # a server back-propagates loss * samples
        else:
            out.backward(grad_outputs)
        if (i + 1) % per_step == 0:
            optimizer.step()
            optimizer.zero_grad()

    for i in range(LOCAL_WARMUP_MICRO_BATCHES):
        one(i)
    _synchronize(compute.device)
    start = time.perf_counter()
    done = 0
    while time.perf_counter() - start < duration_s:
        one(done)
        _synchronize(compute.device)
        done += 1
    return done * micro_batch / (time.perf_counter() - start)


def measure_local_stages(cfg: RunConfig, compute: ComputeDevice, micro_batch: int, duration_s: float) -> dict:
    """{stage index as text: samples/s} of every stage of the run."""
    return {
        str(spec.index): measure_local_stage(cfg, spec, compute, micro_batch, duration_s)
        for spec in cfg.stages()
    }


def _mean_step_ms(step: Callable[[], None], device: torch.device, steps: int) -> float:
    step()  # untimed: allocations, a swapper's first plan
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _synchronize(device)
    return 1e3 * (time.perf_counter() - start) / steps


def resident_peak_bytes(device: torch.device) -> float | None:
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def _resident_step_ms(
    cfg: RunConfig, device: torch.device, tokens: torch.Tensor, labels: torch.Tensor, steps: int
) -> tuple[float, float | None]:
    """(ms per micro-batch, peak device bytes) of the whole model resident on `device`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg.model, seed=cfg.training.seed).to(device)
    inputs, targets = tokens.to(device), labels.to(device)
    step_ms = _mean_step_ms(lambda: model(inputs, targets).backward(), device, steps)
    return step_ms, resident_peak_bytes(device)


def measure_swap(
    cfg: RunConfig,
    device: torch.device,
    micro_batch: int,
    steps: int = SWAP_STEPS,
    budget_fraction: float = 0.5,
    budget_bytes: float | None = None,
) -> dict:
    """ms per micro-batch (forward + backward, fp32) of the whole model resident on `device` vs through
    SwappedGPT with `budget_bytes` (default: `budget_fraction` of the resident step's peak memory)."""
    from swarmtrain.offload.whole_model import SwappedGPT  # being rewritten: only its stable surface

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len), generator=gen)
    labels = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.model.seq_len), generator=gen)
    resident_ms, peak = _resident_step_ms(cfg, device, tokens, labels, steps)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the resident model is gone: the swapper starts from an empty device
    if budget_bytes is None:
        if peak is None:
            raise ValueError("a budget is needed where the device reports no peak memory")
        budget_bytes = budget_fraction * peak
    swapped = SwappedGPT(build_model(cfg.model, seed=cfg.training.seed), budget_bytes, device)
    swapped_ms = _mean_step_ms(lambda: swapped.loss_and_backward(tokens, labels, 1.0), device, steps)
    return {
        "micro_batch": micro_batch,
        "steps": steps,
        "budget_bytes": budget_bytes,
        "resident_peak_bytes": peak,
        "resident_ms": resident_ms,
        "swapped_ms": swapped_ms,
        "swapped_over_resident": swapped_ms / resident_ms,
        "groups": swapped.plan.num_groups,
        "last_graph_kept": swapped.swapper.keep_last_graph,
    }


# swarm runs ----------------------------------------------------------------------------------------
def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a peer's process group (p2pd included)."""
    ticks = 0
    for pid in group_members(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS_PER_S


def _cpu_by_peer(swarm: LocalSwarm) -> dict[str, float]:
    return {name: group_cpu_s(proc.pid) for name, proc in swarm.processes.items()}


def _check_alive(swarm: LocalSwarm) -> None:
    for name, proc in swarm.processes.items():
        if not proc.alive:
            raise RunFailed(f"{name} exited with {proc.proc.poll()}:\n{proc.log_text()[-3000:]}")


def _wait_trainers_running(swarm: LocalSwarm, names: list[str]) -> None:
    deadline = time.monotonic() + TRAINERS_RUNNING_TIMEOUT_S
    while not trainers_running(read_ledger(swarm.ledger_path(n)) for n in names):
        _check_alive(swarm)
        if time.monotonic() > deadline:
            raise RunFailed(f"not every trainer completed a micro-batch in {TRAINERS_RUNNING_TIMEOUT_S:.0f}s")
        time.sleep(POLL_S)


def _sleep_alive(swarm: LocalSwarm, seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        _check_alive(swarm)
        time.sleep(min(POLL_S, left))


def _read_summary(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class SwarmRow:
    """One swarm configuration of this invocation: its run file and what its peers are started with."""

    config_path: Path
    num_stages: int
    server_args: tuple[str, ...]
    trainers: int
    trainer_args: tuple[str, ...] = ()


def run_swarm(row: SwarmRow, warmup_s: float, duration_s: float, workdir: Path) -> dict:
    """A DHT, a server per stage and `row.trainers` trainer shards; samples/s in a window (module
    docstring)."""
    servers = [f"stage{s}" for s in range(row.num_stages)]
    names = [f"trainer{k}" for k in range(row.trainers)]
    backstop_s = TRAINERS_RUNNING_TIMEOUT_S + warmup_s + duration_s + TRAINER_SELF_STOP_MARGIN_S
    with LocalSwarm(workdir, row.config_path) as swarm:
        swarm.start_dht()
        for stage, name in enumerate(servers):
            swarm.start_server(name, stage, *row.server_args)
        # the trainers start up meanwhile (they wait for a server of every stage): nothing is measured yet
        for k, name in enumerate(names):
            shard = ("--shard", f"{k}/{row.trainers}", "--duration-s", f"{backstop_s:g}")
            swarm.start_trainer(name, *shard, "--log-period-s", "5", *row.trainer_args)
        swarm.wait_ready(servers, timeout_s=SERVER_READY_TIMEOUT_S)
        _wait_trainers_running(swarm, names)
        _sleep_alive(swarm, warmup_s)
        cpu_before, t0_s = _cpu_by_peer(swarm), time.time()
        _sleep_alive(swarm, duration_s)
        cpu_after, t1_s = _cpu_by_peer(swarm), time.time()
    # stopped (trainers first: their in-flight micro-batches finish): ledgers and summaries are complete
    samples = window_samples((read_ledger(swarm.ledger_path(n)) for n in names), t0_s, t1_s)
    return {
        "samples": samples,
        "window_s": t1_s - t0_s,
        "samples_per_s": samples / (t1_s - t0_s),
        "cores": cores_used(cpu_before, cpu_after, t1_s - t0_s),
        "totals": summary_totals(_read_summary(swarm.summary_path(n)) for n in names),
        "servers": server_counts(last_metrics(swarm.processes[n].log_text()) for n in servers),
    }


def guarded_run(label: str, run: Callable[[], dict]) -> dict:
    """`run()` with its wall time, or the error that ended it (the other rows still run)."""
    print(f"  {label} ...", flush=True)
    start = time.monotonic()
    try:
        result = run()
    except (RunFailed, SwarmStartError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result.update(label=label, wall_s=time.monotonic() - start)
    if result.get("error"):
        print(f"    FAILED after {result['wall_s']:.0f}s: {result['error'][:1500]}", flush=True)
    else:
        print(f"    {result['samples_per_s']:.1f} samples/s ({result['wall_s']:.0f}s)", flush=True)
    return result


def server_args(args, dtype: str, batch_tokens: int) -> tuple[str, ...]:
    return (
        *("--threads", str(args.threads), "--device", args.device_name, "--dtype", dtype),
        *("--max-batch-tokens", str(batch_tokens)),
    )


def swarm_run(args, row: SwarmRow, workdir: Path) -> Callable[[], dict]:
    """One swarm row with this invocation's window, ready to run."""
    return functools.partial(run_swarm, row, args.warmup_s, args.duration_s, workdir)


def served_rows(args, cfg: RunConfig, config_path: Path, root: Path, report: dict, save) -> None:
    """Per dtype: the local stages, a swarm per --served-in-flight count, the local stages again."""
    mb = cfg.training.micro_batch_size
    for dtype in args.dtypes:
        compute = ComputeDevice(args.device, dtype)
        print(f"served vs local, {dtype}:", flush=True)
        before = measure_local_stages(cfg, compute, mb, args.local_duration_s)
        runs = {}
        for in_flight in args.served_in_flight:
            trainer_args = ("--in-flight", str(in_flight)) if in_flight else ()
            row = SwarmRow(config_path, cfg.swarm.num_stages, server_args(args, dtype, 0), 1, trainer_args)
            label = f"served {dtype}" + (f", {in_flight} in flight" if in_flight else "")
            runs[in_flight] = guarded_run(label, swarm_run(args, row, root / f"served-{dtype}-{in_flight}"))
        after = measure_local_stages(cfg, compute, mb, args.local_duration_s)
        for in_flight, run in runs.items():
            report["served"].append(served_entry(dtype, in_flight, before, after, run))
        save()


def batching_rows(args, cfg: RunConfig, config_path: Path, root: Path, report: dict, save) -> None:
    mb, seq = cfg.training.micro_batch_size, cfg.model.seq_len
    print("request batching:", flush=True)
    compute = ComputeDevice(args.device, "fp32")
    report["local_batch_micro_batch"] = measure_local_stages(cfg, compute, mb, args.local_duration_s)
    # one call of the most micro-batches a batched call takes here: what batching could gain at best
    per_call = max(  # one at least: a --max-batch-tokens under one micro-batch's batches nothing
        1,
        *(
            (args.max_batch_tokens or max_batch_tokens(mb, seq, batch_micro_batches(n))) // (mb * seq)
            for n in args.trainers
        ),
    )
    report["batched_call_micro_batches"] = per_call
    report["local_batched_call"] = measure_local_stages(cfg, compute, mb * per_call, args.local_duration_s)
    in_flight = ("--in-flight", str(args.in_flight)) if args.in_flight else ()
    for n in args.trainers:
        tokens = args.max_batch_tokens or max_batch_tokens(mb, seq, batch_micro_batches(n))
        runs = {}
        for mode, batch_tokens in (("off", 0), ("on", tokens)):
            servers = server_args(args, "fp32", batch_tokens)
            row = SwarmRow(config_path, cfg.swarm.num_stages, servers, n, in_flight)
            runs[mode] = guarded_run(
                f"{n} trainer(s), batching {mode}", swarm_run(args, row, root / f"batching-{n}-{mode}")
            )
        report["batching"].append(batching_entry(n, tokens, runs["off"], runs["on"]))
        save()


def swap_row(args, cfg: RunConfig) -> dict:
    if args.device.type != "cuda":
        return {
            "skipped": f"device {args.device}: the swapper streams layers from host memory to an "
            "accelerator; on CPU the host memory is the device"
        }
    print("swapper vs resident ...", flush=True)
    try:
        return measure_swap(
            cfg, args.device, cfg.training.micro_batch_size, budget_fraction=args.swap_budget_fraction
        )
    except Exception as exc:  # e.g. no plan fits the budget: reported, the other rows stand
        return {"error": f"{type(exc).__name__}: {exc} (try another --swap-budget-fraction)"}


# main ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", help="model and run preset (default tiny)")
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA when torch sees one), cpu, cuda or cuda:N (default auto)"
    )
    parser.add_argument(
        "--dtypes", type=parse_dtypes, help="compute dtypes (default fp32,bf16; --quick: fp32)"
    )
    parser.add_argument(
        "--trainers",
        type=parse_counts,
        help=f"trainer counts of the batching rows (default {DEFAULT_TRAINERS})",
    )
    parser.add_argument(
        "--duration-s", type=float, help=f"measurement window (default {DEFAULT_DURATION_S:g})"
    )
    parser.add_argument("--warmup-s", type=float, help=f"before the window (default {DEFAULT_WARMUP_S:g})")
    parser.add_argument(
        "--local-duration-s", type=float, help=f"per local stage (default {DEFAULT_LOCAL_DURATION_S:g})"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads per server and local (default: a server's own, 1 on CPU, min(4, cores) on CUDA)",
    )
    parser.add_argument("--batch-micro-batch", type=int, default=2, help="micro-batch of the batching rows")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="servers' --max-batch-tokens when on (default 0: max(4, trainers) micro-batches' tokens)",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="micro-batches in flight per trainer of the batching rows (default 0: the trainer's, 4 per stage)",
    )
    parser.add_argument(
        "--served-in-flight",
        type=parse_in_flight,
        default=[0],
        metavar="N[,N...]",
        help="micro-batches in flight of the served rows' trainer, a row each (default 0: the trainer's, 4 per stage)",
    )
    parser.add_argument(
        "--rows",
        type=parse_rows,
        default=list(ROWS),
        metavar="ROW[,ROW...]",
        help=f"which rows to run, of {','.join(ROWS)} (default all)",
    )
    parser.add_argument(
        "--swap-budget-fraction", type=float, default=0.5, help="CUDA: swapper budget / resident peak"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: short, fp32 and 4 trainers")
    parser.add_argument("--summary-json", metavar="PATH", help="write the results here")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep every peer's log and ledger in DIR")
    args = parser.parse_args(argv)
    _apply_defaults(args)
    positive = ("duration_s", "local_duration_s", "threads", "batch_micro_batch", "swap_budget_fraction")
    non_negative = (args.warmup_s, args.max_batch_tokens, args.in_flight)
    given = [getattr(args, name) for name in positive if getattr(args, name) is not None]  # None: default
    if any(value <= 0 for value in given) or min(non_negative) < 0:
        parser.error(
            f"{', '.join('--' + n.replace('_', '-') for n in positive)} must be positive, "
            "--warmup-s, --max-batch-tokens and --in-flight >= 0"
        )
    return args


def _apply_defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    if args.dtypes is None:
        args.dtypes = ["fp32"] if quick else list(SERVER_DTYPES)
    if args.trainers is None:
        args.trainers = parse_counts(QUICK_TRAINERS if quick else DEFAULT_TRAINERS)
    if args.duration_s is None:
        args.duration_s = QUICK_DURATION_S if quick else DEFAULT_DURATION_S
    if args.warmup_s is None:
        args.warmup_s = QUICK_WARMUP_S if quick else DEFAULT_WARMUP_S
    if args.local_duration_s is None:
        args.local_duration_s = QUICK_LOCAL_DURATION_S if quick else DEFAULT_LOCAL_DURATION_S


def write_configs(args, root: Path) -> tuple[RunConfig, Path, RunConfig, Path]:
    """The served rows' run file (the preset) and the batching rows' (its micro-batch and global batch)."""
    preset = get_preset(args.preset)
    swarm = {"announce_period_s": ANNOUNCE_PERIOD_S, "rebalance_period_s": 0.0}  # the fleet stays as started
    served_path = write_run_toml(root / "served.toml", args.preset, {"swarm": swarm})
    global_batch = batching_global_batch(
        preset.training.global_batch_size, args.batch_micro_batch, args.trainers
    )
    training = {"micro_batch_size": args.batch_micro_batch, "global_batch_size": global_batch}
    batch_path = write_run_toml(root / "batching.toml", args.preset, {"training": training, "swarm": swarm})
    return load_run_config(served_path), served_path, load_run_config(batch_path), batch_path


def machine_info() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def new_report(args, cfg: RunConfig, batch_cfg: RunConfig) -> dict:
    setup = {
        "device": str(args.device),
        "preset": args.preset,
        "num_stages": cfg.swarm.num_stages,
        "seq_len": cfg.model.seq_len,
        "micro_batch": cfg.training.micro_batch_size,
        "batch_micro_batch": batch_cfg.training.micro_batch_size,
        "batch_global_batch": batch_cfg.training.global_batch_size,
        "threads": args.threads,
        "batch_in_flight": args.in_flight or None,
        "served_in_flight": args.served_in_flight,
        "rows": args.rows,
        "dtypes": args.dtypes,
        "trainers": args.trainers,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "local_duration_s": args.local_duration_s,
        "quick": args.quick,
    }
    return {"setup": setup, "machine": machine_info(), "served": [], "batching": [], "swap": None}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.device_name = str(args.device)
    args.threads = args.threads or server_threads(args.device)  # what a server takes without --threads
    signal.signal(signal.SIGTERM, _raise_interrupt)
    torch.set_num_threads(args.threads)  # the local rows: as many threads as a server has
    with ExitStack() as stack:
        if args.keep_logs:
            root = Path(args.keep_logs)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="device-stage-")))
        cfg, config_path, batch_cfg, batch_path = write_configs(args, root)
        report = new_report(args, cfg, batch_cfg)
        return run_all(args, (cfg, config_path), (batch_cfg, batch_path), report, root)


def run_all(args, served: tuple, batching: tuple, report: dict, root: Path) -> int:
    def save() -> None:
        if args.summary_json:
            Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary_json).write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        if "served" in args.rows:
            served_rows(args, *served, root, report, save)
        if "batching" in args.rows:
            batching_rows(args, *batching, root, report, save)
        if "swap" in args.rows:
            report["swap"] = swap_row(args, served[0])
    except KeyboardInterrupt:  # the swarm of the row in progress is already stopped (LocalSwarm's exit)
        report["interrupted"] = True
    save()
    print("\n".join(report_lines(report)), flush=True)
    if report.get("interrupted"):
        return 130
    runs = [e["run"] for e in report["served"]] + [e[m] for e in report["batching"] for m in ("off", "on")]
    return 1 if any(run.get("error") for run in runs) or (report["swap"] or {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
