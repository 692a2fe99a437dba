"""Every package that `src/` imports is declared in pyproject.toml (a fresh install gets it from there,
not by luck as some other package's dependency)."""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _imported_top_level_modules() -> set[str]:
    modules: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"swarmtrain"}


def _declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    return {_normalized(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]) for spec in specs}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared():
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(_imported_top_level_modules()):
        distributions = {_normalized(d) for d in providers.get(module, [])}
        assert distributions, f"{module} is imported by src/ but not installed"
        if not distributions & _declared_distributions():
            undeclared[module] = sorted(distributions)
    assert not undeclared, f"imported by src/ but not in pyproject.toml: {undeclared}"


def test_the_check_sees_an_import_that_only_a_dependency_brings():
    # hivemind brings py-multihash; a declared list without it must fail the check above
    assert "multihash" in _imported_top_level_modules()
    assert "py-multihash" in {
        _normalized(d) for d in importlib.metadata.packages_distributions()["multihash"]
    }
