"""Generated fleets of any size, as fleet-file data, for planning at the scale of real fleets.

Three shapes, each built as the dict a fleet file parses to (`fleet_spec_from_dict`), so the devices
get their speed, memory and access links from the shared device table exactly as `plan --fleet` would:

- `one-site`: every device an A100 in one datacenter (0.1 ms, 100 Gbit/s);
- `four-places`: a quarter each of A100s and V100s in two datacenters, T4s in a cloud region and RTX
  4090s at homes, with measured-looking latency and path caps between the places (the fleet of issue
  41: the homes' 300 Mbit/s uplinks cap every link that touches them);
- `volunteers`: a quarter of the devices are A100s on 8-GPU machines of one datacenter (100 Gbit/s
  inside a machine, 25 across), the rest volunteers at homes in three regions, half of each region RTX
  4090s on 1 Gbit/s uplinks and half RTX 3080s on 100 Mbit/s.

Sizes must be multiples of 32 (whole machines and equal halves of every region).
"""

from __future__ import annotations

from swarmtrain.planner.fleet_scenario import scenario_from_fleet_spec
from swarmtrain.planner.fleet_spec import fleet_spec_from_dict
from swarmtrain.planner.scenarios import Scenario, ScenarioError

FLEET_SHAPES = ("one-site", "four-places", "volunteers")
GPUS_PER_MACHINE = 8
HOME_REGIONS = ("homes-us", "homes-eu", "homes-asia")

FOUR_PLACES = ("dc-a100", "dc-v100", "cloud-t4", "homes")
FOUR_PLACES_LATENCY_MS = [[0.1, 12, 30, 40], [12, 0.1, 25, 45], [30, 25, 0.5, 35], [40, 45, 35, 25]]
FOUR_PLACES_PATH_MBIT_S = [
    [100_000, 5_000, 2_000, 1_000],
    [5_000, 40_000, 2_000, 1_000],
    [2_000, 2_000, 10_000, 1_000],
    [1_000, 1_000, 1_000, 1_000],
]


def generated_fleet(shape: str, num_devices: int, num_stages: int) -> Scenario:
    """A Scenario of `num_devices` devices of one of `FLEET_SHAPES`, cut into `num_stages` stages."""
    if shape not in FLEET_SHAPES:
        raise ScenarioError(f"unknown fleet shape {shape!r} (choose from: {', '.join(FLEET_SHAPES)})")
    if num_devices <= 0 or num_devices % 32:
        raise ScenarioError(f"a generated fleet needs a positive multiple of 32 devices, got {num_devices}")
    raw = {"one-site": _one_site, "four-places": _four_places, "volunteers": _volunteers}[shape](num_devices)
    return scenario_from_fleet_spec(fleet_spec_from_dict(raw), f"{shape}-{num_devices}", num_stages)


def _one_site(num_devices: int) -> dict:
    return {
        "locations": ["dc"],
        "latency_ms": [[0.1]],
        "bandwidth_mbit_s": [[100_000]],
        "peers": [{"id": "dc", "device": "a100", "count": num_devices, "location": "dc"}],
    }


def _four_places(num_devices: int) -> dict:
    gpus = ("a100", "v100", "t4", "rtx4090")
    peers = [
        {"id": place, "device": gpu, "count": num_devices // 4, "location": place}
        for place, gpu in zip(FOUR_PLACES, gpus, strict=True)
    ]
    return {
        "locations": list(FOUR_PLACES),
        "latency_ms": FOUR_PLACES_LATENCY_MS,
        "bandwidth_mbit_s": FOUR_PLACES_PATH_MBIT_S,
        "peers": peers,
    }


def _volunteers(num_devices: int) -> dict:
    machines = [f"dc-m{m}" for m in range(num_devices // 4 // GPUS_PER_MACHINE)]
    names = machines + list(HOME_REGIONS)
    region_latency_ms = {
        ("homes-us", "homes-eu"): 90,
        ("homes-us", "homes-asia"): 150,
        ("homes-eu", "homes-asia"): 200,
    }
    dc_latency_ms = {"homes-us": 20, "homes-eu": 90, "homes-asia": 150}
    count = len(names)
    latency = [[0.0] * count for _ in range(count)]
    bandwidth = [[0.0] * count for _ in range(count)]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            latency[i][j], bandwidth[i][j] = _volunteer_link(a, b, region_latency_ms, dc_latency_ms)
    peers = [
        {"id": machine, "device": "a100", "count": GPUS_PER_MACHINE, "location": machine}
        for machine in machines
    ]
    half = num_devices * 3 // 4 // len(HOME_REGIONS) // 2
    for region in HOME_REGIONS:
        peers.append(
            {
                "id": f"{region}-fast",
                "device": "rtx4090",
                "count": half,
                "location": region,
                "uplink_mbit_s": 1000,
            }
        )
        peers.append(
            {
                "id": f"{region}-slow",
                "device": "rtx3080",
                "count": half,
                "location": region,
                "uplink_mbit_s": 100,
            }
        )
    return {"locations": names, "latency_ms": latency, "bandwidth_mbit_s": bandwidth, "peers": peers}


def _volunteer_link(a: str, b: str, region_latency_ms: dict, dc_latency_ms: dict) -> tuple[float, float]:
    """(ms, path Mbit/s) between two locations of the volunteer fleet."""
    a_home, b_home = a.startswith("homes"), b.startswith("homes")
    if not a_home and not b_home:
        return (0.0, 100_000.0) if a == b else (0.1, 25_000.0)
    if a_home and b_home:
        return (
            (20.0, 1_000.0)
            if a == b
            else (
                float(
                    region_latency_ms[(a, b)] if (a, b) in region_latency_ms else region_latency_ms[(b, a)]
                ),
                500.0,
            )
        )
    return float(dc_latency_ms[a if a_home else b]), 1_000.0
