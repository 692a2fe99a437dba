"""`swarmtrain simulate`: outputs, and bad input answered with exit code 2 and one line."""

import json

import pytest

from swarmtrain.cli.main import main

pytestmark = pytest.mark.unit

QUICK = ["--duration-s", "300", "--chunk-samples", "32", "--global-batch-size", "8192"]


def run_cli(capsys, *argv):
    try:
        code = main(["simulate", *argv])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_summary_json_plot_and_table(tmp_path, capsys):
    summary_path, plot_path, trace_path = tmp_path / "s.json", tmp_path / "p.png", tmp_path / "t.csv"
    code, out, err = run_cli(
        capsys,
        "--num-peers",
        "24",
        "--churn",
        "exponential",
        *QUICK,
        "--summary-json",
        str(summary_path),
        "--plot",
        str(plot_path),
        "--save-trace",
        str(trace_path),
    )
    assert code == 0, err
    summary = json.loads(summary_path.read_text())
    for key in ("samples_per_s", "fraction_of_optimal", "bytes_moved", "events", "wall_s"):
        assert key in summary
    assert summary["samples_per_s"] > 0 and summary["events"] > 0 and summary["wall_s"] > 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "samples/s" in out and "mean compute utilization per stage" in out
    # the saved churn, replayed as a trace, gives the same simulation
    replay_path = tmp_path / "r.json"
    code, _, err = run_cli(
        capsys, "--num-peers", "24", "--trace", str(trace_path), *QUICK, "--summary-json", str(replay_path)
    )
    assert code == 0, err
    replay = json.loads(replay_path.read_text())
    assert replay["samples"] == summary["samples"] and replay["events"] == summary["events"]


def test_all_modes_on_the_same_fleet(tmp_path, capsys):
    path = tmp_path / "all.json"
    code, out, err = run_cli(
        capsys, "--scenario", "multi-university", "--mode", "all", *QUICK, "--summary-json", str(path)
    )
    assert code == 0, err
    summary = json.loads(path.read_text())
    assert set(summary["modes"]) == {"swarm", "swarm-no-rebalance", "gpipe", "async-replicas"}
    assert summary["best_mode"] in summary["modes"]
    assert all(mode in out for mode in summary["modes"])


def test_measured_compute_times_flag_with_pinned_stages(tmp_path, capsys):
    fleet = tmp_path / "demo.toml"
    fleet.write_text(
        '[[peers]]\nid = "s0"\ndevice = "cpu"\nstage = 0\n[[peers]]\nid = "s1"\ndevice = "cpu"\nstage = 1\n'
    )
    times = tmp_path / "times.csv"
    times.write_text("peer,stage,seconds_per_sample\ns0,0,0.25\ns1,1,0.5\n")
    path = tmp_path / "s.json"
    argv = ["--fleet", str(fleet), "--model", "tiny", "--peer-compute-times", str(times)]
    argv += ["--duration-s", "400", "--summary-json", str(path)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads(path.read_text())["samples_per_s"] == pytest.approx(2.0, rel=0.03)  # the slower stage
    code, _, err = run_cli(capsys, *argv, "--compute-cv", "1", "--latency-cv", "0.5")
    assert code == 0, err
    jittery = json.loads(path.read_text())["samples_per_s"]
    # the flags reach the simulation: random durations (the mean over ~100 micro-batches is noisy)
    assert jittery != pytest.approx(2.0, rel=0.01) and 1.0 < jittery < 3.0


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "choose a fleet"),
        (["--num-peers", "0"], "expected a positive integer"),
        (["--num-peers", "3", "--scenario", "spot"], "not allowed with"),
        (["--scenario", "moon"], "unknown scenario"),
        (["--num-peers", "3", "--churn", "meteor"], "invalid choice"),
        (["--num-peers", "3", "--trace", "/nonexistent.csv"], "cannot read trace"),
        (["--num-peers", "3", "--model", "gpt5"], "unknown preset"),
        (["--num-peers", "3", "--stages", "99", "--model", "tiny"], "cannot cut 4 layers into 99 stages"),
        (["--fleet", "/nonexistent.toml"], "cannot read fleet file"),
        (["--num-peers", "3", "--latency-ms", "-1"], "expected a number >= 0"),
        (["--num-peers", "3", "--compute-cv", "-0.1"], "expected a number >= 0"),
        (["--num-peers", "3", "--latency-cv", "12"], "coefficient of variation below 10"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_bad_trace_line_is_reported(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,peer,event\n10,p1,fail\n20,p1,fail\n")
    code, _, err = run_cli(capsys, "--num-peers", "3", "--trace", str(trace))
    assert code == 2 and "line 3: peer p1 cannot fail: it is not live" in err
