"""Fleets (synthetic, scenarios, files), measured compute times and the per-peer cost model."""

import math
from collections import Counter

import pytest

from swarmtrain.config import get_preset, sizes
from swarmtrain.sim.costs import compute_s_per_sample, full_model_s_per_sample
from swarmtrain.sim.entities import DEVICE_TYPES, GB, PeerSpec
from swarmtrain.sim.fleet import (
    FleetError,
    load_compute_times,
    scenario_fleet,
    synthetic_fleet,
    with_links,
)
from swarmtrain.sim.fleet_file import fleet_from_dict, load_fleet_file
from swarmtrain.sim.runner import costs_for

pytestmark = pytest.mark.unit

GPT3XL = costs_for(get_preset("gpt3-xl"))


def test_synthetic_fleet_has_the_documented_mix_and_is_seeded():
    fleet = synthetic_fleet(2000, seed=0)
    share = Counter(p.device for p in fleet.peers)
    assert share["t4"] / 2000 == pytest.approx(0.30, abs=0.03)
    assert share["a100"] / 2000 == pytest.approx(0.05, abs=0.015)
    assert len({p.location for p in fleet.peers}) == 8
    assert fleet == synthetic_fleet(2000, seed=0) and fleet != synthetic_fleet(2000, seed=1)
    with pytest.raises(FleetError):
        synthetic_fleet(0)


def test_scenario_fleet_follows_the_planner_matrices():
    fleet = scenario_fleet("world-wide")
    assert fleet.num_peers == 64 and len(fleet.locations.names) == 8
    tokyo, london = fleet.locations.index("tokyo"), fleet.locations.index("london")
    assert fleet.locations.latency_s[tokyo][london] == pytest.approx(0.210)
    assert fleet.locations.bandwidth_bytes_per_s[tokyo][london] == pytest.approx(0.366e9 / 8)
    datacenter = scenario_fleet("datacenter")
    assert datacenter.peers[0].uplink_bytes_per_s == pytest.approx(100e9 / 8)  # its NVLink-class link
    with pytest.raises(FleetError, match="unknown scenario"):
        scenario_fleet("moon")


def test_with_links_overrides_bandwidth_and_latency():
    fleet = with_links(synthetic_fleet(10), 500e6 / 8, 0.1)
    assert {p.uplink_bytes_per_s for p in fleet.peers} == {500e6 / 8}
    assert {v for row in fleet.locations.latency_s for v in row} == {0.1}
    assert {v for row in fleet.locations.bandwidth_bytes_per_s for v in row} == {math.inf}


def test_compute_time_follows_flops_memory_and_swapping():
    t4 = PeerSpec.from_device("t", DEVICE_TYPES["t4"], 0)
    times = compute_s_per_sample(t4, GPT3XL)
    assert times[1] == pytest.approx(GPT3XL.flops_per_sample[1] / 25e12)
    tiny_gpu = PeerSpec(**{**t4.__dict__, "memory_bytes": 1 * GB})  # too small: swaps from host memory
    swap = compute_s_per_sample(tiny_gpu, GPT3XL)[1]
    streamed = 2 * GPT3XL.params[1] * sizes.FP16_BYTES / t4.host_to_device_bytes_per_s
    assert swap == pytest.approx(max(times[1], streamed / GPT3XL.micro_batch_size))
    no_host = PeerSpec(**{**tiny_gpu.__dict__, "host_memory_bytes": 1 * GB})
    assert compute_s_per_sample(no_host, GPT3XL)[1] == math.inf
    assert full_model_s_per_sample(no_host, GPT3XL) == math.inf
    # 21 GB of training state do not fit a T4: the model streams from host memory, hidden behind compute
    assert full_model_s_per_sample(t4, GPT3XL) == pytest.approx(sum(times))


