"""Building fleets: a synthetic heterogeneous mix, the planner's published scenarios, measured compute times.

Synthetic fleet (`--num-peers N`): each peer draws a device type with these weights (seeded):
5% a100 and 15% v100 (cloud, 10 and 5 Gbit/s), 30% t4 (spot cloud, 2 Gbit/s), 25% rtx3090
(home: 300 Mbit/s up, 1 Gbit/s down) and 25% rtx2080ti (home: 100 Mbit/s up, 500 Mbit/s down), see
`config.devices`; and a location uniformly among the 8 cities of the planner's `world-wide`
scenario (5 ms / 2 Gbit/s inside a city, 11-238 ms / 0.34-1.16 Gbit/s per flow across).

Scenario fleets (`--scenario NAME`): the 64 devices of one of the planner's five communication
scenarios; each device is a peer whose own link is its fastest link in the scenario and whose paths
follow the scenario's site matrices. Devices get the scenario's compute if it has any, else `v100`.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from swarmtrain.planner.fleet_spec import FleetError  # one error class for fleet files and fleets
from swarmtrain.sim.entities import DEVICE_TYPES, GB, Fleet, Locations, PeerSpec
from swarmtrain.utils.rng import make_rng

SYNTHETIC_MIX = {"a100": 0.05, "v100": 0.15, "t4": 0.30, "rtx3090": 0.25, "rtx2080ti": 0.25}
GBIT_S = 1e9 / 8


def _site_locations(scenario) -> tuple[Locations, list[int]]:
    """Collapse a device x device scenario to its sites: the link between two sites is the link between
    any device of one and any other device of the other (scenarios are built that way)."""
    sites = list(scenario.sites) if scenario.sites else [f"device{i}" for i in range(scenario.num_devices)]
    names = list(dict.fromkeys(sites))
    members = {name: [i for i, s in enumerate(sites) if s == name] for name in names}
    latency, bandwidth = [], []
    for a in names:
        lat_row, bw_row = [], []
        for b in names:
            pairs = [(i, j) for i in members[a][:2] for j in members[b][:2] if i != j]
            if pairs:
                i, j = pairs[0]
                lat_row.append(float(scenario.latency_ms[i, j]) / 1e3)
                bw_row.append(float(scenario.bandwidth_gbps[i, j]) * GBIT_S)
            else:  # a site with a single device never talks to itself
                lat_row.append(0.0)
                bw_row.append(math.inf)
        latency.append(tuple(lat_row))
        bandwidth.append(tuple(bw_row))
    return Locations(tuple(names), tuple(latency), tuple(bandwidth)), [names.index(s) for s in sites]


def world_wide_locations() -> Locations:
    from swarmtrain.planner.scenarios import COMMUNICATION_SCENARIOS

    return _site_locations(COMMUNICATION_SCENARIOS["world-wide"]())[0]


def scenario_fleet(name: str, device: str = "v100") -> Fleet:
    from swarmtrain.planner.scenarios import COMMUNICATION_SCENARIOS

    if name not in COMMUNICATION_SCENARIOS:
        raise FleetError(f"unknown scenario {name!r} (choose from: {', '.join(COMMUNICATION_SCENARIOS)})")
    scenario = COMMUNICATION_SCENARIOS[name]()
    locations, device_sites = _site_locations(scenario)
    bandwidth = np.array(scenario.bandwidth_gbps, dtype=float)
    np.fill_diagonal(bandwidth, 0.0)
    peers = []
    for i, site in enumerate(device_sites):
        link = float(bandwidth[i][np.isfinite(bandwidth[i])].max()) * GBIT_S
        base = PeerSpec.from_device(f"d{i:02d}", DEVICE_TYPES[device], site)
        spec = replace(base, uplink_bytes_per_s=link, downlink_bytes_per_s=link)
        if getattr(scenario, "tflops", None) is not None and getattr(scenario, "memory_gb", None) is not None:
            spec = replace(
                spec, tflops=float(scenario.tflops[i]), memory_bytes=float(scenario.memory_gb[i]) * GB
            )
        peers.append(spec)
    return Fleet(tuple(peers), locations, f"scenario {name}: {len(peers)} devices")


def synthetic_fleet(
    num_peers: int,
    seed: int = 0,
    mix: Mapping[str, float] = SYNTHETIC_MIX,
    locations: Locations | None = None,
) -> Fleet:
    if num_peers <= 0:
        raise FleetError(f"--num-peers must be positive, got {num_peers}")
    locations = locations or world_wide_locations()
    rng = make_rng(seed, "fleet", num_peers)
    names = list(mix)
    weights = np.array([mix[n] for n in names], dtype=float)
    kinds = rng.choice(len(names), size=num_peers, p=weights / weights.sum())
    places = rng.integers(0, len(locations.names), size=num_peers)
    width = len(str(num_peers - 1))
    peers = tuple(
        PeerSpec.from_device(f"p{i:0{width}d}", DEVICE_TYPES[names[k]], int(loc))
        for i, (k, loc) in enumerate(zip(kinds.tolist(), places.tolist(), strict=True))
    )
    share = ", ".join(f"{n} {mix[n]:.0%}" for n in names)
    return Fleet(
        peers, locations, f"synthetic: {num_peers} peers ({share}) in {len(locations.names)} locations"
    )


def with_links(
    fleet: Fleet, bandwidth_bytes_per_s: float | None = None, latency_s: float | None = None
) -> Fleet:
    """The same fleet with every access link and path set to one bandwidth and/or one latency."""
    peers = fleet.peers
    locs = fleet.locations
    n = len(locs.names)
    if bandwidth_bytes_per_s is not None:
        peers = tuple(
            replace(p, uplink_bytes_per_s=bandwidth_bytes_per_s, downlink_bytes_per_s=bandwidth_bytes_per_s)
            for p in peers
        )
        locs = Locations(locs.names, locs.latency_s, tuple((math.inf,) * n for _ in range(n)))
    if latency_s is not None:
        locs = Locations(locs.names, tuple((latency_s,) * n for _ in range(n)), locs.bandwidth_bytes_per_s)
    return Fleet(peers, locs, fleet.description)


def with_measured_compute_times(fleet: Fleet, measured: Mapping[str, Sequence[float | None]]) -> Fleet:
    """Calibration hook: per-peer, per-stage measured seconds per sample (forward + backward).

    `measured[peer_id][stage]` replaces the FLOP-derived compute time of that stage; `None` keeps it.
    """
    index = fleet.index_of()
    unknown = [p for p in measured if p not in index]
    if unknown:
        raise FleetError(f"compute times for unknown peer(s): {', '.join(map(str, unknown[:5]))}")
    peers = list(fleet.peers)
    for peer_id, values in measured.items():
        for v in values:
            if v is not None and not (math.isfinite(v) and v > 0):
                raise FleetError(f"compute time of peer {peer_id} must be a positive number, got {v}")
        peers[index[peer_id]] = replace(peers[index[peer_id]], compute_s_per_sample=tuple(values))
    return Fleet(tuple(peers), fleet.locations, fleet.description + " (measured compute times)")


def load_compute_times(path: str | Path, fleet: Fleet, num_stages: int) -> Fleet:
    """Read CSV `peer,stage,seconds_per_sample` (one row per measured peer and stage) into the fleet."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise FleetError(f"cannot read compute times {path}: {exc.strerror}") from None
    rows = [
        (n, line) for n, line in enumerate(lines, 1) if line.strip() and not line.lstrip().startswith("#")
    ]
    if not rows or [f.strip() for f in rows[0][1].split(",")] != ["peer", "stage", "seconds_per_sample"]:
        raise FleetError(f"{path}: first line must be the header `peer,stage,seconds_per_sample`")
    index = fleet.index_of()
    measured: dict[str, list[float | None]] = {}
    for (line_no, _), fields in zip(rows[1:], csv.reader(line for _, line in rows[1:]), strict=True):
        where = f"{path} line {line_no}"
        if len(fields) != 3:
            raise FleetError(f"{where}: expected 3 fields `peer,stage,seconds_per_sample`")
        peer_id, stage_text, seconds_text = (f.strip() for f in fields)
        if peer_id not in index:
            raise FleetError(f"{where}: unknown peer {peer_id!r}")
        try:
            stage, seconds = int(stage_text), float(seconds_text)
        except ValueError:
            raise FleetError(f"{where}: stage must be an integer and seconds_per_sample a number") from None
        if not 0 <= stage < num_stages:
            raise FleetError(f"{where}: stage {stage} outside 0..{num_stages - 1}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise FleetError(f"{where}: seconds_per_sample must be positive, got {seconds_text}")
        measured.setdefault(peer_id, [None] * num_stages)[stage] = seconds
    return with_measured_compute_times(fleet, measured)
