"""One fleet file for the planner and the simulator: the same devices, speeds, memory and links."""

from pathlib import Path

import numpy as np
import pytest

from swarmtrain.config.devices import DEVICES
from swarmtrain.planner.fleet_scenario import load_fleet_scenario, scenario_from_fleet_spec
from swarmtrain.planner.fleet_spec import FleetError, fleet_spec_from_dict
from swarmtrain.planner.scenarios import ScenarioError
from swarmtrain.sim.entities import GB, MBIT_S
from swarmtrain.sim.fleet import FleetError as SimFleetError
from swarmtrain.sim.fleet_file import load_fleet_file

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"
GBIT_S = 1e9 / 8


def test_example_file_gives_both_sides_the_same_devices():
    scenario = load_fleet_scenario(EXAMPLE, num_stages=4)
    fleet = load_fleet_file(EXAMPLE)
    assert scenario.num_devices == fleet.num_peers == 16 and scenario.group_size == 4
    for i, peer in enumerate(fleet.peers):
        device = DEVICES[peer.device]
        assert scenario.gpu_names[i] == peer.device
        assert scenario.sites[i] == fleet.locations.names[peer.location]
        # The planner takes the peak, the simulator the sustained figure of the same table entry.
        assert scenario.tflops[i] == device.peak_tflops and peer.tflops == device.sustained_tflops
        assert scenario.memory_gb[i] * GB == peer.memory_bytes
    assert {scenario.gpu_names[i] for i in range(4, 8)} == {"v100-32gb"}  # written as an alias


def test_links_are_the_path_cap_or_the_access_links_whichever_is_narrower():
    scenario = load_fleet_scenario(EXAMPLE, num_stages=4)
    fleet = load_fleet_file(EXAMPLE)
    peers, locations = fleet.peers, fleet.locations
    for i, j in [(0, 1), (0, 4), (0, 8), (8, 12), (12, 13), (4, 15)]:
        a, b = peers[i], peers[j]
        assert scenario.latency_ms[i, j] / 1e3 == pytest.approx(locations.latency_s[a.location][b.location])
        narrowest = min(
            locations.bandwidth_bytes_per_s[a.location][b.location],
            a.uplink_bytes_per_s, b.downlink_bytes_per_s, b.uplink_bytes_per_s, a.downlink_bytes_per_s,
        )  # fmt: skip
        assert scenario.bandwidth_gbps[i, j] * GBIT_S == pytest.approx(narrowest)
    assert scenario.bandwidth_gbps[8, 12] == pytest.approx(100 * MBIT_S / GBIT_S)  # gamer's own 100 Mbit/s up
    assert np.array_equal(scenario.bandwidth_gbps, scenario.bandwidth_gbps.T)


def test_unlimited_paths_and_cpu_peers():
    spec = fleet_spec_from_dict({"peers": [{"device": "cpu", "count": 2}, {"device": "T4", "count": 2}]})
    scenario = scenario_from_fleet_spec(spec, "home", num_stages=2)
    assert scenario.sites == ("local",) * 4
    assert scenario.bandwidth_gbps[0, 2] == pytest.approx(2.0)  # the T4 machines' 2 Gbit/s, no path cap
    # A CPU holds layers in host memory; its speed is the table's nominal figure.
    assert list(scenario.memory_gb) == [8.0, 8.0, 16.0, 16.0]
    assert scenario.tflops[0] == DEVICES["cpu"].peak_tflops


def test_tflops_override_reaches_the_planner_as_a_peak():
    spec = fleet_spec_from_dict({"peers": [{"device": "v100", "tflops": 25}, {"device": "v100"}]})
    scenario = scenario_from_fleet_spec(spec, "x", num_stages=1)
    assert list(scenario.tflops) == [pytest.approx(62.5), 125.0]  # half the V100's sustained speed


def test_errors_name_the_file_entry_and_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[peers]]\ndevice = "a100"\n[[peers]]\ndevice = "h900"\n')
    with pytest.raises(
        FleetError, match=r"fleet file .*bad.toml: peers\[1\]: device must be one of .*'h900'"
    ):
        load_fleet_scenario(path)
    assert FleetError is SimFleetError  # one error class on both sides
    path.write_text('[[peers]]\ndevice = "a100"\ncount = 3\n')
    with pytest.raises(ScenarioError, match="3 devices are not divisible into 2 stages.*--num-stages"):
        load_fleet_scenario(path, num_stages=2)
