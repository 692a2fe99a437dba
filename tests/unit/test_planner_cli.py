"""`swarmtrain plan` through the real dispatcher: JSON output, layouts, plots, and exit 2 on bad input."""

from __future__ import annotations

import json

import pytest

from swarmtrain.cli.main import main

pytestmark = pytest.mark.unit

SIZES = ["--activation-gb", "0.471283", "--gradient-gb", "0.65"]
FAST = ["--budget-evals", "100"]
KEYS = {
    "cost_s",
    "dp_cost_s",
    "pp_cost_s",
    "groups",
    "pipelines",
    "evaluations",
    "evaluations_to_best",
    "time_to_best_s",
    "wall_s",
}


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_search(capsys):
    out = run_json(capsys, "--scenario", "datacenter", *SIZES, *FAST)
    assert set(out) == KEYS
    assert out["evaluations"] == 100 and 1 <= out["evaluations_to_best"] <= 100
    assert 0 <= out["time_to_best_s"] <= out["wall_s"]
    assert sorted(d for g in out["groups"] for d in g) == list(range(64))
    assert len(out["pipelines"]) == 8 and all(len(p) == 8 for p in out["pipelines"])
    # Pipeline p visits the groups in order.
    assert all(p[k] in out["groups"][k] for p in out["pipelines"] for k in range(8))
    assert out["cost_s"] == pytest.approx(out["dp_cost_s"] + 2 * out["pp_cost_s"])


def test_evaluate_layout_and_shuffle(tmp_path, capsys):
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps([list(range(k, 64, 8)) for k in range(8)]))
    out = run_json(capsys, "--scenario", "datacenter", *SIZES, "--evaluate", str(layout))
    assert out["cost_s"] == pytest.approx(7 * 2 * 5.2 / 25 + 2 * 7 * 0.471283 * 8 / 100)
    assert out["evaluations"] == 1
    # The same search on relabelled devices finds a plan of the same cost.
    plain = run_json(capsys, "--scenario", "regional", *SIZES, *FAST)
    shuffled = run_json(capsys, "--scenario", "regional", "--shuffle-seed", "9", *SIZES, *FAST)
    assert shuffled["cost_s"] == pytest.approx(plain["cost_s"], rel=1e-9)


def test_model_sizes_and_readable_table(capsys):
    assert (
        main(
            [
                "plan",
                "--scenario",
                "multi-university",
                "--model",
                "gpt3-xl",
                "--macro-batch-samples",
                "61",
                *FAST,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "activation 0.511705 GB" in text and "gradient 0.604299 GB" in text
    assert "rank mod 8" in text and "random (mean of 100)" in text


def test_compute_mode_and_plot(tmp_path, capsys):
    plot = tmp_path / "plots" / "best.png"
    out = run_json(capsys, "--scenario", "mixed-world", "--compute", *FAST, "--plot", str(plot))
    assert KEYS <= set(out)
    assert sum(out["layers_per_stage"]) == 24 and out["fits_memory"]
    even = out["alternatives"]["communication-only, even layers"]
    assert out["iteration_s"] <= even["iteration_s"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenario", "moon"], "unknown scenario 'moon'"),
        (["--scenario", "regional", "--compute"], "has no device tflops"),
        (["--scenario", "regional", "--model", "nope"], "unknown preset 'nope'"),
        (["--scenario-file", "/nonexistent/fleet.json"], "cannot read scenario file"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    assert main(["plan", *argv, *FAST]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_files_exit_2(tmp_path, capsys):
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"devices": 3, "latency_ms": [[0, 1, 2], [1, 0, 3], [2, 3, 0]],
                                 "bandwidth_gbps": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]}))  # fmt: skip
    assert main(["plan", "--scenario-file", str(fleet), *SIZES]) == 2
    assert "3 devices are not divisible into 8 stages" in capsys.readouterr().err
    layout = tmp_path / "layout.json"
    layout.write_text("[[0, 1]]")
    assert main(["plan", "--scenario", "spot", *SIZES, "--evaluate", str(layout)]) == 2
    assert "layout has 1 groups, expected 8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse rejects a negative size itself
        main(["plan", "--scenario", "spot", "--activation-gb", "-1"])
    assert exit_info.value.code == 2


def test_user_scenario_file_runs(tmp_path, capsys):
    fleet = tmp_path / "labs.json"
    fleet.write_text(json.dumps({
        "num_stages": 2, "devices": [{"site": "a"}] * 4 + [{"site": "b"}] * 4, "sites": ["a", "b"],
        "latency_ms": [[1, 30], [30, 1]], "bandwidth_gbps": [[10, 1], [1, 10]],
    }))  # fmt: skip
    out = run_json(capsys, "--scenario-file", str(fleet), *SIZES, *FAST)
    assert len(out["groups"]) == 2 and len(out["pipelines"]) == 4


def test_fleet_file_plans_end_to_end(capsys):
    from pathlib import Path

    example = str(Path(__file__).resolve().parents[2] / "examples" / "fleet.toml")
    out = run_json(capsys, "--fleet", example, "--num-stages", "4", *SIZES, *FAST)
    assert len(out["groups"]) == 4 and sorted(d for g in out["groups"] for d in g) == list(range(16))
    out = run_json(capsys, "--fleet", example, "--num-stages", "4", "--model", "tiny", "--compute", *FAST)
    assert out["fits_memory"] and len(out["layers_per_stage"]) == 4


def test_bad_fleet_files_exit_2_with_one_line(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[peers]]\ndevice = "t4"\ncount = 2\nuplink_mbit_s = -5\n')
    assert main(["plan", "--fleet", str(fleet), *SIZES]) == 2
    err = capsys.readouterr().err
    assert "peers[0]: uplink_mbit_s must be a positive number" in err and err.count("\n") == 1
    assert main(["plan", "--scenario", "spot", "--num-stages", "4", *SIZES]) == 2
    assert "--num-stages applies to --fleet" in capsys.readouterr().err
