"""Fleet files (TOML): your own machines, places and links, read once for the planner and the simulator.

`swarmtrain simulate --fleet FILE` builds its peers from this (`sim.fleet_file`) and
`swarmtrain plan --fleet FILE` its Scenario (`planner.fleet_scenario`); both read the same `FleetSpec`.

    locations = ["us", "eu"]                     # optional; default one place "local"
    latency_ms = [[5, 80], [80, 5]]              # optional, symmetric, >= 0 (default 0)
    bandwidth_mbit_s = [[10000, 500], [500, 10000]]  # optional per-flow path caps (default unlimited)

    [[peers]]
    device = "a100"          # a type of config.devices (a100, a100-80gb, v100, v100-32gb, t4, rtx4090,
                             # rtx3090, rtx3080, rtx2080ti, cpu) or an alias ("A100-80GB", "RTX-3090")
    count = 4                # optional: that many identical peers, ids "<id>-0" .. "<id>-3"
    id = "cloud"             # optional; default "<device><n>"
    location = "us"
    uplink_mbit_s = 1000     # optional overrides of the device's numbers:
    # tflops (sustained), peak_tflops, memory_gb, host_memory_gb, downlink_mbit_s, host_to_device_gb_s
    compute_s_per_sample = [0.012, 0.015]   # optional measured seconds per sample per stage
    stage = 1                # optional: serve only this stage (like `swarmtrain server --stage 1`)
    home_stage = 0           # optional: start here (and return here without rebalancing)

`tflops` is sustained training throughput (what the simulator computes with), `peak_tflops` the
datasheet peak (what the planner scales by its utilization); give either and the other follows from
the device type's sustained fraction. A peer with `tflops` or `peak_tflops` but no `device` is a `cpu`.
Every mistake is a FleetError naming the entry and the field.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swarmtrain.config.devices import DEVICES, DeviceType, device_type, is_device
from swarmtrain.config.errors import UserError

TOP_LEVEL_KEYS = ("locations", "latency_ms", "bandwidth_mbit_s", "peers")
OVERRIDES = (  # numbers a peer may override, all positive, named as in PeerEntry
    "tflops",
    "peak_tflops",
    "memory_gb",
    "host_memory_gb",
    "uplink_mbit_s",
    "downlink_mbit_s",
    "host_to_device_gb_s",
)
PEER_KEYS = {"device", "count", "id", "location", "compute_s_per_sample", "stage", "home_stage", *OVERRIDES}


class FleetError(UserError):
    """A fleet description or compute-time table that cannot be used; the message says why."""


@dataclass(frozen=True)
class PeerEntry:
    """One machine of a fleet file, counts expanded and the device table's numbers filled in."""

    peer_id: str
    device: str  # canonical name in config.devices
    location: int  # index into FleetSpec.locations
    tflops: float  # sustained
    peak_tflops: float
    memory_gb: float
    host_memory_gb: float
    uplink_mbit_s: float
    downlink_mbit_s: float
    host_to_device_gb_s: float
    compute_s_per_sample: tuple[float, ...] | None = None
    stage: int | None = None
    home_stage: int | None = None


@dataclass(frozen=True)
class FleetSpec:
    """A parsed fleet file. `bandwidth_mbit_s` is a per-flow path cap (inf: unlimited); the diagonal of
    both matrices is the link between two different peers of the same location."""

    locations: tuple[str, ...]
    latency_ms: tuple[tuple[float, ...], ...]
    bandwidth_mbit_s: tuple[tuple[float, ...], ...]
    peers: tuple[PeerEntry, ...]


def load_fleet_spec(path: str | Path) -> FleetSpec:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FleetError(f"fleet file {path}: not valid TOML: {exc}") from None
    try:
        return fleet_spec_from_dict(raw)
    except FleetError as exc:
        raise FleetError(f"fleet file {path}: {exc}") from None


def fleet_spec_from_dict(raw: dict[str, Any]) -> FleetSpec:
    unknown = set(raw) - set(TOP_LEVEL_KEYS)
    if unknown:
        raise FleetError(f"unknown key(s) {sorted(unknown)} (valid: {', '.join(TOP_LEVEL_KEYS)})")
    names = _location_names(raw)
    latency = _matrix(raw, "latency_ms", len(names), 0.0)
    bandwidth = _matrix(raw, "bandwidth_mbit_s", len(names), math.inf)
    entries = raw.get("peers")
    if not isinstance(entries, list) or not entries:
        raise FleetError("needs at least one [[peers]] entry")
    peers: list[PeerEntry] = []
    for n, entry in enumerate(entries):
        peers.extend(_peers(entry, f"peers[{n}]", names, len(peers)))
    ids = [p.peer_id for p in peers]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise FleetError(f"duplicate peer id(s): {', '.join(duplicates[:5])}")
    return FleetSpec(names, latency, bandwidth, tuple(peers))


