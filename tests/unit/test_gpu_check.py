"""The GPU check anyone can rerun (tools/gpu/): its scripts parse, and its summary reads
bench/device_stage.py's JSON into one table that marks the criteria a row misses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
sys.path.insert(0, str(ROOT / "bench"))

import one_gpu_swarm  # noqa: E402
import summary  # noqa: E402
from test_device_stage_bench import fake_report  # noqa: E402

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("script", ["check.sh", "wheelhouse.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu" / script)], check=True, timeout=30)


def test_summary_is_one_table_with_the_criteria(tmp_path, capsys):
    report = fake_report({"swapped_over_resident": 2.0})
    path = tmp_path / "device_stage_tiny.json"
    path.write_text(json.dumps(report))
    assert summary.main([str(path), str(tmp_path / "missing.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    fp32 = next(line.split() for line in lines if line.startswith("tiny") and " fp32 " in line)
    # stages 900 and 1000 share one device: bound 473.7, served 450 (0.95 of it); batching 1.50 (4
    # trainers) meets 1.3; swapped / resident 2.0 misses 1.5 and is marked
    assert fp32 == ["tiny", "fp32", "def", "900/1000", "473.7", "450.0", "0.95", "0%", "1.50", "2.00", "!"]
    assert any("missing.json: unreadable" in line for line in lines)


def test_the_swarms_rate_is_taken_over_the_second_half_of_the_demo():
    log = "\n".join(
        [
            "swarm starting",
            "  t=    2s  samples      0  loss 11.000",
            "  t=   10s  samples    400  loss 9.000",
        ]
        + ["  t=   20s  samples   1000  loss 8.0  samples/s 50.0  peers per stage s0:1"]
        + ["  t=   40s  samples   3000  loss 7.0  samples/s 75.0  peers per stage s0:1"]
        + ["  t=   44s  samples   3000  loss 7.0  samples/s 68.2  peers per stage s0:1", "summary"]
    )
    # from t=20 s (the first line at half of 40 s, where the count last grew) to t=40 s: 2000 samples in
    # 20 s; the warm-up and the final evaluation (t=44 s, no samples) are left out
    assert one_gpu_swarm.steady_rate(log) == 100.0
    assert one_gpu_swarm.steady_rate("  t=    5s  samples     10  loss 1.0") is None
    assert one_gpu_swarm.steady_rate("no progress at all") is None


def test_one_gpu_swarm_reports_a_failed_command_as_no_ratio(capsys):
    result = {"preset": "tiny", "device": "cpu", "dtype": "fp32", "in_flight": 16}
    result |= {"local_samples_per_s": 500.0, "swarm_samples_per_s": None, "swarm_over_local": None}
    line = one_gpu_swarm.describe(result)
    assert "train-local 500.0 samples/s" in line and "16 in flight) - samples/s" in line and "ratio -" in line


def test_the_summary_adds_the_swarm_on_one_gpu_with_its_criterion(tmp_path, capsys):
    result = {"preset": "gpt2-small", "dtype": "bf16", "in_flight": None}
    result |= {"local_samples_per_s": 160.0, "swarm_samples_per_s": 88.0, "swarm_over_local": 0.55}
    path = tmp_path / "one_gpu_swarm.json"
    path.write_text(json.dumps(result))
    assert summary.main([str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("4-stage swarm"))
    assert "default in flight): 88.0 samples/s, train-local 160.0: 0.55 ! (>= 0.6)" in line
