"""Device fleets as plain data: pairwise latency (ms) and bandwidth (Gbit/s), optionally compute and memory.

The five communication scenarios are the ones the DT-FM scheduler was evaluated on (Yuan et al. 2022):
64 devices, 8 stages of 8 devices. Every fleet is described by *sites* (a machine, a campus, a region):
each device sits at one site, and the link between two devices is the link between their sites (the
diagonal of the site matrices is the link between two devices of the same site). The mixed-GPU fleets of
`planner.fleets` add per-device speed and memory on top of the same networks.

`relabel` shuffles device indices (a planner must not care how devices are numbered) and
`scenario_from_dict` / `load_scenario_file` read user fleets with errors that name what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from swarmtrain.config.errors import UserError
from swarmtrain.utils.rng import make_rng

DEFAULT_NUM_STAGES = 8


class ScenarioError(UserError, ValueError):
    """A scenario (built in or from a file) that cannot be planned; the message names the problem."""


@dataclass(frozen=True, eq=False)
class Scenario:
    """A fleet: `latency_ms[i, j]` and `bandwidth_gbps[i, j]` between devices i and j (symmetric).

    `tflops` (sustained-able peak, dense fp16) and `memory_gb` per device are optional; only the
    compute-aware planner (`planner.hetero`) needs them. `sites[i]` names where device i is.
    """

    name: str
    latency_ms: np.ndarray
    bandwidth_gbps: np.ndarray
    num_stages: int = DEFAULT_NUM_STAGES
    sites: tuple[str, ...] = ()
    tflops: np.ndarray | None = None
    memory_gb: np.ndarray | None = None
    gpu_names: tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        return int(self.latency_ms.shape[0])

    @property
    def group_size(self) -> int:
        """D_DP: devices per stage group (= number of parallel pipelines)."""
        return self.num_devices // self.num_stages

    @property
    def has_compute(self) -> bool:
        return self.tflops is not None and self.memory_gb is not None


def expand_sites(
    device_sites: Sequence[int], site_latency_ms: np.ndarray, site_bandwidth_gbps: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Device x device matrices from site x site ones; the diagonal (a device with itself) is unused."""
    idx = np.asarray(device_sites, dtype=np.intp)
    latency = np.asarray(site_latency_ms, dtype=float)[np.ix_(idx, idx)]
    bandwidth = np.asarray(site_bandwidth_gbps, dtype=float)[np.ix_(idx, idx)]
    np.fill_diagonal(latency, 0.0)
    np.fill_diagonal(bandwidth, np.inf)
    return latency, bandwidth


def uniform_site_links(num_sites: int, intra: tuple[float, float], inter: tuple[float, float]):
    """Site matrices where every pair of distinct sites has the same (ms, Gbit/s) link."""
    latency = np.full((num_sites, num_sites), inter[0], dtype=float)
    bandwidth = np.full((num_sites, num_sites), inter[1], dtype=float)
    np.fill_diagonal(latency, intra[0])
    np.fill_diagonal(bandwidth, intra[1])
    return latency, bandwidth


def pairwise_site_links(
    names: Sequence[str], intra: tuple[float, float], links: dict[tuple[str, str], tuple]
):
    """Site matrices from a table of (ms, Gbit/s) per unordered pair of sites."""
    latency, bandwidth = uniform_site_links(len(names), intra, (np.nan, np.nan))
    index = {name: i for i, name in enumerate(names)}
    for (a, b), (ms, gbps) in links.items():
        i, j = index[a], index[b]
        latency[i, j] = latency[j, i] = ms
        bandwidth[i, j] = bandwidth[j, i] = gbps
    assert not np.isnan(latency).any(), "every pair of sites needs a link"
    return latency, bandwidth


def scenario_from_sites(
    name: str, device_sites: Sequence[int], site_names: Sequence[str], site_matrices
) -> Scenario:
    latency, bandwidth = expand_sites(device_sites, *site_matrices)
    return Scenario(name, latency, bandwidth, sites=tuple(site_names[s] for s in device_sites))


