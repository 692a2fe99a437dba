"""`swarmtrain demo` end to end, started as the README's quick start says (`make quickstart`): it trains,
kills a replica, learns, writes the summary (with the one-process reference on the same samples), and
leaves no process behind, also when interrupted with Ctrl-C (SIGINT)."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmtrain.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEYS = {
    "initial_loss",
    "final_loss",
    "samples",
    "microbatches_started",
    "microbatches_completed",
    "microbatches_failed",
    "samples_lost_with_dead_peers",
    "peers_killed",
    "val_loss",  # through the swarm, after training
    "byte_frequency_val_loss",
    "local_val_loss",  # one process on the same samples, after the swarm stopped
    "val_loss_gap",  # val_loss / local_val_loss - 1
}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _process_groups(pids) -> set[int]:
    groups = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        groups.add(int(stat[stat.rfind(")") + 2 :].split()[2]))
    return groups


def _members_of(groups: set[int]) -> list[int]:
    """Live processes in these process groups (p2pd daemons do not mention the workdir)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text()
            except OSError:
                continue
            fields = fields[fields.rfind(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[2]) in groups:
                alive.append(int(entry.name))
    return alive


def _demo(tmp_path, *args):
    workdir = tmp_path / "demo"
    argv = [sys.executable, "-m", "swarmtrain.cli.main", "demo", "--workdir", str(workdir), *args]
    return workdir, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_the_quickstart_trains_kills_a_replica_learns_and_cleans_up(tmp_path):
    """The README's quick start (`make quickstart`, the demo at its defaults but a shorter run)."""
    summary_path, workdir = tmp_path / "summary.json", tmp_path / "demo"
    # 10 s of training (was 20, then 15): the checks below hold with room (one run at 10 s: 2,976 samples,
    # loss 5.47 -> 2.50 where they need a drop of 1.0, val loss 2.61 against the byte frequencies' 3.22; at
    # 15 s 2.47 and 2.52). The demo's exit is longer than its training: the trainer retried its closes to
    # the killed replica for ~30 s before exiting (runtime/trainer/close_calls.py)
    args = f"--duration-s 10 --workdir {workdir} --summary-json {summary_path}"
    proc = subprocess.run(
        ["make", "-s", "quickstart", f"QUICKSTART_ARGS={args}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads(summary_path.read_text())
    assert set(summary) == KEYS
    assert summary["peers_killed"] == 1 and "SIGKILLed" in out
    assert summary["microbatches_failed"] == 0
    assert summary["microbatches_completed"] == summary["microbatches_started"] > 0
    assert summary["final_loss"] < summary["initial_loss"] - 1.0
    assert summary["val_loss"] < summary["byte_frequency_val_loss"]  # it learned more than byte counts
    # samples_lost_with_dead_peers (runtime/harness/demo.py, runtime/harness/accounting.py): samples of
    # the micro-batches that only the killed stage-0 replica accumulated and no survivor applied with it.
    # Each is a whole micro-batch (iterate_batches yields full ones), and there are at most two steps'
    # worth: synchronous training (max_staleness 0, local_steps 1) holds the unapplied gradients of one
    # step only (a micro-batch of step k waits for step k - 1's parameters), and the step before is lost
    # too only if the kill lands after the victim applied it and before its sums reached the survivor.
    cfg = load_run_config(workdir / "run.toml")  # what the demo ran: --preset tiny plus DEMO_SWARM
    assert cfg.training.max_staleness == 0 and cfg.swarm.local_steps == 1  # what the bound assumes
    lost, micro_batch = summary["samples_lost_with_dead_peers"], cfg.training.micro_batch_size
    assert lost % micro_batch == 0, lost
    assert lost <= min(2 * cfg.training.global_batch_size, summary["samples"]), lost
    assert math.isfinite(summary["local_val_loss"]) and math.isfinite(summary["val_loss_gap"])
    assert "(one process, same" in out
    print(
        f"quick start: val loss {summary['val_loss']:.4f} (swarm) vs {summary['local_val_loss']:.4f} (one "
        f"process) after {summary['samples']} samples, gap {summary['val_loss_gap']:+.2%}; byte "
        f"frequencies {summary['byte_frequency_val_loss']:.4f}"
    )
    time.sleep(0.5)
    assert _processes_mentioning(str(workdir)) == []


def test_demo_leaves_nothing_behind_on_ctrl_c(tmp_path):
    workdir, proc = _demo(tmp_path, "--duration-s", "120")
    deadline = time.monotonic() + 120
    while not (workdir / "peers" / "trainer.log").exists():  # servers are up, training started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(2)
    peers = _processes_mentioning(str(workdir))
    groups = _process_groups(peers) - {os.getpgrp()}
    assert len(peers) >= 5 and len(_members_of(groups)) > len(peers)  # + p2pd daemons
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert "interrupted" in out, out[-2000:]
    time.sleep(0.5)
    assert _processes_mentioning(str(workdir)) == []
    assert _members_of(groups) == []
