"""Small file helpers shared by the command-line tools."""

from __future__ import annotations

from pathlib import Path


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader (a script, a test waiting
    for the file) never sees half of it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(target)
