"""Documents (str) streamed from the sources `swarmtrain tokenize` and `swarmtrain tokenizer train` read.

A source is `stdlib` (this Python's standard library .py files, in corpus.py's order), a text file, a
folder (recursive: every non-hidden file by its suffix, binary files skipped), a `.jsonl` or
`.jsonl.zst` file (one JSON object per line), a `.parquet` file, a directory written by
`datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (its train split), or `hf:NAME[:CONFIG]`
(a Hugging Face hub dataset, streamed). Structured sources take the text from `text_field`.

Everything streams: at most one row batch of a parquet file or dataset, one line of a JSONL file or
one block of a text file is in memory, so a corpus of any size can be read. The order is deterministic
(sources in the given order, folder entries sorted), which tokenize's resume relies on.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from swarmtrain.data.corpus import DataError, _stdlib_files

STDLIB = "stdlib"
HF_PREFIX = "hf:"
_BINARY_PROBE_BYTES = 8192  # as corpus.py: a NUL byte in a file's first 8 KiB marks it binary
# A text file up to this size is one document; a larger one (a whole dump in one file) is cut into
# documents of about this size at blank lines, so one file never has to fit in memory (and the
# tokenizer never holds the per-token objects of a whole book at once).
TEXT_BLOCK_BYTES = 2**20
_ROWS_PER_BATCH = 1024  # parquet / dataset rows read at once


def iter_documents(
    sources: Sequence[str], text_field: str = "text", max_bytes: int | None = None
) -> Iterator[str]:
    """Non-empty documents of every source in order; with `max_bytes`, stop after that many bytes of
    UTF-8 text (the last document is cut)."""
    if not sources:
        raise DataError("no data sources given")
    remaining = max_bytes
    for source in sources:
        for doc in source_documents(source, text_field):
            if not doc:
                continue
            if remaining is not None:
                size = len(doc.encode("utf-8", errors="surrogatepass"))
                if size >= remaining:
                    cut = doc.encode("utf-8", errors="surrogatepass")[:remaining].decode(
                        "utf-8", errors="ignore"
                    )
                    if cut:
                        yield cut
                    return
                remaining -= size
            yield doc


def source_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """The documents of one source (see the module docstring for the forms)."""
    if source == STDLIB:
        for path in _stdlib_files():
            yield from _text_documents(path)
        return
    if source.startswith(HF_PREFIX):
        yield from _hub_documents(source[len(HF_PREFIX) :], text_field)
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data path does not exist: {path}")
    if path.is_dir():
        if is_saved_dataset(path):
            yield from _saved_dataset_documents(path, text_field)
            return
        if (path / "manifest.json").is_file() and any(path.glob("*.tok")):
            raise DataError(f"{path} holds token shards already (train with data.source = {str(path)!r})")
        files = folder_files(path)
        if not files:
            raise DataError(f"data folder is empty: {path}")
    else:
        files = [path]
    for file in files:
        yield from file_documents(file, text_field)


def folder_files(root: Path) -> list[Path]:
    """Files under `root`, recursive, sorted; hidden files and folders (.git, .cache) are skipped."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return found


def file_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """One file's documents, by suffix: .jsonl / .jsonl.zst rows, .parquet rows, else text."""
    name = path.name.lower()
    if name.endswith(".jsonl") or name.endswith(".jsonl.zst"):
        yield from _jsonl_documents(path, text_field)
    elif name.endswith(".parquet"):
        yield from _parquet_documents(path, text_field)
    else:
        yield from _text_documents(path)


def _text_documents(path: Path) -> Iterator[str]:
    try:
        handle = open(path, "rb")
    except OSError:
        return  # unreadable files (permissions, races) are skipped, as corpus.py does
    with handle:
        block = handle.read(TEXT_BLOCK_BYTES)
        if not block or b"\x00" in block[:_BINARY_PROBE_BYTES]:
            return  # empty or binary
        while True:
            more = handle.read(TEXT_BLOCK_BYTES)
            if not more:
                if block:
                    yield block.decode("utf-8", errors="replace")
                return
            block += more
            cut = _cut_point(block, TEXT_BLOCK_BYTES)
            yield block[:cut].decode("utf-8", errors="replace")
            block = block[cut:]


