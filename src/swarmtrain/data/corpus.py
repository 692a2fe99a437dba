"""Where text comes from: this Python's standard library (on every machine, no download), the user's own
files or folders, or a Hugging Face dataset when `datasets` is installed. Documents are bytes."""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from swarmtrain.config import DataConfig
from swarmtrain.config.errors import UserError

_BINARY_PROBE_BYTES = 8192


class DataError(UserError):
    """The data source is missing, empty or unreadable."""


def load_documents(cfg: DataConfig) -> list[bytes]:
    """Documents in a deterministic order, capped at `cfg.max_corpus_bytes` in total."""
    if cfg.source == "stdlib":
        docs = _files_to_documents(_stdlib_files(), cfg.max_corpus_bytes)
    elif cfg.source.startswith("hf:"):
        docs = _hf_documents(cfg.source[3:], cfg.max_corpus_bytes)
    else:
        docs = _files_to_documents(_user_files(Path(cfg.source).expanduser()), cfg.max_corpus_bytes)
    if not docs:
        raise DataError(f"data source {cfg.source!r} contains no text")
    return docs


def _stdlib_files() -> list[Path]:
    """The standard library's .py files, excluding third-party packages, ordered by a hash of the
    relative path so that a byte cap samples the whole library rather than its alphabetical start."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    return sorted(files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())


def _user_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"data path does not exist: {path}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"data folder is empty: {path}")
    return files


def _files_to_documents(files: list[Path], max_bytes: int) -> list[bytes]:
    docs, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, races) are skipped, not fatal
        if not data or b"\x00" in data[:_BINARY_PROBE_BYTES]:
            continue  # empty or binary
        data = data[: max_bytes - total]
        docs.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return docs


def _hf_documents(spec: str, max_bytes: int) -> list[bytes]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise DataError("Hugging Face sources need `datasets`: pip install 'swarmtrain[hf]'") from None
    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    except Exception as exc:
        raise DataError(f"cannot load Hugging Face dataset {spec!r}: {exc}") from None
    return list(_take_text(ds, max_bytes))


def _take_text(rows, max_bytes: int) -> Iterator[bytes]:
    total = 0
    for row in rows:
        data = str(row.get("text", "")).encode()
        if data:
            yield data[: max_bytes - total]
            total += len(data)
        if total >= max_bytes:
            return
