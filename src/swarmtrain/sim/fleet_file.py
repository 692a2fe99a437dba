"""Fleet files (`--fleet FILE`, TOML): your own machines, places and links.

    locations = ["us", "eu"]                     # optional; default one place "local"
    latency_ms = [[5, 80], [80, 5]]              # optional, symmetric, >= 0 (default 0)
    bandwidth_mbit_s = [[10000, 500], [500, 10000]]  # optional per-flow path caps (default unlimited)

    [[peers]]
    device = "a100"          # a known type (a100, v100, t4, rtx3090, rtx2080ti, cpu) ...
    count = 4                # optional: that many identical peers, ids "<id>-0" .. "<id>-3"
    id = "cloud"             # optional; default "<device><n>"
    location = "us"
    uplink_mbit_s = 1000     # optional overrides of the device's numbers:
    # tflops, memory_gb, host_memory_gb, downlink_mbit_s, host_to_device_gb_s
    compute_s_per_sample = [0.012, 0.015]   # optional measured seconds per sample per stage
    stage = 1                # optional: serve only this stage (like `swarmtrain server --stage 1`)
    home_stage = 0           # optional: start here (and return here without rebalancing)

Every mistake is a FleetError naming the entry and the field.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarmtrain.sim.entities import DEVICE_TYPES, GB, MBIT_S, Fleet, Locations, PeerSpec
from swarmtrain.sim.fleet import FleetError

PEER_KEYS = {
    "device",
    "count",
    "id",
    "location",
    "tflops",
    "memory_gb",
    "host_memory_gb",
    "uplink_mbit_s",
    "downlink_mbit_s",
    "host_to_device_gb_s",
    "compute_s_per_sample",
    "stage",
    "home_stage",
}
OVERRIDES = {  # field -> (PeerSpec attribute, scale to SI)
    "tflops": ("tflops", 1.0),
    "memory_gb": ("memory_bytes", GB),
    "host_memory_gb": ("host_memory_bytes", GB),
    "uplink_mbit_s": ("uplink_bytes_per_s", MBIT_S),
    "downlink_mbit_s": ("downlink_bytes_per_s", MBIT_S),
    "host_to_device_gb_s": ("host_to_device_bytes_per_s", GB),
}


def load_fleet_file(path: str | Path) -> Fleet:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FleetError(f"fleet file {path}: not valid TOML: {exc}") from None
    try:
        return fleet_from_dict(raw, description=f"fleet file {path.name}")
    except FleetError as exc:
        raise FleetError(f"fleet file {path}: {exc}") from None


def fleet_from_dict(raw: dict[str, Any], description: str = "fleet") -> Fleet:
    unknown = set(raw) - {"locations", "latency_ms", "bandwidth_mbit_s", "peers"}
    if unknown:
        raise FleetError(
            f"unknown key(s) {sorted(unknown)} (valid: locations, latency_ms, bandwidth_mbit_s, peers)"
        )
    locations = _locations(raw)
    entries = raw.get("peers")
    if not isinstance(entries, list) or not entries:
        raise FleetError("needs at least one [[peers]] entry")
    peers: list[PeerSpec] = []
    for n, entry in enumerate(entries):
        peers.extend(_peers(entry, n, locations, len(peers)))
    ids = [p.peer_id for p in peers]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise FleetError(f"duplicate peer id(s): {', '.join(duplicates[:5])}")
    return Fleet(tuple(peers), locations, f"{description}: {len(peers)} peers")


def _matrix(raw: dict, key: str, n: int, default: float, scale: float) -> tuple[tuple[float, ...], ...]:
    if key not in raw:
        return tuple((default,) * n for _ in range(n))
    matrix = raw[key]
    if (
        not isinstance(matrix, list)
        or len(matrix) != n
        or any(not isinstance(r, list) or len(r) != n for r in matrix)
    ):
        raise FleetError(f"{key} must be a {n}x{n} matrix (one row per location)")
    for i in range(n):
        for j in range(n):
            v = matrix[i][j]
            if not isinstance(v, int | float) or v < 0 or (key == "bandwidth_mbit_s" and v == 0):
                raise FleetError(
                    f"{key}[{i}][{j}] must be a {'positive' if 'bandwidth' in key else 'non-negative'} number, got {v!r}"
                )
            if matrix[j][i] != v:
                raise FleetError(f"{key} must be symmetric: [{i}][{j}] = {v} but [{j}][{i}] = {matrix[j][i]}")
    return tuple(tuple(float(v) * scale for v in row) for row in matrix)


def _locations(raw: dict) -> Locations:
    names = raw.get("locations", ["local"])
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise FleetError("locations must be a non-empty list of names")
    if len(set(names)) != len(names):
        raise FleetError("location names must be unique")
    n = len(names)
    latency = _matrix(raw, "latency_ms", n, 0.0, 1e-3)
    bandwidth = _matrix(raw, "bandwidth_mbit_s", n, math.inf, MBIT_S)
    return Locations(tuple(names), latency, bandwidth)


def _peers(entry: Any, n: int, locations: Locations, offset: int) -> list[PeerSpec]:
    where = f"peers[{n}]"
    if not isinstance(entry, dict):
        raise FleetError(f"{where} must be a table")
    unknown = set(entry) - PEER_KEYS
    if unknown:
        raise FleetError(f"{where}: unknown field(s) {sorted(unknown)}")
    device_name = entry.get("device", "cpu" if "tflops" in entry else None)
    if device_name not in DEVICE_TYPES:
        raise FleetError(
            f"{where}: device must be one of {', '.join(DEVICE_TYPES)} (or give tflops), got {device_name!r}"
        )
    location = entry.get("location", locations.names[0])
    if location not in locations.names:
        raise FleetError(f"{where}: unknown location {location!r} (known: {', '.join(locations.names)})")
    count = entry.get("count", 1)
    if not isinstance(count, int) or count < 1:
        raise FleetError(f"{where}: count must be a positive integer, got {count!r}")
    spec = PeerSpec.from_device("", DEVICE_TYPES[device_name], locations.index(location))
    for key, (attr, scale) in OVERRIDES.items():
        if key in entry:
            value = entry[key]
            if not isinstance(value, int | float) or not value > 0:
                raise FleetError(f"{where}: {key} must be a positive number, got {value!r}")
            spec = replace(spec, **{attr: float(value) * scale})
    if "compute_s_per_sample" in entry:
        values = entry["compute_s_per_sample"]
        if not isinstance(values, list) or not all(isinstance(v, int | float) and v > 0 for v in values):
            raise FleetError(
                f"{where}: compute_s_per_sample must be a list of positive seconds, one per stage"
            )
        spec = replace(spec, compute_s_per_sample=tuple(float(v) for v in values))
    for key in ("stage", "home_stage"):
        if key in entry:
            if not isinstance(entry[key], int) or entry[key] < 0:
                raise FleetError(f"{where}: {key} must be a stage index >= 0, got {entry[key]!r}")
            spec = replace(spec, **{key: entry[key]})
    base_id = entry.get("id", f"{device_name}{offset}")
    if not isinstance(base_id, str) or not base_id or "," in base_id:
        raise FleetError(f"{where}: id must be a non-empty string without commas")
    ids = [base_id] if count == 1 else [f"{base_id}-{k}" for k in range(count)]
    return [replace(spec, peer_id=i) for i in ids]
