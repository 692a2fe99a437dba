"""The README's quick-start commands are make targets; `make quickstart` itself runs in
tests/integration/test_demo.py (slow tier: it trains, kills a replica and compares with one process)."""

import re
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
