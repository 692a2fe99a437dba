"""Fleet files (`--fleet FILE`, TOML) as simulator fleets.

The format and its parsing live in `planner.fleet_spec` (documented there), shared with
`swarmtrain plan --fleet`; this module turns the parsed `FleetSpec` into the simulator's `Fleet`
(SI units, sustained TFLOPS). Every mistake is a FleetError naming the entry and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmtrain.planner.fleet_spec import FleetSpec, PeerEntry, fleet_spec_from_dict, load_fleet_spec
from swarmtrain.sim.entities import GB, MBIT_S, Fleet, Locations, PeerSpec


def load_fleet_file(path: str | Path) -> Fleet:
    return fleet_from_spec(load_fleet_spec(path), description=f"fleet file {Path(path).name}")


def fleet_from_dict(raw: dict[str, Any], description: str = "fleet") -> Fleet:
    return fleet_from_spec(fleet_spec_from_dict(raw), description)


def fleet_from_spec(spec: FleetSpec, description: str = "fleet") -> Fleet:
    locations = Locations(
        spec.locations,
        tuple(tuple(v * 1e-3 for v in row) for row in spec.latency_ms),
        tuple(tuple(v * MBIT_S for v in row) for row in spec.bandwidth_mbit_s),
    )
    peers = tuple(peer_spec(entry) for entry in spec.peers)
    return Fleet(peers, locations, f"{description}: {len(peers)} peers")


def peer_spec(entry: PeerEntry) -> PeerSpec:
    """The simulator's peer: it computes with the sustained TFLOPS."""
    return PeerSpec(
        peer_id=entry.peer_id,
        device=entry.device,
        tflops=entry.tflops,
        memory_bytes=entry.memory_gb * GB,
        host_memory_bytes=entry.host_memory_gb * GB,
        uplink_bytes_per_s=entry.uplink_mbit_s * MBIT_S,
        downlink_bytes_per_s=entry.downlink_mbit_s * MBIT_S,
        host_to_device_bytes_per_s=entry.host_to_device_gb_s * GB,
        location=entry.location,
        compute_s_per_sample=entry.compute_s_per_sample,
        stage=entry.stage,
        home_stage=entry.home_stage,
    )
