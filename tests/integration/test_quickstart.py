"""The README's quick-start commands, run as a new user would (shortened by flags)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert block, "README must have a quickstart code block marked <!-- quickstart -->"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_quickstart_commands_are_make_targets():
    assert _readme_commands() == ["make quickstart", "make test"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.timeout(300)
def test_quickstart_runs_a_local_swarm_that_learns(tmp_path):
    summary = tmp_path / "summary.json"
    args = f"--duration-s 20 --no-kill --workdir {tmp_path / 'demo'} --summary-json {summary}"
    proc = subprocess.run(
        ["make", "-s", "quickstart", f"QUICKSTART_ARGS={args}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(summary.read_text())
    assert result["samples"] > 0 and result["microbatches_failed"] == 0
    assert result["microbatches_completed"] == result["microbatches_started"]
    assert result["final_loss"] < result["initial_loss"] - 1.0
    print(
        f"quick start: validation loss {result['val_loss']:.3f}, byte frequencies {result['byte_frequency_val_loss']:.3f}"
    )
    assert result["val_loss"] < result["byte_frequency_val_loss"]  # it learned more than byte counts
