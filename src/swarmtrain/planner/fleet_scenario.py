"""The planner's view of a fleet file: `swarmtrain plan --fleet FILE.toml` plans the fleet the simulator runs.

Each peer of the file (counts expanded, in file order) is one device of the Scenario, at the site named
by its location, with its device type's *peak* TFLOPS (`planner.hetero` applies its utilization) and
its memory. The planner's model has one symmetric link per pair of devices, so the link between i and j
is the narrowest of the path cap between their locations and the access links a flow uses either way
(i's uplink to j's downlink, j's uplink to i's downlink), in Gbit/s. The simulator instead shares each
access link among all of a peer's flows; the planner, like DT-FM, does not model that contention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from swarmtrain.planner.fleet_spec import FleetSpec, load_fleet_spec
from swarmtrain.planner.scenario_file import parse_num_stages
from swarmtrain.planner.scenarios import DEFAULT_NUM_STAGES, Scenario, ScenarioError

MBIT_PER_GBIT = 1000.0


def load_fleet_scenario(path: str | Path, num_stages: int = DEFAULT_NUM_STAGES) -> Scenario:
    spec = load_fleet_spec(path)
    try:
        return scenario_from_fleet_spec(spec, Path(path).stem, num_stages)
    except ScenarioError as exc:
        raise ScenarioError(f"fleet file {path}: {exc} (choose the stages with --num-stages)") from None


def scenario_from_fleet_spec(spec: FleetSpec, name: str, num_stages: int = DEFAULT_NUM_STAGES) -> Scenario:
    num_stages = parse_num_stages(num_stages, len(spec.peers))
    latency_ms, bandwidth_gbps = device_links(spec)
    # A device without accelerator memory (cpu) computes out of host memory: that is what it can hold.
    memory_gb = [p.memory_gb if p.memory_gb > 0 else p.host_memory_gb for p in spec.peers]
    return Scenario(
        name=name,
        latency_ms=latency_ms,
        bandwidth_gbps=bandwidth_gbps,
        num_stages=num_stages,
        sites=tuple(spec.locations[p.location] for p in spec.peers),
        tflops=np.array([p.peak_tflops for p in spec.peers]),
        memory_gb=np.array(memory_gb, dtype=float),
        gpu_names=tuple(p.device for p in spec.peers),
    )


def device_links(spec: FleetSpec) -> tuple[np.ndarray, np.ndarray]:
    """Device x device latency (ms) and bandwidth (Gbit/s); the diagonal (a device with itself) unused."""
    where = np.array([p.location for p in spec.peers], dtype=np.intp)
    latency = np.array(spec.latency_ms, dtype=float)[np.ix_(where, where)]
    path = np.array(spec.bandwidth_mbit_s, dtype=float)[np.ix_(where, where)]
    up = np.array([p.uplink_mbit_s for p in spec.peers])
    down = np.array([p.downlink_mbit_s for p in spec.peers])
    access = np.minimum(np.minimum.outer(up, down), np.minimum.outer(down, up))
    bandwidth = np.minimum(path, access) / MBIT_PER_GBIT
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    return latency, bandwidth