def _location_names(raw: dict) -> tuple[str, ...]:
    names = raw.get("locations", ["local"])
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise FleetError("locations must be a non-empty list of names")
    if len(set(names)) != len(names):
        raise FleetError("location names must be unique")
    return tuple(names)


def _matrix(raw: dict, key: str, n: int, default: float) -> tuple[tuple[float, ...], ...]:
    if key not in raw:
        return tuple((default,) * n for _ in range(n))
    matrix = raw[key]
    if (
        not isinstance(matrix, list)
        or len(matrix) != n
        or any(not isinstance(r, list) or len(r) != n for r in matrix)
    ):
        raise FleetError(f"{key} must be a {n}x{n} matrix (one row per location)")
    bandwidth = key == "bandwidth_mbit_s"
    for i in range(n):
        for j in range(n):
            v = matrix[i][j]
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or (bandwidth and v == 0):
                kind = "positive" if bandwidth else "non-negative"
                raise FleetError(f"{key}[{i}][{j}] must be a {kind} number, got {v!r}")
            if matrix[j][i] != v:
                raise FleetError(f"{key} must be symmetric: [{i}][{j}] = {v} but [{j}][{i}] = {matrix[j][i]}")
    return tuple(tuple(float(v) for v in row) for row in matrix)


def _peers(entry: Any, where: str, locations: tuple[str, ...], offset: int) -> list[PeerEntry]:
    if not isinstance(entry, dict):
        raise FleetError(f"{where} must be a table")
    unknown = set(entry) - PEER_KEYS
    if unknown:
        raise FleetError(f"{where}: unknown field(s) {sorted(unknown)}")
    device = _device(entry, where)
    location = entry.get("location", locations[0])
    if location not in locations:
        raise FleetError(f"{where}: unknown location {location!r} (known: {', '.join(locations)})")
    count = entry.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise FleetError(f"{where}: count must be a positive integer, got {count!r}")
    spec = _with_extras(_numbers(entry, where, device, locations.index(location)), entry, where)
    base_id = entry.get("id", f"{device.name}{offset}")
    if not isinstance(base_id, str) or not base_id or "," in base_id:
        raise FleetError(f"{where}: id must be a non-empty string without commas")
    ids = [base_id] if count == 1 else [f"{base_id}-{k}" for k in range(count)]
    return [replace(spec, peer_id=i) for i in ids]


def _device(entry: dict, where: str) -> DeviceType:
    # A peer described only by its speed is a CPU-class machine (the table's most neutral entry).
    given_speed = "tflops" in entry or "peak_tflops" in entry
    name = entry.get("device", "cpu" if given_speed else None)
    if not (isinstance(name, str) and is_device(name)):
        raise FleetError(
            f"{where}: device must be one of {', '.join(DEVICES)} or an alias like 'A100-80GB' "
            f"(or give tflops), got {name!r}"
        )
    return device_type(name)


def _numbers(entry: dict, where: str, device: DeviceType, location: int) -> PeerEntry:
    """The device's numbers with the entry's overrides; sustained and peak TFLOPS follow each other."""
    values = {key: float(getattr(device, key)) for key in OVERRIDES if key != "tflops"}
    values["tflops"] = device.sustained_tflops
    for key in OVERRIDES:
        if key in entry:
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise FleetError(f"{where}: {key} must be a positive number, got {value!r}")
            values[key] = float(value)
    if "tflops" in entry and "peak_tflops" not in entry:
        values["peak_tflops"] = values["tflops"] / device.sustained_fraction
    if "peak_tflops" in entry and "tflops" not in entry:
        values["tflops"] = values["peak_tflops"] * device.sustained_fraction
    return PeerEntry(
        peer_id="",
        device=device.name,
        location=location,
        tflops=values["tflops"],
        peak_tflops=values["peak_tflops"],
        memory_gb=values["memory_gb"],
        host_memory_gb=values["host_memory_gb"],
        uplink_mbit_s=values["uplink_mbit_s"],
        downlink_mbit_s=values["downlink_mbit_s"],
        host_to_device_gb_s=values["host_to_device_gb_s"],
    )


def _with_extras(spec: PeerEntry, entry: dict, where: str) -> PeerEntry:
    """Measured compute times and pinned stages."""
    if "compute_s_per_sample" in entry:
        values = entry["compute_s_per_sample"]
        if not isinstance(values, list) or not all(
            not isinstance(v, bool) and isinstance(v, int | float) and v > 0 for v in values
        ):
            raise FleetError(
                f"{where}: compute_s_per_sample must be a list of positive seconds, one per stage"
            )
        spec = replace(spec, compute_s_per_sample=tuple(float(v) for v in values))
    return replace(spec, stage=_stage(entry, "stage", where), home_stage=_stage(entry, "home_stage", where))


def _stage(entry: dict, key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise FleetError(f"{where}: {key} must be a stage index >= 0, got {value!r}")
    return value
