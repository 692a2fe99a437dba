"""Mixed-GPU fleets: the communication scenarios' networks with real accelerators on them.

TFLOPS are vendor peak dense fp16/bf16 tensor throughput (consumer cards: with fp32 accumulation, as
mixed-precision training uses), memory is the card's. The compute-aware planner (`planner.hetero`)
applies a utilization factor to the peaks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from swarmtrain.planner.scenarios import (
    COMMUNICATION_SCENARIOS,
    Scenario,
    ScenarioError,
    regional,
    scenario_from_sites,
    uniform_site_links,
    world_wide,
)

# name: (peak dense fp16 TFLOPS, memory GB)
GPUS = {
    "A100-80GB": (312.0, 80.0),
    "V100-32GB": (125.0, 32.0),
    "T4": (65.0, 16.0),
    "RTX-3090": (71.0, 24.0),
    "RTX-4090": (165.0, 24.0),
    "RTX-3080": (59.5, 10.0),
}


def with_gpus(scenario: Scenario, name: str, gpu_of_site: dict[str, str]) -> Scenario:
    """The same network with each device's GPU chosen by its site."""
    gpu_names = tuple(gpu_of_site[site] for site in scenario.sites)
    tflops = np.array([GPUS[g][0] for g in gpu_names])
    memory_gb = np.array([GPUS[g][1] for g in gpu_names])
    return replace(scenario, name=name, tflops=tflops, memory_gb=memory_gb, gpu_names=gpu_names)


def mixed_regional() -> Scenario:
    """`regional` with A100s in Virginia, V100s in Oregon, T4s in California and RTX 3090s in Ohio."""
    gpus = {"virginia": "A100-80GB", "oregon": "V100-32GB", "california": "T4", "ohio": "RTX-3090"}
    return with_gpus(regional(), "mixed-regional", gpus)


def mixed_world() -> Scenario:
    """`world-wide` with a different accelerator in each city, from A100s to 10 GB consumer cards."""
    gpus = {
        "oregon": "A100-80GB", "virginia": "A100-80GB", "ohio": "V100-32GB", "tokyo": "V100-32GB",
        "seoul": "RTX-4090", "london": "T4", "frankfurt": "RTX-3090", "ireland": "RTX-3080",
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
    home_cards = ("RTX-4090", "RTX-3090", "RTX-3080", "RTX-3090")
    gpus = {name: "A100-80GB" for name in names[:4]}
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
