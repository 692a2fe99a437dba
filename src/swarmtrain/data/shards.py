"""Pre-tokenized token shards on disk: the file format, a writer that fills fixed-size shards, the
directory manifest, and `ShardDataset`, which memory-maps shards and serves training windows.

A shard file (`train-00000.tok`, `val-00000.tok`, ...) is a 256-byte header followed by the tokens as
little-endian uint16 (vocabularies up to 65,536 ids) or uint32. Documents are joined with the EOS id
after each document; a document may continue from one shard into the next. Header (little-endian):

    offset  size  field
         0     8  magic b"SWRMTOKS"
         8     4  format version (uint32, 1)
        12     4  bytes per token (uint32: 2 = uint16, 4 = uint32)
        16     8  vocabulary size (uint64)
        24     8  token count (uint64; 0 while the shard is being written)
        32     8  EOS id (uint64)
        40    16  tokenizer hash (16 ASCII hex digits, tokenizer.tokenizer_hash)
        56   200  zero

`manifest.json` next to the shards records the tokenizer hash, vocabulary size, dtype, the shard list
with token counts, the settings of the tokenize run and its progress (for resume).

`ShardDataset` has exactly the interface of packing.PackedDataset: windows of seq_len + 1 tokens, cut
from each shard separately (a window never crosses a shard boundary, so a shard's tail shorter than a
window is unused), read from the page cache by memory map: a trainer's memory does not grow with the
corpus.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from swarmtrain.data.corpus import DataError

if TYPE_CHECKING:
    import torch

MAGIC = b"SWRMTOKS"
FORMAT_VERSION = 1
HEADER_BYTES = 256
_HEADER = struct.Struct("<8sIIQQQ16s")
_COUNT_OFFSET = 24  # where the token count sits in the header (rewritten when a shard is finished)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "swarmtrain-token-shards"
SUFFIX = ".tok"
PARTIAL_SUFFIX = ".tok.partial"  # a shard being written; renamed to .tok when full or at the end
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 2**24  # 32 MiB of uint16 per shard: few files, and a lost tail is negligible
_NAME = re.compile(r"^(train|val)-(\d{5,})\.tok(\.partial)?$")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids below `vocab_size`: uint16 up to 65,536 ids, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class ShardHeader:
    vocab_size: int
    token_bytes: int  # 2 or 4
    token_count: int
    eos_id: int
    tokenizer_hash: str
    version: int = FORMAT_VERSION

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<u2") if self.token_bytes == 2 else np.dtype("<u4")

    def pack(self) -> bytes:
        packed = _HEADER.pack(
            MAGIC,
            self.version,
            self.token_bytes,
            self.vocab_size,
            self.token_count,
            self.eos_id,
            self.tokenizer_hash.encode("ascii").ljust(16, b"\0")[:16],
        )
        return packed.ljust(HEADER_BYTES, b"\0")


def read_header(path: Path) -> ShardHeader:
    """The header of one shard file; a DataError naming the file if it is not one."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(HEADER_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read token shard {path}: {exc.strerror}") from None
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise DataError(f"{path} is not a swarmtrain token shard (bad header)")
    _magic, version, token_bytes, vocab, count, eos, digest = _HEADER.unpack_from(raw)
    if version != FORMAT_VERSION or token_bytes not in (2, 4):
        raise DataError(
            f"{path}: shard format version {version} with {token_bytes}-byte tokens is not supported "
            f"(this swarmtrain reads version {FORMAT_VERSION})"
        )
    return ShardHeader(vocab, token_bytes, count, eos, digest.rstrip(b"\0").decode("ascii"), version)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}{SUFFIX}"