def _cut_point(data: bytes, limit: int) -> int:
    """Where to end a document of at most `limit` bytes: after the last blank line, else the last
    newline, else at a UTF-8 character boundary (never inside a multi-byte character)."""
    for sep in (b"\n\n", b"\n"):
        at = data.rfind(sep, 0, limit)
        if at > 0:
            return at + len(sep)
    cut = min(limit, len(data))
    while cut > 0 and cut < len(data) and (data[cut] & 0xC0) == 0x80:  # a continuation byte
        cut -= 1
    return cut or limit


def _row_text(row: Any, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected a JSON object with a {text_field!r} field, got {type(row).__name__}"
        )
    if text_field not in row:
        raise _missing_field(text_field, list(row), where)
    value = row[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value


def _missing_field(text_field: str, columns: Iterable[str], where: str) -> DataError:
    names = ", ".join(repr(c) for c in columns) or "none"
    return DataError(
        f"{where} has no text field {text_field!r}; its fields are {names} (choose one with --text-field "
        f"or data.text_field)"
    )


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    with raw:
        stream: io.BufferedIOBase | Any = raw
        if path.name.lower().endswith(".zst"):
            import zstandard

            # read_across_frames: files concatenated from several compressed pieces are one stream
            stream = io.BufferedReader(
                zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
            )
        try:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{number}: not JSON ({exc})") from None
                yield _row_text(row, text_field, f"{path}:{number}")
        except DataError:
            raise
        except Exception as exc:  # zstandard.ZstdError on a corrupt or truncated file
            raise DataError(f"cannot read {path}: {exc}") from None


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("parquet sources need pyarrow: pip install 'swarmtrain[hf]'") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow.ArrowInvalid on a file that is not parquet
        raise DataError(f"cannot read parquet file {path}: {exc}") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise _missing_field(text_field, columns, str(path))
    # one batch of one column at a time: memory is bounded by a batch (and pyarrow's row-group buffer)
    for batch in parquet.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "Hugging Face dataset sources need `datasets`: pip install 'swarmtrain[hf]'"
        ) from None
    return datasets


def _saved_dataset_documents(path: Path, text_field: str) -> Iterator[str]:
    datasets = _import_datasets()
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(f"cannot load saved dataset {path}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"saved dataset {path} has no 'train' split; its splits are {', '.join(loaded)}")
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise _missing_field(text_field, loaded.column_names, str(path))
    # the arrow files are memory-mapped; iterating batches of one column keeps memory bounded
    for batch in loaded.select_columns([text_field]).iter(batch_size=_ROWS_PER_BATCH):
        for value in batch[text_field]:
            if value is not None:
                yield str(value)


def _hub_documents(spec: str, text_field: str) -> Iterator[str]:
    datasets = _import_datasets()
    name, _, config = spec.partition(":")
    hint = "(is the Hugging Face hub reachable? a saved dataset directory or local files work offline)"
    try:
        rows = iter(datasets.load_dataset(name, config or None, split="train", streaming=True))
        first = next(rows, None)
    except Exception as exc:
        raise DataError(f"cannot load Hugging Face dataset {spec!r} {hint}: {exc}") from None
    if first is None:
        return
    yield _row_text(first, text_field, f"Hugging Face dataset {spec!r}")
    try:
        for row in rows:
            yield _row_text(row, text_field, f"Hugging Face dataset {spec!r}")
    except DataError:
        raise
    except Exception as exc:  # the stream broke off (network)
        raise DataError(f"reading Hugging Face dataset {spec!r} failed {hint}: {exc}") from None


def describe_sources(sources: Sequence[str]) -> list[str]:
    """Sources as they are recorded in a manifest: paths made absolute, names kept."""
    return [
        s if s == STDLIB or s.startswith(HF_PREFIX) else str(Path(s).expanduser().resolve()) for s in sources
    ]
