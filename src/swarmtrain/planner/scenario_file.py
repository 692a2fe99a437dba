"""Reading fleets from JSON (`plan --scenario-file`), with errors that say what is wrong and where.

This is the planner's older fleet format, kept for existing files (documented in the README, *The JSON
scenario file*, with `examples/scenario.json`); the TOML fleet file (`planner.fleet_spec`, `plan --fleet`)
is the one the simulator reads too, and takes device speed and memory from the shared table
(`config.devices`) instead of numbers per device.

A scenario file is one JSON object:

    {
      "name": "two-labs",                    optional, default: the file name
      "num_stages": 2,                       optional, default 8; must divide the number of devices
      "devices": 4,                          a count, or a list of objects (see below)
      "sites": ["labA", "labB"],             optional: when given, the matrices are site x site
      "latency_ms":     [[...], ...],        symmetric, >= 0
      "bandwidth_gbps": [[...], ...]         symmetric, > 0 (Gbit/s)
    }

Without "sites" the matrices are device x device and their diagonal is ignored. With "sites" every
device names its site and the diagonal entry of a site is the link between two devices at that site.
A device object may carry {"site": name, "gpu": label, "tflops": peak dense fp16 TFLOPS, "memory_gb": GB};
"tflops" and "memory_gb" are needed (on every device) only for compute-aware planning. A "gpu" that
names a type of the shared device table (`config.devices`: "a100", "T4", "rtx4090", ...) supplies
both from the table (peak TFLOPS, device memory) where the device does not give its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from swarmtrain.config.devices import device_type, is_device
from swarmtrain.planner.scenarios import DEFAULT_NUM_STAGES, Scenario, ScenarioError, expand_sites

TOP_LEVEL_KEYS = ("name", "num_stages", "devices", "sites", "latency_ms", "bandwidth_gbps")
DEVICE_KEYS = ("site", "gpu", "tflops", "memory_gb")


def load_scenario_file(path: str | Path) -> Scenario:
    target = Path(path)
    try:
        text = target.read_text()
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario file {target}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(
            f"scenario file {target} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from None
    return scenario_from_dict(data, default_name=target.stem)


def scenario_from_dict(data: Any, default_name: str = "custom") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError("a scenario must be a JSON object with devices, latency_ms and bandwidth_gbps")
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ScenarioError(f"unknown scenario key {unknown[0]!r} (expected: {', '.join(TOP_LEVEL_KEYS)})")
    for key in ("devices", "latency_ms", "bandwidth_gbps"):
        if key not in data:
            raise ScenarioError(f"scenario is missing {key!r}")
    devices = _parse_devices(data["devices"])
    num_devices = len(devices)
    num_stages = parse_num_stages(data.get("num_stages", DEFAULT_NUM_STAGES), num_devices)
    if "sites" in data:
        site_names = _parse_site_names(data["sites"])
        size, what = len(site_names), "site"
    else:
        site_names, size, what = None, num_devices, "device"
    latency = _parse_matrix(data["latency_ms"], "latency_ms", size, what)
    bandwidth = _parse_matrix(data["bandwidth_gbps"], "bandwidth_gbps", size, what)
    _check_values(latency, bandwidth, check_diagonal=site_names is not None)
    if site_names is not None:
        device_sites = _device_site_indices(devices, site_names)
        latency, bandwidth = expand_sites(device_sites, latency, bandwidth)
        sites = tuple(site_names[s] for s in device_sites)
    else:
        np.fill_diagonal(latency, 0.0)
        np.fill_diagonal(bandwidth, np.inf)
        sites = tuple(str(d.get("site", "")) for d in devices) if any("site" in d for d in devices) else ()
    tflops, memory_gb = _parse_compute(_with_table_figures(devices))
    gpu_names = tuple(str(d.get("gpu", "")) for d in devices) if any("gpu" in d for d in devices) else ()
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ScenarioError("scenario 'name' must be a non-empty string")
    return Scenario(name, latency, bandwidth, num_stages, sites, tflops, memory_gb, gpu_names)


def _parse_devices(value: Any) -> list[dict]:
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise ScenarioError("'devices' must be a device count or a list of device objects")
    if isinstance(value, int):
        if value <= 0:
            raise ScenarioError(f"'devices' must be positive, got {value}")
        return [{} for _ in range(value)]
    if not value:
        raise ScenarioError("'devices' is an empty list")
    for i, device in enumerate(value):
        if not isinstance(device, dict):
            raise ScenarioError(f'devices[{i}] must be an object like {{"site": ..., "tflops": ...}}')
        unknown = sorted(set(device) - set(DEVICE_KEYS))
        if unknown:
            raise ScenarioError(
                f"devices[{i}] has unknown key {unknown[0]!r} (expected: {', '.join(DEVICE_KEYS)})"
            )
    return value


def parse_num_stages(value: Any, num_devices: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ScenarioError(f"'num_stages' must be a positive integer, got {value!r}")
    if num_devices % value:
        raise ScenarioError(
            f"{num_devices} devices are not divisible into {value} stages of equal size "
            f"(num_stages must divide the number of devices)"
        )
    return value


def _parse_site_names(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        raise ScenarioError("'sites' must be a non-empty list of site names")
    if len(set(value)) != len(value):
        raise ScenarioError("'sites' lists a site twice")
    return value


def _parse_matrix(value: Any, key: str, size: int, what: str) -> np.ndarray:
    if not isinstance(value, list):
        raise ScenarioError(f"{key} must be a list of {size} rows (one per {what})")
    if len(value) != size:
        raise ScenarioError(f"{key} has {len(value)} rows, expected {size} (one per {what})")
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != size:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise ScenarioError(f"{key} row {i} has {got} entries, expected {size} (one per {what})")
        for j, entry in enumerate(row):
            if isinstance(entry, bool) or not isinstance(entry, int | float) or not math.isfinite(entry):
                raise ScenarioError(f"{key}[{i}][{j}] must be a finite number, got {entry!r}")
    return np.array(value, dtype=float)


def _check_values(latency: np.ndarray, bandwidth: np.ndarray, check_diagonal: bool) -> None:
    off_diagonal = ~np.eye(latency.shape[0], dtype=bool) | check_diagonal
    bad = np.argwhere((latency < 0) & off_diagonal)
    if len(bad):
        i, j = bad[0]
        raise ScenarioError(f"latency_ms[{i}][{j}] is negative ({latency[i, j]:g}); latencies must be >= 0")
    bad = np.argwhere((bandwidth <= 0) & off_diagonal)
    if len(bad):
        i, j = bad[0]
        raise ScenarioError(f"bandwidth_gbps[{i}][{j}] must be positive, got {bandwidth[i, j]:g}")
    for key, matrix in (("latency_ms", latency), ("bandwidth_gbps", bandwidth)):
        bad = np.argwhere(~np.isclose(matrix, matrix.T, rtol=1e-9, atol=0.0))
        if len(bad):
            i, j = bad[0]
            raise ScenarioError(
                f"{key} is asymmetric: [{i}][{j}] = {matrix[i, j]:g} but [{j}][{i}] = {matrix[j, i]:g}"
            )


def _device_site_indices(devices: list[dict], site_names: list[str]) -> list[int]:
    index = {name: i for i, name in enumerate(site_names)}
    result = []
    for i, device in enumerate(devices):
        if "site" not in device:
            raise ScenarioError(f"devices[{i}] needs a 'site' because the scenario lists 'sites'")
        if device["site"] not in index:
            raise ScenarioError(f"devices[{i}] names unknown site {device['site']!r}")
        result.append(index[device["site"]])
    return result


def _with_table_figures(devices: list[dict]) -> list[dict]:
    """Each device whose "gpu" is in the device table, with the table's peak TFLOPS and memory where it
    gives none (its own numbers win); a free-form label ("my-lab-box") supplies nothing."""
    filled = []
    for device in devices:
        label = device.get("gpu")
        if isinstance(label, str) and is_device(label) and device_type(label).memory_gb > 0:
            table = device_type(label)
            device = {"tflops": table.peak_tflops, "memory_gb": table.memory_gb, **device}
        filled.append(device)
    return filled


def _parse_compute(devices: list[dict]) -> tuple[np.ndarray | None, np.ndarray | None]:
    arrays: list[np.ndarray | None] = []
    for key in ("tflops", "memory_gb"):
        present = [key in d for d in devices]
        if not any(present):
            arrays.append(None)
            continue
        if not all(present):
            raise ScenarioError(
                f"devices[{present.index(False)}] has no {key!r} (give it for every device or none)"
            )
        values = [d[key] for d in devices]
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ScenarioError(f"devices[{i}].{key} must be a positive number, got {v!r}")
        arrays.append(np.array(values, dtype=float))
    return arrays[0], arrays[1]