class ShardWriter:
    """Appends tokens of one split to shards of exactly `shard_tokens` tokens (the last may be shorter).

    A shard is written as NAME.tok.partial with a zero token count and renamed to NAME.tok, count
    filled in, once full (or at `finish`). `tokens_written` is the resume position: a writer created
    with the `tokens_written` of a checkpoint cuts the partial shard back to it and deletes anything
    written after it, so a killed run continues exactly where the checkpoint was."""

    def __init__(
        self,
        directory: Path,
        split: str,
        *,
        vocab_size: int,
        eos_id: int,
        tokenizer_hash: str,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        tokens_written: int = 0,
    ) -> None:
        if shard_tokens <= 0:
            raise DataError(f"shard size must be positive, got {shard_tokens}")
        self.directory = Path(directory)
        self.split = split
        self.shard_tokens = shard_tokens
        self.dtype = token_dtype(vocab_size)
        self._header = ShardHeader(vocab_size, self.dtype.itemsize, 0, eos_id, tokenizer_hash)
        self.tokens_written = tokens_written
        self._file: Any = None  # the open .partial shard, if any
        self._finished = False
        self._resume()

    @property
    def _index(self) -> int:
        return self.tokens_written // self.shard_tokens

    @property
    def _position(self) -> int:
        """Tokens in the current (partial) shard."""
        return self.tokens_written % self.shard_tokens

    def _path(self, index: int, partial: bool) -> Path:
        name = shard_name(self.split, index)
        return self.directory / (name.removesuffix(SUFFIX) + PARTIAL_SUFFIX if partial else name)

    def _resume(self) -> None:
        index, position = self._index, self._position
        for i in range(index):
            path = self._path(i, partial=False)
            if not path.is_file() or read_header(path).token_count != self.shard_tokens:
                raise DataError(
                    f"cannot resume: {path} is missing or incomplete although the manifest counts it as "
                    f"written; delete {self.directory} and start again"
                )
        for path in self.directory.glob(f"{self.split}-*{SUFFIX}*"):
            match = _NAME.match(path.name)
            if match and (int(match.group(2)) > index or (int(match.group(2)) == index and position == 0)):
                path.unlink()  # written after the checkpoint: it will be written again
        if position == 0:
            return
        partial, final = self._path(index, partial=True), self._path(index, partial=False)
        if final.is_file():
            # finished after the checkpoint by a document that will be written again: reopen it
            final.replace(partial)
        size = HEADER_BYTES + position * self.dtype.itemsize
        if not partial.is_file() or partial.stat().st_size < size:
            raise DataError(
                f"cannot resume: {partial} holds fewer tokens than the manifest's checkpoint; delete "
                f"{self.directory} and start again"
            )
        self._file = open(partial, "r+b")
        self._file.truncate(size)
        self._file.seek(size)

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens (any integer dtype; values must be below the vocabulary size)."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        while len(data):
            if self._file is None:
                self._file = open(self._path(self._index, partial=True), "wb")
                self._file.write(self._header.pack())
            room = self.shard_tokens - self._position
            part, data = data[:room], data[room:]
            self._file.write(part.tobytes())
            self.tokens_written += len(part)
            if self._position == 0:  # the shard just filled up
                self._finish_shard(self.shard_tokens, self._index - 1)

    def _finish_shard(self, count: int, index: int) -> None:
        handle, self._file = self._file, None
        handle.seek(_COUNT_OFFSET)
        handle.write(struct.pack("<Q", count))
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        self._path(index, partial=True).replace(self._path(index, partial=False))

    def sync(self) -> None:
        """Make everything written so far durable (before a checkpoint records `tokens_written`)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def finish(self) -> None:
        """Close the last shard (shorter than shard_tokens) as a finished shard."""
        if self._file is not None:
            self._finish_shard(self._position, self._index)
        self._finished = True

    def close(self) -> None:
        """Stop without finishing (an interrupted run): the partial shard stays for resume."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def shards(self) -> list[dict]:
        """Finished shards as manifest entries {name, split, tokens}."""
        full, rest = divmod(self.tokens_written, self.shard_tokens)
        counts = [self.shard_tokens] * full + ([rest] if rest and self._finished else [])
        return [
            {"name": shard_name(self.split, i), "split": self.split, "tokens": n}
            for i, n in enumerate(counts)
        ]


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a shard directory, None if there is none; a DataError if it is unreadable."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path} is not a swarmtrain token shard manifest")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> None:
    """Replace the manifest atomically and durably (it is the resume checkpoint)."""
    path = Path(directory) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def is_shard_dir(path: str | os.PathLike[str]) -> bool:
    """A directory of token shards: a swarmtrain manifest.json, or .tok files."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return False
    manifest = directory / MANIFEST
    if manifest.is_file():
        try:
            return json.loads(manifest.read_text(encoding="utf-8")).get("format") == MANIFEST_FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    return any(_NAME.match(p.name) for p in directory.glob(f"*{SUFFIX}"))


@dataclass(frozen=True)
class ShardDirectory:
    """The finished shards of a directory and the vocabulary they were written with."""

    path: Path
    train: list[Path]
    val: list[Path]
    vocab_size: int
    tokenizer_hash: str
    eos_id: int


def open_shard_dir(path: str | os.PathLike[str]) -> ShardDirectory:
    """Shards listed by the manifest (which must say the tokenize run finished), or, without a
    manifest, every train-*.tok and val-*.tok; all headers must agree."""
    directory = Path(path).expanduser()
    manifest = read_manifest(directory)
    if manifest is not None:
        if not manifest.get("complete"):
            raise DataError(
                f"token shards in {directory} are incomplete (the tokenize run was interrupted): rerun the "
                f"same `swarmtrain tokenize` command to finish them"
            )
        names = {split: [s["name"] for s in manifest["shards"] if s["split"] == split] for split in SPLITS}
    else:
        names = {split: sorted(p.name for p in directory.glob(f"{split}-*{SUFFIX}")) for split in SPLITS}
    paths = {split: [directory / n for n in names[split]] for split in SPLITS}
    headers = {p: read_header(p) for split in SPLITS for p in paths[split]}
    if not paths["train"]:
        raise DataError(f"no training shards (train-*.tok) in {directory}")
    first = headers[paths["train"][0]]
    for shard, header in headers.items():
        if (header.vocab_size, header.tokenizer_hash, header.eos_id) != (
            first.vocab_size,
            first.tokenizer_hash,
            first.eos_id,
        ):
            raise DataError(
                f"{shard} was written with tokenizer {header.tokenizer_hash} (vocab {header.vocab_size}) but "
                f"{paths['train'][0]} with {first.tokenizer_hash} (vocab {first.vocab_size}): one directory, "
                f"one tokenizer"
            )
    if manifest is not None:
        recorded = {s["name"]: s["tokens"] for s in manifest["shards"]}
        for shard, header in headers.items():
            if header.token_count != recorded[shard.name]:
                raise DataError(
                    f"{shard} holds {header.token_count} tokens but the manifest records "
                    f"{recorded[shard.name]}: the directory was modified"
                )
    return ShardDirectory(
        directory, paths["train"], paths["val"], first.vocab_size, first.tokenizer_hash, first.eos_id
    )


class ShardDataset:
    """Windows of seq_len + 1 tokens from memory-mapped shards; the PackedDataset interface.

    Window i of the dataset is window j of shard s, where shards are taken in order and each holds
    floor(tokens / (seq_len + 1)) windows. Reads copy only the requested windows out of the page cache."""

    def __init__(self, paths: Sequence[Path], seq_len: int) -> None:
        if not paths:
            raise DataError("a shard dataset needs at least one shard")
        self.paths = [Path(p) for p in paths]
        self.seq_len = seq_len
        self.window = seq_len + 1
        headers = [read_header(p) for p in self.paths]
        self.vocab_size = headers[0].vocab_size
        self.tokenizer_hash = headers[0].tokenizer_hash
        self.eos_id = headers[0].eos_id
        self.dtype = headers[0].dtype
        self.tokens = sum(h.token_count for h in headers)
        self._views: list[np.ndarray] = []  # per shard: (windows, seq_len + 1), memory-mapped
        counts = []
        for path, header in zip(self.paths, headers, strict=True):
            if header.dtype != self.dtype or header.tokenizer_hash != self.tokenizer_hash:
                raise DataError(f"{path} does not match {self.paths[0]} (token dtype or tokenizer)")
            needed = HEADER_BYTES + header.token_count * header.token_bytes
            if path.stat().st_size < needed:
                raise DataError(f"{path} is truncated: its header promises {header.token_count} tokens")
            windows = header.token_count // self.window
            counts.append(windows)
            if windows:
                mapped = np.memmap(
                    path, dtype=header.dtype, mode="r", offset=HEADER_BYTES, shape=(windows * self.window,)
                )
                self._views.append(mapped.reshape(windows, self.window))
            else:
                self._views.append(np.zeros((0, self.window), dtype=self.dtype))
        # window index where each shard starts, plus the total at the end
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "seq_len": self.seq_len}  # memory maps are reopened, not pickled

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["paths"], state["seq_len"])  # type: ignore[misc]

    def windows_of(self, indices: Any) -> np.ndarray:
        """The windows (len(indices), seq_len + 1) at these dataset indices, in the shards' dtype."""
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}")
        shard = np.searchsorted(self._starts, index, side="right") - 1
        out = np.empty((index.size, self.window), dtype=self.dtype)
        for s in np.unique(shard):
            rows = shard == s
            out[rows] = self._views[s][index[rows] - self._starts[s]]
        return out

    def batch(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        rows = torch.from_numpy(self.windows_of(indices).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def ordered_batches(
        self, batch_size: int, max_samples: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic, unshuffled batches (for validation)."""
        count = len(self) if max_samples is None else min(len(self), max_samples)
        for start in range(0, count, batch_size):
            yield self.batch(range(start, min(start + batch_size, count)))

    def label_counts(self, max_tokens: int = 2**22) -> np.ndarray:
        """How often each id occurs among the labels of the first windows (at most `max_tokens` labels),
        length vocab_size: a bounded sample for unigram statistics."""
        windows = self.windows_of(range(min(len(self), max(1, max_tokens // self.seq_len))))
        return np.bincount(windows[:, 1:].reshape(-1), minlength=self.vocab_size)
