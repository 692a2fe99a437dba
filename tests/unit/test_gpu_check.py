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
    assert fp32 == ["tiny", "fp32", "900/1000", "473.7", "450.0", "0.95", "0%", "1.50", "2.00", "!"]
    assert any("missing.json: unreadable" in line for line in lines)