def datacenter() -> Scenario:
    """8 machines x 8 GPUs: 100 Gbit/s inside a machine, 3.125 Gbit/s between machines, 0 ms."""
    sites = [i // 8 for i in range(64)]
    return scenario_from_sites(
        "datacenter", sites, [f"machine{m}" for m in range(8)], uniform_site_links(8, (0, 100), (0, 3.125))
    )


def spot() -> Scenario:
    """Devices 0-31 on 8 machines of 4 GPUs, devices 32-63 alone; 100 Gbit/s inside, 1.25 across, 0 ms."""
    sites = [i // 4 if i < 32 else 8 + (i - 32) for i in range(64)]
    names = [f"machine{m}" for m in range(40)]
    return scenario_from_sites("spot", sites, names, uniform_site_links(40, (0, 100), (0, 1.25)))


def multi_university() -> Scenario:
    """Two campuses of 32: 1 ms / 5 Gbit/s inside a campus, 11 ms / 1.12 Gbit/s across."""
    sites = [i // 32 for i in range(64)]
    return scenario_from_sites(
        "multi-university", sites, ["siteA", "siteB"], uniform_site_links(2, (1, 5), (11, 1.12))
    )


REGIONS = ("virginia", "oregon", "california", "ohio")
REGION_LINKS = {
    ("virginia", "oregon"): (67, 1.15),
    ("virginia", "california"): (59, 1.05),
    ("virginia", "ohio"): (11, 1.12),
    ("oregon", "california"): (12, 1.25),
    ("oregon", "ohio"): (49, 1.10),
    ("california", "ohio"): (52, 1.02),
}

CITIES = ("oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "ireland")
CITY_LINKS = {
    ("oregon", "virginia"): (67, 0.79), ("oregon", "ohio"): (49, 1.10), ("oregon", "tokyo"): (96, 0.523),
    ("oregon", "seoul"): (124, 0.46), ("oregon", "london"): (136, 0.42), ("oregon", "frankfurt"): (143, 0.404),
    ("oregon", "ireland"): (124, 0.482),
    ("virginia", "ohio"): (11, 1.12), ("virginia", "tokyo"): (143, 0.524), ("virginia", "seoul"): (172, 0.50),
    ("virginia", "london"): (76, 1.16), ("virginia", "frankfurt"): (90, 1.02), ("virginia", "ireland"): (67, 1.05),
    ("ohio", "tokyo"): (130, 0.694), ("ohio", "seoul"): (159, 0.529), ("ohio", "london"): (86, 1.05),
    ("ohio", "frankfurt"): (99, 0.799), ("ohio", "ireland"): (77, 1.14),
    ("tokyo", "seoul"): (34, 1.10), ("tokyo", "london"): (210, 0.366), ("tokyo", "frankfurt"): (223, 0.36),
    ("tokyo", "ireland"): (199, 0.465),
    ("seoul", "london"): (238, 0.342), ("seoul", "frankfurt"): (235, 0.358), ("seoul", "ireland"): (228, 0.335),
    ("london", "frankfurt"): (14, 1.14), ("london", "ireland"): (12, 1.09),
    ("frankfurt", "ireland"): (24, 1.08),
}  # fmt: skip


def regional() -> Scenario:
    """16 devices in each of 4 US regions: 5 ms / 2 Gbit/s inside a region, measured links across."""
    sites = [i // 16 for i in range(64)]
    return scenario_from_sites("regional", sites, REGIONS, pairwise_site_links(REGIONS, (5, 2), REGION_LINKS))


def world_wide() -> Scenario:
    """8 devices in each of 8 cities on 3 continents: 5 ms / 2 Gbit/s inside a city, measured links across."""
    sites = [i // 8 for i in range(64)]
    return scenario_from_sites("world-wide", sites, CITIES, pairwise_site_links(CITIES, (5, 2), CITY_LINKS))


COMMUNICATION_SCENARIOS = {
    "datacenter": datacenter,
    "spot": spot,
    "multi-university": multi_university,
    "regional": regional,
    "world-wide": world_wide,
}


def relabel(scenario: Scenario, seed: int) -> tuple[Scenario, np.ndarray]:
    """The same fleet with devices randomly renumbered: new device i is old device `old_of_new[i]`."""
    old_of_new = make_rng(seed, "relabel", scenario.name).permutation(scenario.num_devices)
    ix = np.ix_(old_of_new, old_of_new)

    def pick(values):
        return None if values is None else np.asarray(values)[old_of_new]

    shuffled = replace(
        scenario,
        latency_ms=scenario.latency_ms[ix],
        bandwidth_gbps=scenario.bandwidth_gbps[ix],
        sites=tuple(scenario.sites[i] for i in old_of_new) if scenario.sites else (),
        tflops=pick(scenario.tflops),
        memory_gb=pick(scenario.memory_gb),
        gpu_names=tuple(scenario.gpu_names[i] for i in old_of_new) if scenario.gpu_names else (),
    )
    return shuffled, old_of_new
