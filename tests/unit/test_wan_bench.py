"""bench/wan.py (the swarm vs GPipe over rate-limited links) without its test bed: the configuration
registry, argument parsing, ratios, tables and steps-to-target from fake results, the skip without root;
and bench/gpipe_rank.py (two torch start-ups, ~7 s): two ranks on loopback train as train-local does."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wan = _load("wan")


def run(samples_per_s, trainer=None, stage=(1000.0, 1000.0), error=None) -> dict:
    """A fake result: bytes per sample of each role (a swarm's when `trainer` is given, else GPipe's)."""
    if error:
        return {"error": error, "wall_s": 1.0}
    bps = {"stage0": stage[0], "stage1": stage[1]}
    if trainer is not None:
        bps.update(trainer=trainer, dht=10.0)
    return {"samples_per_s": samples_per_s, "samples": 256, "bytes_per_sample": bps, "wall_s": 50.0}


def fake_report(with_failure: bool = False) -> dict:
    runs_10 = {
        "gpipe-fp32": run(8.0),
        "relay-fp32": run(4.0, trainer=4000.0),
        "relay-8bit": run(12.0, trainer=1000.0),
        "direct-fp32": run(10.0, trainer=500.0, stage=(2000.0, 3000.0)),
        "direct-8bit": run(30.0, trainer=100.0, stage=(400.0, 600.0)),
    }
    runs_inf = dict(runs_10)
    if with_failure:
        runs_inf["direct-8bit"] = run(0.0, error="RunFailed: boom")
    points = []
    for rate, runs in ((10.0, runs_10), (math.inf, runs_inf)):
        points.append({"rate": wan.fmt_bw(rate), "mbit_s": rate, "runs": runs, "ratios": wan.ratios(runs)})
    return {
        "configs": wan.config_names()[:5],
        "roles": ["trainer", "stage0", "stage1", "dht"],
        "global_batch": 128,
        "points": points,
    }


def test_the_registry_holds_gpipe_and_the_four_swarm_configurations():
    assert wan.config_names()[:5] == ["gpipe-fp32", "relay-fp32", "relay-8bit", "direct-fp32", "direct-8bit"]
    by_name = {c.name: c for c in wan.REGISTRY}
    assert by_name["gpipe-fp32"].runner is wan.run_gpipe and by_name["gpipe-fp32"].math == "local"
    for hand_off in ("relay", "direct"):
        for codec, label in (("none", "fp32"), ("8bit", "8bit")):
            config = by_name[f"{hand_off}-{label}"]
            assert (config.runner, config.hand_off, config.codec) == (wan.run_swarm, hand_off, codec)
    # relay and direct compute the same thing: one steps-to-target measurement per codec
    assert by_name["relay-8bit"].math == by_name["direct-8bit"].math != by_name["direct-fp32"].math


def test_arguments_default_and_select_in_registry_order():
    args = wan.parse_args([])
    assert args.rates == [10.0, 50.0, math.inf]
    assert [c.name for c in args.configs] == wan.config_names()[:5]
    assert (args.duration_s, args.time_to_target, args.ttt_rate) == (40.0, False, 10.0)
    args = wan.parse_args(
        ["--rates", "50,inf,2.5", "--configs", "direct-8bit, gpipe-fp32", "--duration-s", "5"]
    )
    assert args.rates == [2.5, 50.0, math.inf]
    assert [c.name for c in args.configs] == ["gpipe-fp32", "direct-8bit"]
    assert args.duration_s == 5.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "direct-1bit"],
        ["--configs", ""],
        ["--rates", "fast"],
        ["--duration-s", "0"],
        ["--preset", "tiny", "--config", "run.toml"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        wan.parse_args(argv)
    assert exc.value.code == 2


def test_ratios_come_from_the_runs_of_one_rate():
    ratios = fake_report()["points"][0]["ratios"]
    assert ratios["direct-8bit / relay-8bit"] == pytest.approx(2.5)
    assert ratios["direct-fp32 / gpipe-fp32"] == pytest.approx(1.25)
    assert ratios["trainer / server bytes, direct-fp32"] == pytest.approx(500 / 2500)
    assert ratios["trainer / server bytes, direct-8bit"] == pytest.approx(100 / 500)
    failed = fake_report(with_failure=True)["points"][1]["ratios"]
    assert failed["direct-8bit / relay-8bit"] is None
    assert failed["trainer / server bytes, direct-8bit"] is None
    # a configuration not run: no ratio at all
    assert "direct-8bit / relay-8bit" not in wan.ratios({"direct-8bit": run(1.0, trainer=1.0)})


def test_tables_show_rates_as_rows_and_configurations_as_columns():
    lines = wan.report_lines(fake_report(with_failure=True))
    text = "\n".join(lines)
    header = next(line for line in lines if line.split()[:1] == ["Mbit/s"])
    assert header.split() == ["Mbit/s", *wan.config_names()[:5]]
    row_10 = next(line for line in lines if line.split()[:2] == ["10", "8.0"])
    assert row_10.split() == ["10", "8.0", "4.0", "12.0", "10.0", "30.0"]
    row_inf = [line for line in lines if line.split()[:1] == ["inf"]][0]
    assert row_inf.split()[-1] == "FAILED"
    assert "2.50" in text and "1.25" in text and "0.20" in text  # ratios
    # bytes: kB per sample per role, a row per (rate, configuration); gpipe has no trainer or DHT
    gpipe = next(line for line in lines if line.split()[:2] == ["10", "gpipe-fp32"])
    assert gpipe.split() == ["10", "gpipe-fp32", "-", "1.0", "1.0", "-"]
    relay = next(line for line in lines if line.split()[:2] == ["10", "relay-fp32"])
    assert relay.split() == ["10", "relay-fp32", "4.0", "1.0", "1.0", "0.0"]


def test_link_use_is_bytes_over_what_the_link_carries_in_the_run_and_none_unlimited():
    by_role = {"stage0": {"sent": 1_000_000, "received": 500_000}, "trainer": {"sent": 0, "received": 0}}
    use = wan.link_use(by_role, 10.0, 2.0)  # 10 Mbit/s for 2 s: 2.5 MB each way
    assert use == {"stage0": {"up": 0.4, "down": 0.2}, "trainer": {"up": 0.0, "down": 0.0}}
    assert wan.link_use(by_role, math.inf, 2.0) is None
    report = fake_report()
    report["points"][0]["runs"]["direct-8bit"] = {**run(30.0, trainer=1.0), "link_use": use}
    lines = wan.report_lines(report)
    row = next(line for line in lines if line.startswith("link use"))
    table = lines[lines.index(row) + 1 :]
    assert table[0].split() == ["Mbit/s", "config", "trainer", "stage0", "stage1", "dht"]
    # one row: the only run with link use; a role it has no figure for shows "-"
    assert table[2].split() == ["10", "direct-8bit", "0%", "/", "0%", "40%", "/", "20%", "-", "-"]
    assert len([line for line in table if line.split()[:1] == ["10"]]) == 1


def test_steps_to_target_interpolates_between_evaluations():
    history = [(0, 5.0), (4, 3.0), (8, 2.0), (12, 1.5)]
    assert wan.steps_to_target(history, 2.5) == {"steps": pytest.approx(6.0), "bound": False}
    assert wan.steps_to_target(history, 2.0) == {"steps": pytest.approx(8.0), "bound": False}
    assert wan.steps_to_target([(100, 1.0), (104, 0.9)], 1.2) == {"steps": 100.0, "bound": True}
    missed = wan.steps_to_target(history, 1.0)
    assert missed["steps"] is None and "12" in missed["note"]


def test_time_to_target_is_steps_times_seconds_per_step_at_the_rate():
    report = fake_report()
    steps = {
        "local": {"steps": 150.0, "bound": False},
        "swarm-fp32": {"steps": 152.0, "bound": False},
        "swarm-8bit": {"steps": None, "bound": False, "note": "not reached in 256 steps"},
    }
    ttt = wan.ttt_summary(1.2, "test", 10.0, steps, {}, wan.REGISTRY[:5], report)
    assert ttt["configs"]["gpipe-fp32"]["s_per_step"] == pytest.approx(128 / 8.0)
    assert ttt["configs"]["gpipe-fp32"]["minutes"] == pytest.approx(150 * 16 / 60)
    assert ttt["configs"]["direct-fp32"]["minutes"] == pytest.approx(152 * 12.8 / 60)
    assert ttt["configs"]["direct-8bit"]["minutes"] is None
    text = "\n".join(wan.ttt_lines(ttt))
    assert "not reached in 256 steps" in text and "relay and direct computing the same thing" in text
    missing = wan.ttt_summary(1.2, "test", 25.0, steps, {}, wan.REGISTRY[:5], report)
    assert missing["configs"]["gpipe-fp32"]["minutes"] is None and "not in --rates" in missing["note"]
    json.dumps(wan._json_ready({**report, "ttt": ttt}), allow_nan=False)
    # how many times faster than direct-8bit to the target, in the same run
    steps["swarm-8bit"] = {"steps": 76.0, "bound": False}
    ttt = wan.ttt_summary(1.2, "test", 10.0, steps, {}, wan.REGISTRY[:5], report)
    row = next(line for line in wan.ttt_lines(ttt) if line.split()[:1] == ["direct-fp32"])
    assert row.split()[-1] == f"{(76 * 128 / 30) / (152 * 12.8):.2f}"


def test_time_to_target_at_every_rate_of_the_sweep_against_8bit_and_unlimited_fp32():
    """Issue 54's table: minutes to the target at each rate (the same steps, each rate's s/step), how many
    times sooner than direct-8bit at that rate, and against direct-fp32 at an unlimited rate."""
    report = fake_report()
    report["points"][1]["runs"] = dict(report["points"][1]["runs"], **{"direct-fp32": run(64.0)})
    steps = {
        "local": {"steps": 150.0, "bound": False},
        "swarm-fp32": {"steps": 100.0, "bound": False},
        "swarm-8bit": {"steps": 120.0, "bound": False},
    }
    ttt = wan.ttt_summary(1.2, "test", 10.0, steps, {}, wan.REGISTRY[:5], report)
    by_rate = ttt["minutes_by_rate"]
    assert list(by_rate) == ["10", "inf"]
    assert by_rate["10"]["direct-8bit"] == pytest.approx(120 * 128 / 30 / 60)
    assert by_rate["inf"]["direct-fp32"] == pytest.approx(100 * 2 / 60)
    lines = wan.ttt_lines(ttt)
    row = next(line for line in lines if line.split()[:2] == ["direct-8bit", "1.20"])
    cells = row.split()
    assert cells[2] == f"{120 * 128 / 30 / 60:.2f}" and cells[3] == "1.00"
    assert cells[4] == f"{(120 * 128 / 30) / (100 * 2):.2f}"  # 8-bit at 10 Mbit/s against fp32 unlimited
    json.dumps(wan._json_ready({**report, "ttt": ttt}), allow_nan=False)


def test_without_a_test_bed_it_prints_why_and_exits_0(monkeypatch, capsys):
    if os.geteuid() != 0:
        done = subprocess.run(
            [sys.executable, str(BENCH / "wan.py")], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines() == [done.stdout.strip()]
        assert done.stdout.startswith("skipped: ") and "root" in done.stdout
        return
    monkeypatch.setattr(wan.netbed, "available", lambda: (False, "no test bed in this test"))
    assert wan.main([]) == 0
    assert capsys.readouterr().out == "skipped: no test bed in this test\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpipe_ranks_on_loopback_train_as_train_local_does(tmp_path):  # ~7 s (22 s beside a busy suite)
    """Two gpipe_rank.py processes on tiny: the losses of their first steps are train-local's (same
    weights, data order, gradient mean, global clipping, AdamW)."""
    import torch

    from swarmtrain.config import get_preset
    from swarmtrain.data import iterate_batches
    from swarmtrain.runtime.local import LocalTrainer

    port, summary = _free_port(), tmp_path / "gpipe.json"
    common = ["--world-size", "2", "--master-port", str(port), "--ifname", "lo", "--preset", "tiny"]
    common += ["--steps", "2", "--warmup-steps", "1", "--timeout-s", "60"]
    argv = [sys.executable, str(BENCH / "gpipe_rank.py"), *common]
    ranks = [
        subprocess.Popen([*argv, "--rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen(
            [*argv, "--rank", "0", "--summary-json", str(summary)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    try:
        outputs = [rank.communicate(timeout=90)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    result = json.loads(summary.read_text())
    assert (result["timed_steps"], result["steps"], result["samples"]) == (2, 3, 96)
    assert result["samples_per_s"] > 0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = get_preset("tiny")
        local = LocalTrainer(cfg, progress=False)
        batches = iterate_batches(local.train_set, cfg.training.micro_batch_size, seed=cfg.training.seed)
        expected = [local.step(batches) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert result["losses"] == pytest.approx(expected, rel=1e-5)
    assert result["mean_loss"] == pytest.approx(sum(expected[1:]) / 2, rel=1e-5)


def test_codecs_below_8_bits_and_boundary_layers_get_their_own_run_file(tmp_path):
    """Both are part of the run digest: every peer of such a configuration reads a run file naming them."""
    from swarmtrain.config import load_run_config
    from swarmtrain.runtime.harness.local_swarm import write_run_toml

    base = write_run_toml(tmp_path / "run.toml", "tiny", {"training": {"max_samples": 512}})
    setup = wan.Setup(base, 2, 32, 10.0, 60.0, 64, d_model=64)
    by_name = {c.name: c for c in wan.REGISTRY}
    assert by_name["direct-8bit"].run_file(setup, tmp_path / "a") == base
    cfg = load_run_config(by_name["direct-4bit-lowrank2"].run_file(setup, tmp_path / "b"))
    assert (cfg.swarm.compression, cfg.model.boundary, cfg.model.boundary_dim) == ("4bit", "lowrank", 32)
    assert cfg.training.max_samples == 512  # the rest of the setup's run file is kept
    assert (
        load_run_config(by_name["direct-3bit-rht"].run_file(setup, tmp_path / "c")).model.boundary == "none"
    )


def test_lowbit_configurations_are_compared_with_8bit_speed_and_fp32_bytes():
    runs = {
        "direct-fp32": run(10.0, trainer=500.0, stage=(2000.0, 3200.0)),
        "direct-8bit": run(20.0, trainer=100.0, stage=(400.0, 800.0)),
        "direct-4bit-lowrank2": run(40.0, trainer=100.0, stage=(200.0, 200.0)),
    }
    ratios = wan.ratios(runs)
    assert ratios["direct-4bit-lowrank2 / direct-8bit"] == pytest.approx(2.0)
    assert ratios["last-stage bytes, direct-fp32 / direct-4bit-lowrank2"] == pytest.approx(16.0)


def test_the_last_stages_counted_bytes_come_from_its_last_metrics_line_and_compare_with_fp32s():
    from swarmtrain.runtime.server.server_metrics import ServerMetrics

    zeros = {f: 0 for f in ServerMetrics.__dataclass_fields__ if f not in ("role", "moved")}

    def line(samples: int, received: int, sent: int) -> str:
        counts = {"stage": 1, "samples_forward": samples, "bytes_in": received, "bytes_out": sent}
        record = ServerMetrics(**{**zeros, **counts}, moved=None)
        return "12:00:00 I swarmtrain.runtime.server.server_process: " + record.log_line()

    # samples of training forwards, not of applied steps (those lag by the step in progress)
    log = "\n".join(["starting", line(0, 500, 0), line(64, 3000, 1000), line(128, 6400, 2560), "stopping"])
    assert wan.counted_bytes_per_sample(log) == pytest.approx((6400 + 2560) / 128)
    assert wan.counted_bytes_per_sample("starting\n" + line(0, 500, 0)) is None  # no samples yet
    assert wan.counted_bytes_per_sample("no metrics at all") is None
    runs = {
        "direct-fp32": dict(run(10.0, trainer=1.0), last_stage_counted_bytes_per_sample=6400.0),
        "direct-4bit-subspace16": dict(run(40.0, trainer=1.0), last_stage_counted_bytes_per_sample=80.0),
        "direct-4bit": run(20.0, trainer=1.0),  # no metrics line: no ratio, no error
    }
    ratios = wan.ratios(runs)
    assert ratios["last-stage counted bytes, direct-fp32 / direct-4bit-subspace16"] == pytest.approx(80.0)
    assert ratios["last-stage counted bytes, direct-fp32 / direct-4bit"] is None


def test_subspace_configurations_and_the_plain_model_of_their_parameter_count(tmp_path):
    """Subspace boundaries run as configurations of their own run file, and --ttt-matched compares a
    boundary with the plain model of its parameter count (d_ff matched)."""
    from swarmtrain.config import get_preset, load_run_config
    from swarmtrain.runtime.harness.local_swarm import write_run_toml

    base = write_run_toml(tmp_path / "run.toml", "small", {"swarm": {"num_stages": 2}})
    setup = wan.Setup(base, 2, 32, 10.0, 60.0, 64, d_model=256)
    by_name = {c.name: c for c in wan.REGISTRY}
    config = by_name["direct-4bit-subspace16"]
    cfg = load_run_config(config.run_file(setup, tmp_path / "s"))
    assert (cfg.swarm.compression, cfg.model.boundary, cfg.model.boundary_dim) == ("4bit", "subspace", 16)
    assert by_name["direct-8bit-subspace16"].math != config.math
    plain = get_preset("small")
    boundary = wan.boundary_run(config, setup, plain)
    matched = wan.matched_plain(boundary)
    assert matched.model.boundary == "none" and matched.model.d_ff < plain.model.d_ff
    assert wan.parameter_count(boundary) < wan.parameter_count(plain)
    per_unit = wan.parameter_count(matched.replace(model=dataclasses.replace(matched.model, d_ff=2))) - (
        wan.parameter_count(matched.replace(model=dataclasses.replace(matched.model, d_ff=1)))
    )
    assert abs(wan.parameter_count(matched) - wan.parameter_count(boundary)) <= per_unit / 2
    assert wan.parse_args(["--time-to-target", "--ttt-matched"]).ttt_matched


def test_a_subspace_configuration_with_the_datas_token_table_makes_it_once_from_the_runs_own_tokens(
    tmp_path,
):
    from swarmtrain.config import load_run_config
    from swarmtrain.runtime.harness.local_swarm import write_run_toml

    base = write_run_toml(tmp_path / "run.toml", "llama-tiny", {"training": {"max_samples": 64}})
    setup = wan.Setup(base, 2, 32, 10.0, 60.0, 64, d_model=64)
    by_name = {c.name: c for c in wan.REGISTRY}
    config = by_name["direct-4bit-subspace16-table"]
    cfg = load_run_config(config.run_file(setup, tmp_path / "t"))
    assert (cfg.model.boundary, cfg.model.boundary_dim) == ("subspace", 4)
    table = Path(cfg.model.boundary_table)
    assert table == tmp_path / "boundary-table.safetensors" and table.is_absolute()
    made = table.stat().st_mtime_ns
    again = load_run_config(by_name["direct-4bit-subspace8-table"].run_file(setup, tmp_path / "u"))
    assert again.model.boundary_table == str(table) and table.stat().st_mtime_ns == made  # made once
    assert config.math != by_name["direct-4bit-subspace16"].math  # another model: its own steps to target
    assert wan.matched_plain(cfg).model.boundary_table == ""
