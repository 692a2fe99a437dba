"""`swarmtrain demo`: a complete swarm on this machine, as separate processes, with a live display.

Processes: one DHT bootstrap node, two replicas of stage 0, one server for every other stage, one
trainer. Halfway through, one stage-0 replica is SIGKILLed (its whole process tree) to show the
trainer routing around it. At the end (or on Ctrl-C) every process is stopped and the summary
printed; the per-stage accounting says how many samples died with the killed replica. Unless told
not to, the demo then trains one process on the samples the swarm trained (same initial weights,
data order and schedule) and prints its validation loss next to the swarm's: the gap is what
distribution cost.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarmtrain.config import load_run_config
from swarmtrain.config.hf_config import model_config_from_hf, read_hf_config
from swarmtrain.runtime.harness.accounting import account_stage
from swarmtrain.runtime.harness.local_swarm import LocalSwarm, derived_run_toml, write_run_toml
from swarmtrain.runtime.ledger import read_ledger

SUMMARY_KEYS = (
    "initial_loss",
    "final_loss",
    "samples",
    "microbatches_started",
    "microbatches_completed",
    "microbatches_failed",
    "samples_lost_with_dead_peers",
    "peers_killed",
)
EXTRA_KEYS = ("val_loss", "byte_frequency_val_loss")  # None when the run was cut short
# one process on the same samples, and val_loss / local_val_loss - 1; None when skipped
REFERENCE_KEYS = ("local_val_loss", "val_loss_gap")
EVAL_SAMPLES = 256  # validation samples evaluated through the swarm at the end (~1 s on tiny)
# a short rebalancing period, so that a demo of a minute shows a move when its stages are uneven (servers
# move only after two periods of serving)
DEMO_SWARM = {
    "announce_period_s": 1.0,
    "request_timeout_s": 15.0,
    "averaging_timeout_s": 15.0,
    "rebalance_period_s": 10.0,
}


@dataclass
class DemoOptions:
    preset: str = "tiny"
    duration_s: float = 60.0
    kill: bool = True
    replicas: int = 2
    in_flight: int | None = None  # None: the trainer's default (planner/in_flight.py)
    workdir: str | None = None
    config_path: str | None = None  # a TOML run file instead of the preset
    reference: bool = True  # train one process on the same samples afterwards, for comparison
    monitor_port: int | None = 0  # the live web page (`swarmtrain monitor`); 0: any free port; None: none
    checkpoint_dir: str | None = None  # servers write stage checkpoints here (`swarmtrain export` reads them)
    init_from_hf: str | None = None  # every peer's model (and servers' weights) from this HF directory
    # fields the demo's run file sets over the preset's or --config's, by section: [model] (`--boundary`,
    # ...), [swarm] (`--compression`)
    overrides: dict[str, dict] = field(default_factory=dict)
    # where the stage servers and the one-process reference compute (`--device`, `--dtype` of
    # model/device.py); fp16 is refused by the servers (whole-model commands only)
    device: str = "auto"
    dtype: str = "fp32"
    # the trainer's `--hand-off` (None: its default); experiments/calibrate_demo.py relays every call
    # through the trainer, whose round trips per stage are then what the simulator's links model
    hand_off: str | None = None

    def server_args(self) -> list[str]:
        args = ["--checkpoint-dir", self.checkpoint_dir] if self.checkpoint_dir else []
        return [*args, "--device", self.device, "--dtype", self.dtype, *self._model_args()]

    def trainer_args(self) -> list[str]:
        return [*self._model_args(), *(["--hand-off", self.hand_off] if self.hand_off else [])]

    def _model_args(self) -> list[str]:
        return ["--init-from-hf", self.init_from_hf] if self.init_from_hf else []


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted()


def _run_file(options: DemoOptions, workdir: Path) -> Path | str:
    """The run file every peer reads: --config, or the preset with the demo's swarm, plus the options'
    overrides (a copy when they change a given file)."""
    overrides = {section: values for section, values in options.overrides.items() if values}
    if options.config_path is None:
        swarm = {**DEMO_SWARM, **overrides.get("swarm", {})}
        return write_run_toml(workdir / "run.toml", options.preset, {**overrides, "swarm": swarm})
    if not overrides:
        return options.config_path
    return derived_run_toml(options.config_path, workdir / "run.toml", overrides)


def run_demo(options: DemoOptions, out=sys.stdout) -> dict:
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="swarmtrain-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = _run_file(options, workdir)
    cfg = load_run_config(config)
    if options.init_from_hf:  # what the peers derive from the same directory
        raw = read_hf_config(options.init_from_hf)
        cfg = cfg.replace(model=model_config_from_hf(raw, cfg.model, source=options.init_from_hf))
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    swarm = LocalSwarm(workdir / "peers", config)
    killed: list[str] = []
    interrupted = False
    try:
        servers = _start(swarm, cfg, options, out)
        interrupted = not _train(swarm, cfg, servers, options, killed, out)
    except Interrupted:
        interrupted = True
    finally:
        print("\nstopping every process...", file=out, flush=True)
        swarm.stop_all(grace_s=10.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary = _summary(swarm, cfg, servers if "servers" in locals() else {}, killed)
    # after stop_all: the reference gets the CPU to itself, and a Ctrl-C'd demo skips it
    run_reference = options.reference and not interrupted and summary["val_loss"] is not None
    reference = _reference(cfg, summary, options, out) if run_reference else None
    summary.update(reference or dict.fromkeys(REFERENCE_KEYS))
    _print_summary(summary, cfg, workdir, options, interrupted, out)
    return summary


def _start(swarm: LocalSwarm, cfg, options: DemoOptions, out) -> dict[str, int]:
    stages = cfg.swarm.num_stages
    servers = {f"stage0-r{i}": 0 for i in range(options.replicas)}
    servers.update({f"stage{s}-r0": s for s in range(1, stages)})
    print(
        f"swarmtrain demo: preset {cfg.preset}, {stages} stages, servers {sorted(servers)} on "
        f"{options.device} {options.dtype}, logs in {swarm.workdir}",
        file=out,
        flush=True,
    )
    address = swarm.start_dht()
    print(f"  DHT bootstrap node: {address}", file=out, flush=True)
    for name, stage in servers.items():
        swarm.start_server(name, stage, *options.server_args())
    if options.monitor_port is not None:  # started while the servers build their stages
        url = swarm.start_monitor(options.monitor_port, "--interval-s", "1")
        print(f"  monitor: {url} (open it in a browser; JSON at {url}api/swarm)", file=out, flush=True)
    print("  waiting for the servers (model build, DHT join, averager start)...", file=out, flush=True)
    swarm.wait_ready(list(servers), timeout_s=180)
    return servers


def _train(swarm: LocalSwarm, cfg, servers, options: DemoOptions, killed: list[str], out) -> bool:
    swarm.start_trainer(
        "trainer",
        "--duration-s",
        str(options.duration_s),
        *(("--in-flight", str(options.in_flight)) if options.in_flight else ()),
        "--log-period-s",
        "1",
        "--eval-samples",
        str(EVAL_SAMPLES),
        *options.trainer_args(),
    )
    trainer = swarm.processes["trainer"]
    start, last_line = time.monotonic(), 0.0
    while trainer.alive:
        time.sleep(0.25)
        elapsed = time.monotonic() - start
        if options.kill and not killed and elapsed >= options.duration_s / 2 and _completed(swarm) > 0:
            _kill_a_replica(swarm, servers, elapsed, killed, out)
        if time.monotonic() - last_line >= 1.0:
            last_line = time.monotonic()
            _display(swarm, servers, elapsed, out)
        if elapsed > options.duration_s + 120:
            print("\n  trainer did not finish in time; stopping it", file=out)
            return False
    return trainer.proc.returncode == 0


def _kill_a_replica(swarm: LocalSwarm, servers, elapsed_s: float, killed: list[str], out) -> None:
    """SIGKILL the last-started live server of a stage that has another (stage 0 first); the choice is
    made now, since a rebalancing move may have left stage 0 a single server."""
    stages = serving_stages(swarm, servers)
    live = [n for n in servers if swarm.processes[n].alive]
    for stage in sorted(set(stages.values())):
        replicas = [n for n in live if stages[n] == stage]
        if len(replicas) >= 2:
            swarm.kill(replicas[-1])
            killed.append(replicas[-1])
            print(
                f"\n  >>> SIGKILLed {replicas[-1]} (a stage-{stage} replica) at t={elapsed_s:.0f}s; the "
                "trainer must route around it",
                file=out,
                flush=True,
            )
            return


def serving_stages(swarm: LocalSwarm, servers: dict[str, int]) -> dict[str, int]:
    """Each server's stage now: the one its ledger last said it serves (a rebalancing move changes it),
    else the one it was started on."""
    return {
        name: (ready[-1]["stage"] if (ready := swarm.ledger_events(name, "ready")) else stage)
        for name, stage in servers.items()
    }


def _completed(swarm: LocalSwarm) -> int:
    return sum(1 for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done")


def _display(swarm: LocalSwarm, servers: dict[str, int], elapsed_s: float, out) -> None:
    done = [e for e in read_ledger(swarm.ledger_path("trainer")) if e["e"] == "done"]
    samples = sum(e["n"] for e in done)
    recent = [e["loss"] for e in done[-16:]]
    loss = sum(recent) / len(recent) if recent else float("nan")
    alive: dict[int, int] = {}
    for name, stage in serving_stages(swarm, servers).items():
        alive[stage] = alive.get(stage, 0) + int(swarm.processes[name].alive)
    peers = " ".join(f"s{stage}:{alive[stage]}" for stage in sorted(alive))
    line = (
        f"  t={elapsed_s:5.0f}s  samples {samples:6d}  loss {loss:6.3f}  "
        f"samples/s {samples / max(elapsed_s, 1e-9):6.1f}  peers per stage {peers}"
    )
    if out.isatty():
        print("\r" + line, end="", file=out, flush=True)
    else:
        print(line, file=out, flush=True)


def _summary(swarm: LocalSwarm, cfg, servers: dict[str, int], killed: list[str]) -> dict:
    path = swarm.workdir / "trainer.summary.json"
    trainer = json.loads(path.read_text()) if path.exists() else {}
    events = read_ledger(swarm.ledger_path("trainer"))
    started = sum(1 for e in events if e["e"] == "start")
    completed = {e["mb"] for e in events if e["e"] == "done"}
    lost = 0
    servers = serving_stages(swarm, servers)
    for stage in set(servers.values()):
        ledgers = {n: read_ledger(swarm.ledger_path(n)) for n, s in servers.items() if s == stage}
        dead = {n for n in killed if servers.get(n) == stage}
        if dead:
            lost += account_stage(stage, ledgers, dead, completed).samples_lost_with_dead
    summary = {
        "initial_loss": trainer.get("initial_loss"),
        "final_loss": trainer.get("final_loss"),
        "samples": trainer.get("samples", sum(e["n"] for e in events if e["e"] == "done")),
        "microbatches_started": trainer.get("microbatches_started", started),
        "microbatches_completed": trainer.get("microbatches_completed", len(completed)),
        "microbatches_failed": trainer.get(
            "microbatches_failed", sum(1 for e in events if e["e"] == "failed")
        ),
        "samples_lost_with_dead_peers": lost,
        "peers_killed": len(killed),
        "val_loss": trainer.get("val_loss"),
        "byte_frequency_val_loss": trainer.get("byte_frequency_val_loss"),
    }
    return {key: summary[key] for key in (*SUMMARY_KEYS, *EXTRA_KEYS)}


def _reference_samples(cfg, samples: int) -> int:
    """The samples the swarm applied in whole global batches: what one process replays."""
    return samples // cfg.training.global_batch_size * cfg.training.global_batch_size


def _reference(cfg, summary: dict, options: DemoOptions, out) -> dict:
    """Validation loss of one process trained on the swarm's samples, and the swarm's relative gap; on
    the servers' device and dtype (`options.device`, `options.dtype`)."""
    from swarmtrain.model.device import ComputeDevice  # torch: only once it is needed
    from swarmtrain.runtime.local import local_reference_val_loss

    samples = _reference_samples(cfg, summary["samples"] or 0)
    if not samples:
        return dict.fromkeys(REFERENCE_KEYS)
    compute = ComputeDevice.from_names(options.device, options.dtype)
    print(
        f"computing the one-process reference on the same {samples:,} samples ({compute.describe()})...",
        file=out,
        flush=True,
    )
    try:
        local = local_reference_val_loss(
            cfg, samples, eval_samples=EVAL_SAMPLES, init_from_hf=options.init_from_hf, compute=compute
        )
    except KeyboardInterrupt:  # the swarm's results are in; a Ctrl-C only drops the comparison
        print("  reference interrupted; skipped", file=out, flush=True)
        return dict.fromkeys(REFERENCE_KEYS)
    return {"local_val_loss": local, "val_loss_gap": summary["val_loss"] / local - 1}


def _print_summary(summary: dict, cfg, workdir: Path, options: DemoOptions, interrupted: bool, out) -> None:
    print(("interrupted; " if interrupted else "") + "summary:", file=out)
    for key in (*SUMMARY_KEYS, *EXTRA_KEYS, *REFERENCE_KEYS):
        value = summary[key]
        print(f"  {key:30s} {value:.4f}" if isinstance(value, float) else f"  {key:30s} {value}", file=out)
    if summary["local_val_loss"] is not None:
        samples = _reference_samples(cfg, summary["samples"])
        print(
            f"  val loss {summary['val_loss']:.3f} (swarm) vs {summary['local_val_loss']:.3f} (one process, "
            f"same {samples:,} samples; swarm {summary['val_loss_gap']:+.1%}) vs "
            f"{summary['byte_frequency_val_loss']:.3f} (token frequencies)",
            file=out,
        )
    print(f"  logs and ledgers: {workdir}", file=out, flush=True)
    if options.checkpoint_dir:
        print(
            f"  stage checkpoints: {options.checkpoint_dir} (swarmtrain export --checkpoint-dir ...)",
            file=out,
        )
