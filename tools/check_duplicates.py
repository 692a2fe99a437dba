"""`make lint`'s duplicate-code ratchet: src/ may not hold more duplicated blocks than it held when the
check came in.

It runs pylint's similarity checker alone (`duplicate-code`, R0801; settings in pyproject.toml's
[tool.pylint.similarities]) over src/swarmtrain, counts the blocks it reports and fails when there are
more than MAX_BLOCKS. When a block is factored out, lower MAX_BLOCKS to the count printed; raise it only
on purpose, in a commit that says why.

    .venv/bin/python tools/check_duplicates.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

MAX_BLOCKS = 2  # today's count: cli/tokenize.py ~ cli/tokenizer.py, config/devices.py ~ planner/fleet_spec.py
ROOT = Path(__file__).resolve().parents[1]
PYLINT_ARGS = ["--disable=all", "--enable=duplicate-code", "--score=n", "src/swarmtrain"]
COMMAND = [__file__, "--pylint", *PYLINT_ARGS]  # pylint in a child, through `pylint_without_imports`
FAILED = 1 | 2 | 32  # pylint's exit-status bits for fatal, error and usage error (8, refactor, is R0801)


def pylint_without_imports(args: list[str]) -> None:
    """pylint, with astroid building no module but the files it checks. The similarity checker compares
    lines, and which lines are imports, signatures, docstrings or comments is syntax; but astroid infers
    while it builds a file's tree (a class's bases, attributes assigned), and for that parsed the
    sources of what the files import (torch, hivemind): over half of the check's time, for nothing the
    checker uses. The report is the same (the same blocks at the same lines, also checked at 2 and 3
    lines over src, tests, tools and bench)."""
    from astroid.exceptions import AstroidImportError
    from astroid.manager import AstroidManager

    def cached_only(self, modname, context_file=None, use_cache=True):
        if modname in self.astroid_cache:  # a checked file, or a module astroid itself made
            return self.astroid_cache[modname]
        raise AstroidImportError(f"not built for the duplicate-code check: {modname!r}")

    AstroidManager.ast_from_module_name = cached_only
    from pylint.lint import Run

    Run(args)


def main() -> int:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *COMMAND], cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if proc.returncode & FAILED:
        print(proc.stdout + proc.stderr)
        print(f"duplicate-code: pylint failed (exit status {proc.returncode}), see above", file=sys.stderr)
        return 1
    blocks = proc.stdout.count(": R0801: ")
    if blocks > MAX_BLOCKS:
        print(proc.stdout)
        print(
            f"duplicate-code: {blocks} duplicated blocks in src/swarmtrain, more than the {MAX_BLOCKS} allowed "
            "(tools/check_duplicates.py MAX_BLOCKS): factor the new copy out (pylint's report is above)",
            file=sys.stderr,
        )
        return 1
    hint = f": lower MAX_BLOCKS in tools/check_duplicates.py to {blocks}" if blocks < MAX_BLOCKS else ""
    print(
        f"duplicate-code: {blocks} duplicated blocks in src/swarmtrain (at most {MAX_BLOCKS}){hint} [{seconds:.0f} s]"
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pylint"]:
        pylint_without_imports(sys.argv[2:])  # exits with pylint's status
    sys.exit(main())
