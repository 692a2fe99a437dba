"""Static descriptions of what is simulated: peers, locations and fleets (plain frozen data).

Device types come from the table shared with the planner, `config.devices`.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.config.devices import DEVICES, DeviceType

GB = 1e9
MBIT_S = 1e6 / 8  # bytes per second in one Mbit/s


# The shared device table (config.devices); the simulator computes with each type's *sustained* TFLOPS.
DEVICE_TYPES: dict[str, DeviceType] = DEVICES


@dataclass(frozen=True)
class Locations:
    """Named places; `latency_s[i][j]` one-way and `bandwidth_bytes_per_s[i][j]` per-flow cap between them.

    The diagonal is the link between two different peers of the same place. Matrices are symmetric.
    """

    names: tuple[str, ...]
    latency_s: tuple[tuple[float, ...], ...]
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        for matrix in (self.latency_s, self.bandwidth_bytes_per_s):
            if len(matrix) != n or any(len(row) != n for row in matrix):
                raise ValueError(f"location matrices must be {n}x{n}")

    def index(self, name: str) -> int:
        return self.names.index(name)


def single_location(name: str = "local", latency_s: float = 0.0, bandwidth_bytes_per_s: float = float("inf")):
    return Locations((name,), ((latency_s,),), ((bandwidth_bytes_per_s,),))


def uniform_locations(names: tuple[str, ...], latency_s: float, bandwidth_bytes_per_s: float) -> Locations:
    """Every pair of peers (same place or not) is `latency_s` apart with the same per-flow cap."""
    n = len(names)
    return Locations(
        names,
        tuple((latency_s,) * n for _ in range(n)),
        tuple((bandwidth_bytes_per_s,) * n for _ in range(n)),
    )


@dataclass(frozen=True)
class PeerSpec:
    """One machine of the fleet. Bandwidths are the peer's own access link, per direction."""

    peer_id: str
    device: str
    tflops: float
    memory_bytes: float
    host_memory_bytes: float
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    host_to_device_bytes_per_s: float
    location: int
    # Calibration hook: measured seconds per sample (forward + backward) for each stage; overrides
    # the FLOP-derived compute time. `None` entries keep the derived value.
    compute_s_per_sample: tuple[float | None, ...] | None = None
    # Pinned stage (like `swarmtrain server --stage N`): the peer serves only this stage.
    stage: int | None = None
    # Home stage of a given placement: where the peer starts (and, without rebalancing, returns).
    home_stage: int | None = None

    @staticmethod
    def from_device(peer_id: str, device: DeviceType, location: int) -> PeerSpec:
        return PeerSpec(
            peer_id=peer_id,
            device=device.name,
            tflops=device.sustained_tflops,
            memory_bytes=device.memory_gb * GB,
            host_memory_bytes=device.host_memory_gb * GB,
            uplink_bytes_per_s=device.uplink_mbit_s * MBIT_S,
            downlink_bytes_per_s=device.downlink_mbit_s * MBIT_S,
            host_to_device_bytes_per_s=device.host_to_device_gb_s * GB,
            location=location,
        )


@dataclass(frozen=True)
class Fleet:
    peers: tuple[PeerSpec, ...]
    locations: Locations
    description: str = ""

    def __post_init__(self) -> None:
        ids = [p.peer_id for p in self.peers]
        if len(set(ids)) != len(ids):
            raise ValueError("peer ids must be unique")
        for peer in self.peers:
            if not 0 <= peer.location < len(self.locations.names):
                raise ValueError(
                    f"peer {peer.peer_id} has location {peer.location} outside the location table"
                )

    @property
    def num_peers(self) -> int:
        return len(self.peers)

    def index_of(self) -> dict[str, int]:
        return {p.peer_id: i for i, p in enumerate(self.peers)}
