"""The one table of device types, shared by the planner (`planner.fleets`, `plan --fleet`) and the simulator.

Where each figure comes from:

- `peak_tflops`: the vendor datasheet's dense (no sparsity) fp16/bf16 tensor-core throughput; for
  GeForce cards the figure *with fp32 accumulation*, which is what mixed-precision training uses
  (NVIDIA A100, V100 and T4 datasheets; Ampere GA102, Ada AD102 and Turing TU102 whitepapers).
  The planner (`planner.hetero`) multiplies it by its own `--utilization` (default 0.4).
- `sustained_tflops`: the throughput the simulator assumes a large-transformer training step achieves
  (an assumed model-FLOPs utilization of ~38-49% of the peak, typical of published large-transformer
  MFU; not measured here). The simulator computes with this number; `sustained_fraction` is the ratio.
- `memory_gb`: the card's memory (0 for `cpu`: it computes out of host memory).
- `host_memory_gb`, `uplink_mbit_s`, `downlink_mbit_s`: a typical machine hosting the card (cloud
  instances for datacenter cards; a home desktop on a consumer connection for GeForce cards); a fleet
  file overrides them per peer.
- `host_to_device_gb_s`: achievable PCIe copy bandwidth (Gen4 x16 ~24 GB/s, Gen3 x16 ~12 GB/s), used for
  layer swapping.

`cpu` is a placeholder with nominal numbers: simulate CPU peers with measured compute times.
Names are lowercase (`a100`); `device_type` also accepts any capitalization and punctuation of a name or
an alias ("A100-80GB", "RTX-3090", "rtx 2080 ti").
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmtrain.config.errors import UserError


class UnknownDeviceError(UserError, ValueError):
    """A device name that is neither a type nor an alias in the table."""


@dataclass(frozen=True)
class DeviceType:
    """One kind of machine; every number carries its unit in its name (see the module docstring)."""

    name: str
    peak_tflops: float
    sustained_tflops: float
    memory_gb: float
    host_memory_gb: float
    uplink_mbit_s: float
    downlink_mbit_s: float
    host_to_device_gb_s: float
    aliases: tuple[str, ...] = ()

    @property
    def sustained_fraction(self) -> float:
        """The share of the peak a training step achieves (the simulator's assumption)."""
        return self.sustained_tflops / self.peak_tflops


# The sustained figures are the simulator's since its first version; results depend on them exactly,
# so they are stored as given rather than recomputed as peak x fraction.
_TABLE = (
    # name,      peak, sustained, mem GB, host GB, up Mbit/s, down Mbit/s, PCIe GB/s, aliases
    DeviceType("a100", 312.0, 120.0, 40, 256, 10_000, 10_000, 24.0, ("a100-40gb",)),
    DeviceType("a100-80gb", 312.0, 120.0, 80, 256, 10_000, 10_000, 24.0),
    DeviceType("v100", 125.0, 50.0, 16, 128, 5_000, 5_000, 12.0, ("v100-16gb",)),
    DeviceType("v100-32gb", 125.0, 50.0, 32, 128, 5_000, 5_000, 12.0),
    DeviceType("t4", 65.0, 25.0, 16, 64, 2_000, 2_000, 12.0),
    DeviceType("rtx4090", 165.0, 66.0, 24, 64, 300, 1_000, 24.0),
    DeviceType("rtx3090", 71.0, 35.0, 24, 64, 300, 1_000, 24.0),
    DeviceType("rtx3080", 59.5, 24.0, 10, 32, 300, 1_000, 24.0),
    DeviceType("rtx2080ti", 53.8, 22.0, 11, 32, 100, 500, 12.0),
    DeviceType("cpu", 0.1, 0.05, 0, 8, 10_000, 10_000, 1.0),  # nominal: use measured compute times
)

DEVICES: dict[str, DeviceType] = {d.name: d for d in _TABLE}


def _key(name: str) -> str:
    """'A100-80GB', 'a100_80gb' and 'a100 80GB' are one name."""
    return "".join(c for c in name.lower() if c not in "-_ ")


_BY_KEY: dict[str, DeviceType] = {_key(a): d for d in _TABLE for a in (d.name, *d.aliases)}


def device_type(name: str) -> DeviceType:
    """The device type called `name` (a type or an alias, any case); UnknownDeviceError names the choices."""
    found = _BY_KEY.get(_key(name)) if isinstance(name, str) else None
    if found is None:
        raise UnknownDeviceError(f"unknown device {name!r} (known: {', '.join(DEVICES)})")
    return found


def is_device(name: object) -> bool:
    return isinstance(name, str) and _key(name) in _BY_KEY