def test_fleet_file_expands_counts_and_overrides(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(
        'locations = ["us", "eu"]\nlatency_ms = [[5, 80], [80, 5]]\nbandwidth_mbit_s = [[10000, 500], [500, 10000]]\n'
        '[[peers]]\ndevice = "a100"\ncount = 2\nid = "cloud"\nlocation = "us"\n'
        '[[peers]]\ndevice = "rtx3090"\nlocation = "eu"\nuplink_mbit_s = 50\ncompute_s_per_sample = [0.5, 0.6]\n'
    )
    fleet = load_fleet_file(path)
    assert [p.peer_id for p in fleet.peers] == ["cloud-0", "cloud-1", "rtx30902"]
    home = fleet.peers[2]
    assert home.location == 1 and home.uplink_bytes_per_s == pytest.approx(50e6 / 8)
    assert home.compute_s_per_sample == (0.5, 0.6)
    assert fleet.locations.latency_s[0][1] == pytest.approx(0.08)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({}, "at least one"),
        ({"peers": [{"device": "quantum"}]}, "device must be one of"),
        ({"peers": [{"device": "t4", "location": "mars"}]}, "unknown location 'mars'"),
        ({"peers": [{"device": "t4", "count": 0}]}, "count must be a positive integer"),
        ({"peers": [{"device": "t4", "tflops": -1}]}, "tflops must be a positive number"),
        ({"peers": [{"device": "t4", "colour": "red"}]}, "unknown field"),
        ({"peers": [{"device": "t4", "id": "x"}, {"device": "t4", "id": "x"}]}, "duplicate peer id"),
        ({"locations": ["a", "b"], "latency_ms": [[0, 1], [2, 0]], "peers": [{"device": "t4"}]}, "symmetric"),
        ({"locations": ["a", "b"], "latency_ms": [[0, 1]], "peers": [{"device": "t4"}]}, "2x2 matrix"),
        ({"locations": ["a"], "bandwidth_mbit_s": [[0]], "peers": [{"device": "t4"}]}, "positive number"),
        ({"peers": [{"device": "t4", "compute_s_per_sample": [0.1, -2]}]}, "compute_s_per_sample"),
        ({"servers": []}, "unknown key"),
        ({"peers": [{"device": "t4", "stage": -1}]}, "stage must be a stage index"),
        ({"peers": [{"device": "t4", "peak_tflops": "fast"}]}, r"peers\[0\]: peak_tflops must be a positive"),
        ({"peers": [{"device": "t4"}, {"device": "A100-90GB"}]}, r"peers\[1\]: device must be one of"),
    ],
)
def test_fleet_file_errors_say_what_is_wrong(raw, message):
    with pytest.raises(FleetError, match=message):
        fleet_from_dict(raw)


def test_fleet_file_takes_aliases_and_either_tflops_figure():
    fleet = fleet_from_dict(
        {"peers": [
            {"device": "A100-80GB"},
            {"device": "t4", "peak_tflops": 130},  # twice the T4's peak: twice its sustained speed
            {"device": "t4", "tflops": 10},
        ]}
    )  # fmt: skip
    big, fast_t4, slow_t4 = fleet.peers
    assert (big.peer_id, big.device, big.tflops, big.memory_bytes) == (
        "a100-80gb0",
        "a100-80gb",
        120.0,
        80 * GB,
    )
    assert fast_t4.tflops == pytest.approx(2 * DEVICE_TYPES["t4"].sustained_tflops)
    assert slow_t4.tflops == 10.0


def test_fleet_file_that_is_not_toml(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text("peers = [")
    with pytest.raises(FleetError, match="not valid TOML"):
        load_fleet_file(path)


def test_measured_compute_times_file(tmp_path):
    fleet = synthetic_fleet(3, seed=0)
    path = tmp_path / "times.csv"
    path.write_text("peer,stage,seconds_per_sample\np0,0,0.25\np0,1,0.5\np2,1,0.125\n")
    measured = load_compute_times(path, fleet, num_stages=2)
    assert measured.peers[0].compute_s_per_sample == (0.25, 0.5)
    assert measured.peers[1].compute_s_per_sample is None
    assert measured.peers[2].compute_s_per_sample == (None, 0.125)
    tiny = costs_for(get_preset("tiny"))
    derived = compute_s_per_sample(fleet.peers[2], tiny)
    assert compute_s_per_sample(measured.peers[2], tiny) == (derived[0], 0.125)
    for text, message in [
        ("peer,stage\n", "header"),
        ("peer,stage,seconds_per_sample\nzz,0,1\n", "unknown peer"),
        ("peer,stage,seconds_per_sample\np0,5,1\n", "stage 5 outside 0..1"),
        ("peer,stage,seconds_per_sample\np0,0,-1\n", "must be positive"),
        ("peer,stage,seconds_per_sample\np0,x,1\n", "must be an integer"),
    ]:
        path.write_text(text)
        with pytest.raises(FleetError, match=message):
            load_compute_times(path, fleet, num_stages=2)
