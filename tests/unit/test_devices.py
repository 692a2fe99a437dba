"""The shared device table: the figures the planner and the simulator used before it, names and aliases."""

import pytest

from swarmtrain.config.devices import DEVICES, UnknownDeviceError, device_type, is_device
from swarmtrain.config.errors import UserError
from swarmtrain.sim.entities import DEVICE_TYPES

pytestmark = pytest.mark.unit

# The simulator's table before the merge: name -> (sustained TFLOPS, memory GB, host memory GB,
# up Mbit/s, down Mbit/s, host-to-device GB/s). Its results depend on these exactly.
SIMULATOR_BEFORE = {
    "a100": (120.0, 40, 256, 10_000, 10_000, 24.0),
    "v100": (50.0, 16, 128, 5_000, 5_000, 12.0),
    "t4": (25.0, 16, 64, 2_000, 2_000, 12.0),
    "rtx3090": (35.0, 24, 64, 300, 1_000, 24.0),
    "rtx2080ti": (22.0, 11, 32, 100, 500, 12.0),
    "cpu": (0.05, 0, 8, 10_000, 10_000, 1.0),
}
# The planner's table before the merge: its name -> (type it now names, peak dense fp16 TFLOPS, memory GB).
PLANNER_BEFORE = {
    "A100-80GB": ("a100-80gb", 312.0, 80.0),
    "V100-32GB": ("v100-32gb", 125.0, 32.0),
    "T4": ("t4", 65.0, 16.0),
    "RTX-3090": ("rtx3090", 71.0, 24.0),
    "RTX-4090": ("rtx4090", 165.0, 24.0),
    "RTX-3080": ("rtx3080", 59.5, 10.0),
}


@pytest.mark.parametrize("name", SIMULATOR_BEFORE)
def test_simulator_figures_are_unchanged(name):
    d = DEVICES[name]
    got = (d.sustained_tflops, d.memory_gb, d.host_memory_gb, d.uplink_mbit_s, d.downlink_mbit_s)
    assert got + (d.host_to_device_gb_s,) == SIMULATOR_BEFORE[name]
    assert DEVICE_TYPES[name] is d  # the simulator reads this very table


@pytest.mark.parametrize("old_name", PLANNER_BEFORE)
def test_planner_spellings_are_aliases_with_unchanged_figures(old_name):
    d = device_type(old_name)
    assert (d.name, d.peak_tflops, d.memory_gb) == PLANNER_BEFORE[old_name]


def test_names_and_aliases():
    assert device_type("A100-80GB") is DEVICES["a100-80gb"]
    assert device_type("a100_40gb") is device_type("A100") is DEVICES["a100"]
    assert device_type("RTX 2080 Ti") is DEVICES["rtx2080ti"]
    assert device_type("V100-16GB") is DEVICES["v100"]
    assert all(name == name.lower() for name in DEVICES)
    assert is_device("T4") and not is_device("quantum") and not is_device(None)


def test_sustained_is_a_plausible_share_of_the_peak():
    for d in DEVICES.values():
        assert d.sustained_tflops < d.peak_tflops
        assert d.sustained_tflops == pytest.approx(d.peak_tflops * d.sustained_fraction)
        if d.name != "cpu":
            assert 0.35 <= d.sustained_fraction <= 0.5, d.name


def test_unknown_device_names_the_choices():
    with pytest.raises(UnknownDeviceError, match="unknown device 'quantum' \\(known: a100, ") as info:
        device_type("quantum")
    assert isinstance(info.value, UserError)
