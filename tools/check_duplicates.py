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
COMMAND = ["-m", "pylint", "--disable=all", "--enable=duplicate-code", "--score=n", "src/swarmtrain"]
FAILED = 1 | 2 | 32  # pylint's exit-status bits for fatal, error and usage error (8, refactor, is R0801)


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
    sys.exit(main())
