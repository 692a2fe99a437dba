"""Built-in fleets as the issue specifies them, and user scenario files with errors that name the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from swarmtrain.cli.main import main
from swarmtrain.config.errors import UserError
from swarmtrain.planner.fleets import ALL_SCENARIOS, MIXED_SCENARIOS, builtin_scenario
from swarmtrain.planner.scenario_file import load_scenario_file, scenario_from_dict
from swarmtrain.planner.scenarios import ScenarioError, relabel

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(ALL_SCENARIOS))
def test_builtin_fleets_are_well_formed(name):
    scenario = builtin_scenario(name)
    assert (scenario.num_devices, scenario.num_stages, scenario.group_size) == (64, 8, 8)
    off = ~np.eye(64, dtype=bool)
    assert np.array_equal(scenario.latency_ms, scenario.latency_ms.T)
    assert np.array_equal(scenario.bandwidth_gbps, scenario.bandwidth_gbps.T)
    assert (scenario.latency_ms[off] >= 0).all() and (scenario.bandwidth_gbps[off] > 0).all()
    assert scenario.has_compute == (name in MIXED_SCENARIOS)


def test_links_as_published():
    spot = builtin_scenario("spot")
    assert spot.bandwidth_gbps[0, 3] == 100 and spot.bandwidth_gbps[3, 4] == 1.25
    assert spot.bandwidth_gbps[32, 33] == 1.25
    uni = builtin_scenario("multi-university")
    assert (uni.latency_ms[0, 31], uni.bandwidth_gbps[0, 31]) == (1, 5)
    assert (uni.latency_ms[0, 32], uni.bandwidth_gbps[0, 32]) == (11, 1.12)
    regional = builtin_scenario("regional")
    assert (regional.latency_ms[0, 16], regional.bandwidth_gbps[0, 16]) == (67, 1.15)  # Virginia-Oregon
    assert (regional.latency_ms[40, 63], regional.bandwidth_gbps[40, 63]) == (52, 1.02)  # California-Ohio
    world = builtin_scenario("world-wide")
    assert (world.latency_ms[24, 32], world.bandwidth_gbps[24, 32]) == (34, 1.10)  # Tokyo-Seoul
    assert (world.latency_ms[0, 63], world.bandwidth_gbps[0, 63]) == (124, 0.482)  # Oregon-Ireland
    assert (world.latency_ms[40, 41], world.bandwidth_gbps[40, 41]) == (5, 2)  # inside London


def test_relabel_is_a_seeded_permutation():
    scenario = builtin_scenario("mixed-world")
    shuffled, old_of_new = relabel(scenario, seed=4)
    again, same = relabel(scenario, seed=4)
    assert np.array_equal(old_of_new, same) and sorted(old_of_new) == list(range(64))
    i, j = 5, 40
    assert shuffled.latency_ms[i, j] == scenario.latency_ms[old_of_new[i], old_of_new[j]]
    assert shuffled.tflops[i] == scenario.tflops[old_of_new[i]]
    assert shuffled.gpu_names[j] == scenario.gpu_names[old_of_new[j]]


def site_fleet() -> dict:
    return {
        "name": "two-labs",
        "num_stages": 2,
        "devices": [{"site": "a", "tflops": 100, "memory_gb": 40}] * 2
        + [{"site": "b", "tflops": 50, "memory_gb": 16}] * 2,
        "sites": ["a", "b"],
        "latency_ms": [[1, 30], [30, 2]],
        "bandwidth_gbps": [[10, 1], [1, 5]],
    }


def test_site_based_file_expands_to_devices(tmp_path):
    path = tmp_path / "labs.json"
    path.write_text(json.dumps(site_fleet()))
    scenario = load_scenario_file(path)
    assert (scenario.name, scenario.num_devices, scenario.num_stages) == ("two-labs", 4, 2)
    assert (
        scenario.latency_ms[0, 1] == 1 and scenario.latency_ms[2, 3] == 2 and scenario.latency_ms[1, 2] == 30
    )
    assert scenario.bandwidth_gbps[0, 1] == 10 and scenario.bandwidth_gbps[0, 3] == 1
    assert list(scenario.tflops) == [100, 100, 50, 50]
    assert list(scenario.memory_gb) == [40, 40, 16, 16]


def test_the_documented_example_file_loads_and_plans(capsys):
    """examples/scenario.json, shown and documented in the README, through the real parser and `plan`."""
    path = ROOT / "examples" / "scenario.json"
    scenario = load_scenario_file(path)
    assert (scenario.name, scenario.num_devices, scenario.num_stages) == ("two-labs", 4, 2)
    assert scenario.sites == ("lab-a", "lab-a", "lab-b", "lab-b")
    assert scenario.latency_ms[0, 1] == 0.5 and scenario.latency_ms[1, 2] == 30
    assert scenario.bandwidth_gbps[2, 3] == 10 and scenario.bandwidth_gbps[0, 3] == 1
    # a100 and rtx3090 from the device table; the last device gives its own numbers
    assert scenario.tflops.tolist() == [312.0, 312.0, 71.0, 71.0]
    assert scenario.memory_gb.tolist() == [40.0, 40.0, 24.0, 24.0]
    readme_blocks = re.findall(r"```json\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert json.loads(path.read_text()) in [json.loads(block) for block in readme_blocks]
    argv = ["plan", "--scenario-file", str(path), "--model", "tiny", "--compute", "--budget-evals", "100"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(d for group in out["groups"] for d in group) == [0, 1, 2, 3] and out["fits_memory"]


def device_fleet(**changes) -> dict:
    data = {
        "devices": 4,
        "num_stages": 2,
        "latency_ms": [[0, 1, 9, 9], [1, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, 0]],
        "bandwidth_gbps": [[0, 5, 1, 1], [5, 0, 1, 1], [1, 1, 0, 5], [1, 1, 5, 0]],
    }
    data.update(changes)
    return data


def test_device_matrix_diagonal_is_ignored():
    scenario = scenario_from_dict(device_fleet())
    assert scenario.bandwidth_gbps[0, 0] == np.inf and scenario.bandwidth_gbps[0, 1] == 5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"latency_ms": [[0, 1, 9, 9], [2, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, 0]]}, r"latency_ms is asymmetric: \[0\]\[1\]"),
        ({"latency_ms": [[0, -1, 9, 9], [-1, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, 0]]}, r"latency_ms\[0\]\[1\] is negative"),
        ({"bandwidth_gbps": [[0, 5, 1, 1], [5, 0, 1, 1], [1, 1, 0, -5], [1, 1, -5, 0]]}, r"bandwidth_gbps\[2\]\[3\] must be positive"),
        ({"bandwidth_gbps": [[0, 5, 1], [5, 0, 1], [1, 1, 0]]}, "bandwidth_gbps has 3 rows, expected 4"),
        ({"latency_ms": [[0, 1, 9], [1, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, 0]]}, "latency_ms row 0 has 3 entries, expected 4"),
        ({"num_stages": 3}, "4 devices are not divisible into 3 stages"),
        ({"num_stages": 0}, "num_stages' must be a positive integer"),
        ({"devices": 0}, "'devices' must be positive"),
        ({"latency_ms": [[0, 1, 9, 9], [1, 0, 9, 9], [9, 9, 0, 1], [9, 9, 1, "x"]]}, r"latency_ms\[3\]\[3\] must be a finite number"),
        ({"speed": 3}, "unknown scenario key 'speed'"),
        ({"devices": [{"tflops": 1, "memory_gb": 1}] * 3 + [{"tflops": 1}]}, r"devices\[3\] has no 'memory_gb'"),
        ({"devices": [{"tflops": -1}] * 4}, r"devices\[0\].tflops must be a positive number"),
        ({"devices": [{"site": "a"}] * 4, "sites": ["b"]}, "latency_ms has 4 rows, expected 1 \\(one per site\\)"),
    ],
)  # fmt: skip
def test_scenario_validation_errors(changes, message):
    with pytest.raises(ScenarioError, match=message) as info:
        scenario_from_dict(device_fleet(**changes))
    assert isinstance(info.value, UserError)
    assert "\n" not in str(info.value)


def test_a_known_gpu_label_supplies_speed_and_memory_from_the_device_table():
    devices = [{"gpu": "A100"}, {"gpu": "t4"}, {"gpu": "t4", "tflops": 30.0}, {"gpu": "rtx4090"}]
    scenario = scenario_from_dict(device_fleet(devices=devices))
    assert scenario.gpu_names == ("A100", "t4", "t4", "rtx4090")
    assert scenario.tflops.tolist() == [312.0, 65.0, 30.0, 165.0]  # the table's peak; own numbers win
    assert scenario.memory_gb.tolist() == [40.0, 16.0, 16.0, 24.0]
    # a label the table does not know supplies nothing: the numbers must then be given
    with pytest.raises(ScenarioError, match=r"devices\[0\] has no 'tflops'"):
        scenario_from_dict(device_fleet(devices=[{"gpu": "lab-box"}] + devices[1:]))


def test_site_errors():
    data = site_fleet()
    data["devices"] = data["devices"][:3] + [{"site": "c", "tflops": 1, "memory_gb": 1}]
    with pytest.raises(ScenarioError, match=r"devices\[3\] names unknown site 'c'"):
        scenario_from_dict(data)
    data = site_fleet()
    data["bandwidth_gbps"] = [[0, 1], [1, 5]]  # the diagonal is a real link when sites are given
    with pytest.raises(ScenarioError, match=r"bandwidth_gbps\[0\]\[0\] must be positive"):
        scenario_from_dict(data)


def test_file_errors(tmp_path):
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        load_scenario_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScenarioError, match="is not valid JSON"):
        load_scenario_file(bad)
    with pytest.raises(ScenarioError, match="unknown scenario 'moon'"):
        builtin_scenario("moon")
