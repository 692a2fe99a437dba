"""Mixed-GPU fleets: the communication scenarios' networks with real accelerators on them.

Speed and memory come from the device table shared with the simulator (`config.devices`): the
scenarios carry each device's vendor *peak* dense fp16 TFLOPS and its memory; the compute-aware planner
(`planner.hetero`) applies its utilization factor to the peaks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from swarmtrain.config.devices import device_type
from swarmtrain.planner.scenarios import (
    COMMUNICATION_SCENARIOS,
    Scenario,
    ScenarioError,
    regional,
    scenario_from_sites,
    uniform_site_links,
    world_wide,
)


def with_gpus(scenario: Scenario, name: str, gpu_of_site: dict[str, str]) -> Scenario:
    """The same network with each device's GPU (a `config.devices` name or alias) chosen by its site."""
    devices = [device_type(gpu_of_site[site]) for site in scenario.sites]
    tflops = np.array([d.peak_tflops for d in devices])
    memory_gb = np.array([d.memory_gb for d in devices], dtype=float)
    gpu_names = tuple(d.name for d in devices)
    return replace(scenario, name=name, tflops=tflops, memory_gb=memory_gb, gpu_names=gpu_names)


def mixed_regional() -> Scenario:
    """`regional` with A100s in Virginia, V100s in Oregon, T4s in California and RTX 3090s in Ohio."""
    gpus = {"virginia": "a100-80gb", "oregon": "v100-32gb", "california": "t4", "ohio": "rtx3090"}
    return with_gpus(regional(), "mixed-regional", gpus)


def mixed_world() -> Scenario:
    """`world-wide` with a different accelerator in each city, from A100s to 10 GB consumer cards."""
    gpus = {
        "oregon": "a100-80gb", "virginia": "a100-80gb", "ohio": "v100-32gb", "tokyo": "v100-32gb",
        "seoul": "rtx4090", "london": "t4", "frankfurt": "rtx3090", "ireland": "rtx3080",
    }  # fmt: skip
    return with_gpus(world_wide(), "mixed-world", gpus)


def mixed_volunteers() -> Scenario:
    """32 A100s on 4 machines of 8 in one datacenter (100 Gbit/s inside a machine, 25 Gbit/s across,
    0.1 ms) and 32 volunteers on home connections, each its own site: 0.5 Gbit/s and 20 ms to the
    datacenter, 0.3 Gbit/s and 40 ms to each other. Volunteers bring RTX 4090, 3090 and 3080 cards."""
    num_sites = 4 + 32
    latency, bandwidth = uniform_site_links(num_sites, (0.0, 100.0), (40.0, 0.3))
    latency[:4, :4], bandwidth[:4, :4] = 0.1, 25.0
    latency[:4, 4:] = latency[4:, :4] = 20.0
    bandwidth[:4, 4:] = bandwidth[4:, :4] = 0.5
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, 100.0)
    device_sites = [i // 8 if i < 32 else 4 + (i - 32) for i in range(64)]
    names = [f"dc-machine{m}" for m in range(4)] + [f"home{v}" for v in range(32)]
    scenario = scenario_from_sites("mixed-volunteers", device_sites, names, (latency, bandwidth))
    home_cards = ("rtx4090", "rtx3090", "rtx3080", "rtx3090")
    gpus = {name: "a100-80gb" for name in names[:4]}
    gpus.update({name: home_cards[v % len(home_cards)] for v, name in enumerate(names[4:])})
    return with_gpus(scenario, "mixed-volunteers", gpus)


MIXED_SCENARIOS = {
    "mixed-regional": mixed_regional,
    "mixed-world": mixed_world,
    "mixed-volunteers": mixed_volunteers,
}

ALL_SCENARIOS = {**COMMUNICATION_SCENARIOS, **MIXED_SCENARIOS}


def builtin_scenario(name: str) -> Scenario:
    try:
        return ALL_SCENARIOS[name]()
    except KeyError:
        raise ScenarioError(f"unknown scenario {name!r} (choose from: {', '.join(ALL_SCENARIOS)})") from None
