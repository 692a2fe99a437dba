"""`swarmtrain tokenize`: stream documents from sources, tokenize them on all cores and write train and
validation token shards (shards.py) that training memory-maps.

Pipeline: a reader thread pulls documents (sources.py) and groups them into chunks of about
`chunk_chars` characters in a bounded queue; the main thread encodes a chunk with tokenizers'
encode_batch (Rust threads, GIL released, so reading continues meanwhile) and appends each document's
ids plus EOS to the train or validation writer. Memory is a few chunks and one held-back document
(below), whatever the corpus size.

Validation documents are those whose content hash falls below `val_fraction` (until the validation
split holds `val_tokens` tokens): a property of the document, so a document is in exactly one split,
duplicates land together, and the choice does not depend on the order or on where a run was resumed.

A corpus too small for `val_fraction` (no hash below it: 30 documents at 0.01 miss 74% of the time)
still gets a validation split: until a document goes to validation, the one with the smallest hash so
far (with its identical copies) is held back from training; if the corpus ends with none in
validation, that document is it (TokenizeSummary.val_fallback), otherwise it is written to training
when the first validation document comes. The result is still a property of the corpus, not of the
order or of a resume. A corpus of one document (or of copies of one text) cannot be split: a DataError,
for one document before anything is written. `val_fraction` 0 or `val_tokens` 0 ask for no validation
split, and get none.

Resume: every `checkpoint_every_s` (at a chunk boundary, so both streams end on a document) the
writers are fsynced and manifest.json records how many source documents are done, how many tokens
each split holds and which document is held back (its index, hash and copies). A rerun of the same
command skips those documents (reading the held-back one again on the way), cuts the partial shards
back to the recorded lengths and continues; the shards are byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from swarmtrain.data.corpus import DataError
from swarmtrain.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    ShardWriter,
    read_manifest,
    token_dtype,
    write_manifest,
)
from swarmtrain.data.sources import TEXT_BLOCK_BYTES, describe_sources, iter_documents
from swarmtrain.data.tokenizer import encode_batch, eos_id, load_tokenizer, tokenizer_hash, vocab_size

DEFAULT_VAL_FRACTION = 0.01
DEFAULT_VAL_TOKENS = 2**23  # 8M tokens: thousands of validation windows, a negligible share of a big corpus
CHUNK_CHARS = 2**20  # text per encode_batch call: ~0.1-0.3 s of work, ~30 MB of Encoding objects at most
_QUEUE_CHUNKS = 4  # chunks read ahead of the encoder
CHECKPOINT_EVERY_S = 10.0
# settings a resumed run must share with the run that started the directory
_SETTING_KEYS = (
    "sources",
    "tokenizer_hash",
    "text_field",
    "shard_tokens",
    "val_fraction",
    "val_tokens",
    "max_bytes",
)


@dataclass
class TokenizeSummary:
    out_dir: Path
    tokenizer_hash: str
    train_shards: int
    val_shards: int
    train_tokens: int
    val_tokens: int
    documents: int  # source documents read in total
    val_documents: int
    new_tokens: int  # tokens written by this run (excludes what a resumed run found done)
    seconds: float  # this run
    resumed_documents: int = 0  # documents a resumed run found already done
    already_complete: bool = False
    # no hash fell below val_fraction: validation is the document with the smallest hash (and its copies)
    val_fallback: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        shards = (
            f"{self.train_shards} train shard(s), {self.train_tokens:,} tokens; {self.val_shards} val shard(s), "
            f"{self.val_tokens:,} tokens ({self.val_documents:,} documents)"
        )
        if self.already_complete:
            return f"{self.out_dir} is already complete: {shards}; tokenizer {self.tokenizer_hash}"
        resumed = f" (resumed after {self.resumed_documents:,} documents)" if self.resumed_documents else ""
        return (
            f"tokenized {self.documents:,} documents{resumed} into {self.out_dir}: {shards}; {self.seconds:.1f} s, "
            f"{self.tokens_per_s:,.0f} tokens/s; tokenizer {self.tokenizer_hash}"
        )


def document_hash(doc: str) -> int:
    """A 64-bit hash of a document's text. Read as a fraction of 2**64, a hash below val_fraction makes
    the document a validation candidate."""
    digest = hashlib.blake2b(doc.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class _Reserve:
    """The document held back from training while no document is in validation: the smallest hash so
    far, its ids (with EOS), the source index of its first copy and how many identical copies were read."""

    index: int
    hash: int
    ids: np.ndarray
    copies: int = 1

    def record(self) -> dict:
        return {"document": self.index, "hash": f"{self.hash:016x}", "copies": self.copies}

    def parts(self) -> list[np.ndarray]:
        return [self.ids] * self.copies


def tokenize(
    sources: Sequence[str],
    tokenizer: str,
    out_dir: str | os.PathLike[str],
    *,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    val_tokens: int = DEFAULT_VAL_TOKENS,
    max_bytes: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    chunk_chars: int = CHUNK_CHARS,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    on_chunk: Callable[[int], None] | None = None,
) -> TokenizeSummary:
    """Tokenize `sources` with `tokenizer` (a tokenizer spec, see tokenizer.load_tokenizer) into shards
    of `shard_tokens` tokens in `out_dir`, resuming a run that was interrupted there. `workers` caps the
    tokenizer's threads (only before this process first encodes a batch). `on_chunk(n)` is called after
    the n-th chunk is written (tests use it to interrupt a run at a known point). With val_fraction and
    val_tokens above 0 the validation split is never empty (see the module docstring)."""
    if shard_tokens <= 0 or val_tokens < 0 or not 0 <= val_fraction < 1 or chunk_chars <= 0:
        raise DataError("need shard_tokens > 0, val_tokens >= 0, 0 <= val_fraction < 1")
    if workers:
        # rayon reads this when it builds its thread pool, at this process's first parallel encode
        os.environ["RAYON_NUM_THREADS"] = str(workers)
    started = time.monotonic()
    tok = load_tokenizer(tokenizer)
    digest, eos, vocab = tokenizer_hash(tok), eos_id(tok, tokenizer), vocab_size(tok)
    out = Path(out_dir).expanduser()
    settings = {
        "sources": describe_sources(sources),
        "tokenizer_hash": digest,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "val_tokens": val_tokens,
        "max_bytes": max_bytes,
    }
    identity = {
        "tokenizer": tokenizer,
        "tokenizer_hash": digest,
        "vocab_size": vocab,
        "eos_id": eos,
        "dtype": token_dtype(vocab).name,
    }
    manifest = _start_or_resume(out, settings, identity)
    done = manifest["progress"]
    if manifest.get("complete"):
        return _summary(manifest, out, digest, done["documents"], 0, 0.0, already_complete=True)

    hold_out = val_fraction > 0 and val_tokens > 0  # a validation split is asked for
    dtype = token_dtype(vocab)
    docs = iter_documents(sources, text_field, max_bytes)
    reserve: _Reserve | None = None
    if done["documents"] == 0:
        # read the first documents before writing anything, so a wrong --text-field, an empty source or
        # a corpus that cannot be split fails without leaving a directory behind
        first = list(itertools.islice(docs, 2))
        if not first:
            raise DataError(f"no text in {', '.join(sources)}")
        if len(first) == 1 and hold_out:
            raise DataError(
                f"{', '.join(sources)} holds a single document, which cannot be split into training and "
                f"validation: give tokenize at least 2 documents (e.g. 2 or more files; a text file is one "
                f"document up to {TEXT_BLOCK_BYTES // 2**20} MiB)"
            )
        docs = itertools.chain(first, docs)
    elif done.get("reserve"):
        reserve = _recover_reserve(docs, done["documents"], done["reserve"], tok, eos, dtype)
    else:
        docs = itertools.islice(docs, done["documents"], None)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, manifest)

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "eos_id": eos,
        "tokenizer_hash": digest,
        "shard_tokens": shard_tokens,
    }
    train = ShardWriter(out, "train", tokens_written=done["train_tokens"], **common)
    val = ShardWriter(out, "val", tokens_written=done["val_tokens"], **common)
    reader = _ChunkReader(docs, chunk_chars, hold_out)
    resumed = done["documents"]
    documents, val_documents = done["documents"], done["val_documents"]
    val_fallback = bool(done.get("val_fallback"))
    threshold = val_fraction * 2**64
    new_tokens = 0
    bar = tqdm(
        desc="tokenize",
        unit=" docs",
        initial=documents,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    last_checkpoint = time.monotonic()

    def checkpoint(complete: bool = False) -> None:
        train.sync()
        val.sync()
        done.update(
            documents=documents,
            val_documents=val_documents,
            train_tokens=train.tokens_written,
            val_tokens=val.tokens_written,
            reserve=reserve.record() if reserve is not None else None,
            val_fallback=val_fallback,
        )
        manifest["shards"] = train.shards() + val.shards()
        manifest["complete"] = complete
        write_manifest(out, manifest)

    reader.start()
    try:
        for chunk_index, (texts, hashes) in enumerate(reader, 1):
            arrays = encode_batch(tok, texts, eos, dtype)
            train_parts, val_parts, val_pending = [], [], 0
            for offset, (ids, digest64) in enumerate(zip(arrays, hashes, strict=True)):
                if hold_out and digest64 < threshold and val.tokens_written + val_pending < val_tokens:
                    val_parts.append(ids)
                    val_pending += len(ids)
                    if reserve is not None:  # validation has a document: the held-back one is training's
                        train_parts += reserve.parts()
                        reserve = None
                elif not hold_out or val_documents or val_parts:
                    train_parts.append(ids)
                elif reserve is None or digest64 < reserve.hash:
                    if reserve is not None:
                        train_parts += reserve.parts()
                    reserve = _Reserve(documents + offset, digest64, ids)
                elif digest64 == reserve.hash and np.array_equal(ids, reserve.ids):
                    reserve.copies += 1  # duplicates land together
                else:
                    train_parts.append(ids)
            if train_parts:
                train.write(np.concatenate(train_parts))
            if val_parts:
                val.write(np.concatenate(val_parts))
            documents += len(texts)
            val_documents += len(val_parts)
            new_tokens += sum(len(a) for a in arrays)
            bar.update(len(texts))
            bar.set_postfix_str(
                f"{new_tokens / max(time.monotonic() - started, 1e-9):,.0f} tokens/s", refresh=False
            )
            if on_chunk is not None:
                on_chunk(chunk_index)
            if time.monotonic() - last_checkpoint >= checkpoint_every_s:
                checkpoint()
                last_checkpoint = time.monotonic()
        if reserve is not None:  # no hash fell below val_fraction: the smallest one is validation
            if reserve.copies == documents:
                raise DataError(
                    f"all {documents:,} documents of {', '.join(sources)} are the same text, which cannot be "
                    f"split into training and validation: give tokenize different documents (and delete "
                    f"{out}, which holds this incomplete run)"
                )
            val.write(np.concatenate(reserve.parts()))
            val_documents += reserve.copies
            reserve, val_fallback = None, True
        train.finish()
        val.finish()
        checkpoint(complete=True)
    finally:
        reader.stop()
        train.close()
        val.close()
        bar.close()
    return _summary(manifest, out, digest, resumed, new_tokens, time.monotonic() - started)


def _recover_reserve(
    docs: Iterator[str], done: int, record: dict, tok: Any, eos: int, dtype: np.dtype
) -> _Reserve:
    """Skip the `done` documents of `docs` (consuming them), keeping the held-back one `record` names."""
    index, expected = record["document"], int(record["hash"], 16)
    prefix = itertools.islice(docs, done)
    text = next(itertools.islice(prefix, index, None), None)
    collections.deque(prefix, maxlen=0)
    if text is None or document_hash(text) != expected:
        raise DataError(
            f"document {index} of the sources is not the one the interrupted run held back for validation: "
            f"the sources changed since; use another --out, or delete it to start over"
        )
    return _Reserve(index, expected, encode_batch(tok, [text], eos, dtype)[0], record["copies"])


def _start_or_resume(out: Path, settings: dict, identity: dict) -> dict:
    """The manifest to continue from: a fresh one, or the existing one when its settings match."""
    fresh = {
        "format": MANIFEST_FORMAT,
        "version": FORMAT_VERSION,
        **identity,
        "settings": settings,
        "complete": False,
        "progress": {"documents": 0, "val_documents": 0, "train_tokens": 0, "val_tokens": 0},
        "shards": [],
    }
    if not out.exists():
        return fresh
    if not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory")
    manifest = read_manifest(out)
    if manifest is None:
        if any(out.iterdir()):
            raise DataError(
                f"--out {out} is not empty and holds no token shards: choose an empty or new directory"
            )
        return fresh
    recorded = manifest.get("settings", {})
    differ = [key for key in _SETTING_KEYS if recorded.get(key) != settings[key]]
    if not differ:
        return manifest
    if not manifest.get("complete") and manifest["progress"]["documents"] == 0:
        return fresh  # a run that failed before its first checkpoint: nothing to keep
    changes = "; ".join(f"{key}: {recorded.get(key)!r} there, {settings[key]!r} now" for key in differ)
    raise DataError(
        f"{out} holds shards of a different tokenize run ({changes}): use another --out, or delete it to start over"
    )


def _summary(
    manifest: dict,
    out: Path,
    digest: str,
    resumed: int,
    new_tokens: int,
    seconds: float,
    already_complete: bool = False,
) -> TokenizeSummary:
    shards, done = manifest["shards"], manifest["progress"]
    return TokenizeSummary(
        out_dir=out,
        tokenizer_hash=digest,
        train_shards=sum(s["split"] == "train" for s in shards),
        val_shards=sum(s["split"] == "val" for s in shards),
        train_tokens=done["train_tokens"],
        val_tokens=done["val_tokens"],
        documents=done["documents"],
        val_documents=done["val_documents"],
        new_tokens=new_tokens,
        seconds=seconds,
        resumed_documents=resumed,
        already_complete=already_complete,
        val_fallback=bool(done.get("val_fallback")),
    )


_END = object()


class _ChunkReader:
    """A thread turning documents into (texts, their document_hash values) chunks in a bounded queue
    (hashes are 0 without `hashes`: no validation split). Iterating it yields the chunks in order and
    re-raises the reader's exception (a DataError about a source) in the consumer."""

    def __init__(self, docs: Iterator[str], chunk_chars: int, hashes: bool) -> None:
        self._docs = docs
        self._chunk_chars = chunk_chars
        self._hashes = hashes
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_CHUNKS)
        self._stopping = threading.Event()
        # daemon: a reader blocked in a slow source must not keep an interrupted process alive
        self._thread = threading.Thread(target=self._run, name="tokenize-reader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def _put(self, item: object) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            texts: list[str] = []
            hashes: list[int] = []
            chars = 0
            for doc in self._docs:
                texts.append(doc)
                hashes.append(document_hash(doc) if self._hashes else 0)
                chars += len(doc)
                if chars >= self._chunk_chars:
                    if not self._put((texts, hashes)):
                        return
                    texts, hashes, chars = [], [], 0
            if texts and not self._put((texts, hashes)):
                return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[list[str], list[int]]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
