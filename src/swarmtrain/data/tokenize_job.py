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

The validation split must hold at least one window of the run's `seq_len` + 1 tokens, or training
refuses it ("not one sample"). `seq_len` is the run's, given (`--seq-len`) or, by default, the longest
of the presets that use this tokenizer (64 for swarmtrain:llama-tiny; `DEFAULT_SEQ_LEN` for a
tokenizer no preset names). A corpus too small for `val_fraction` to give that (no hash below it: 30
documents at 0.01 miss 74% of the time; or a few short documents below it) still gets it: while
validation holds less than one window, the documents with the smallest hashes so far (identical copies
together), as few as hold a window between them, are held back from training (`_HeldBack`); if the
corpus ends with validation short of a window, the smallest of them complete it
(TokenizeSummary.val_fallback), otherwise they are written to training once validation holds a window.
The result is still a property of the corpus, not of the order or of a resume. A corpus that cannot
give both splits a window (one document, copies of one text, too few tokens) is a DataError, for one
document before anything is written; so are shards or a `val_tokens` cap smaller than a window.
`val_fraction` 0 or `val_tokens` 0 ask for no validation split, and get none.

Resume: every `checkpoint_every_s` (at a chunk boundary, so both streams end on a document) the
writers are fsynced and manifest.json records how many source documents are done, how many tokens
each split holds and which documents are held back (index, hash and copies of each). A rerun of the same
command skips those documents (reading the held-back ones again on the way), cuts the partial shards
back to the recorded lengths and continues; the shards are byte-identical to an uninterrupted run's.
"""

from __future__ import annotations

import bisect
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

from swarmtrain.config.presets import PRESETS
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
# the run's sequence length when neither --seq-len nor a preset using the tokenizer says: gpt2-small's
# and llama-125m's, so validation holds at least 1,025 tokens (a negligible share of a real corpus)
DEFAULT_SEQ_LEN = 1024
# settings a resumed run must share with the run that started the directory
_SETTING_KEYS = (
    "sources",
    "tokenizer_hash",
    "text_field",
    "shard_tokens",
    "val_fraction",
    "val_tokens",
    "seq_len",
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
    # val_fraction held out less than a window: the documents with the smallest hashes completed it
    val_fallback: bool = False
    seq_len: int = DEFAULT_SEQ_LEN  # validation and training hold at least one window of seq_len + 1

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


def default_seq_len(tokenizer: str) -> int:
    """The sequence length a run on this tokenizer's shards uses, as far as tokenize can tell: the longest
    of the presets whose data.tokenizer it is, else DEFAULT_SEQ_LEN."""
    lengths = [p().model.seq_len for p in PRESETS.values() if p().data.tokenizer == tokenizer]
    return max(lengths, default=DEFAULT_SEQ_LEN)


def _check_window(seq_len: int, shard_tokens: int, val_tokens: int, hold_out: bool) -> None:
    """DataError, naming the flag, for settings under which no shard of a split could hold a window."""
    window = seq_len + 1
    if shard_tokens < window:
        raise DataError(
            f"--shard-tokens {shard_tokens:,} is less than one window of {window} tokens (--seq-len {seq_len} "
            f"+ 1): no shard would hold a sample; use --shard-tokens >= {window}"
        )
    if hold_out and val_tokens < window:
        raise DataError(
            f"--val-tokens {val_tokens:,} is less than one window of {window} tokens (--seq-len {seq_len} + 1): "
            f"validation would hold no sample; use --val-tokens >= {window}, or 0 for no validation split"
        )


@dataclass
class _Reserve:
    """A document held back from training while validation holds less than one window: its hash, its
    ids (with EOS), the source index of its first copy and how many identical copies were read."""

    index: int
    hash: int
    ids: np.ndarray
    copies: int = 1

    @property
    def tokens(self) -> int:
        return len(self.ids) * self.copies

    def record(self) -> dict:
        return {"document": self.index, "hash": f"{self.hash:016x}", "copies": self.copies}

    def parts(self) -> list[np.ndarray]:
        return [self.ids] * self.copies


class _HeldBack:
    """The documents with the smallest hashes read so far, as few as hold `window` tokens between them
    (all of them while they hold less), in hash order. A document pushed out never belongs again: those
    with smaller hashes hold a window already, and only gain copies and company. So which documents are
    held is a property of the documents read, not of their order."""

    def __init__(self, window: int, entries: Sequence[_Reserve] = ()) -> None:
        self.window = window
        self.entries = sorted(entries, key=lambda e: e.hash)

    def offer(self, index: int, digest64: int, ids: np.ndarray) -> list[np.ndarray]:
        """Hold this document if it is among the smallest; returns what is held no longer (training's)."""
        for entry in self.entries:
            if entry.hash == digest64 and np.array_equal(entry.ids, ids):
                entry.copies += 1  # duplicates land together
                return []
        bisect.insort(self.entries, _Reserve(index, digest64, ids), key=lambda e: e.hash)
        released: list[np.ndarray] = []
        while len(self.entries) > 1 and sum(e.tokens for e in self.entries[:-1]) >= self.window:
            released += self.entries.pop().parts()
        return released

    def release(self) -> list[np.ndarray]:
        """Everything held, for training."""
        parts = [part for entry in self.entries for part in entry.parts()]
        self.entries = []
        return parts


class _Split:
    """Which split each document goes to (see the module docstring), and what validation holds."""

    def __init__(self, hold_out: bool, val_fraction: float, val_tokens: int, window: int, done: dict) -> None:
        self.hold_out, self.window = hold_out, window
        self.threshold, self.max_val_tokens = val_fraction * 2**64, val_tokens
        self.val_tokens, self.val_documents = done["val_tokens"], done["val_documents"]
        self.fallback = bool(done.get("val_fallback"))
        self.held = _HeldBack(window)
        self.one_text = False  # every document was the same text (set by `finish`)

    def chunk(self, first: int, arrays: Sequence[np.ndarray], hashes: Sequence[int]) -> tuple[list, list]:
        """(training's, validation's) token arrays of a chunk whose first document is number `first`."""
        train: list[np.ndarray] = []
        val: list[np.ndarray] = []
        for offset, (ids, digest64) in enumerate(zip(arrays, hashes, strict=True)):
            if self.hold_out and digest64 < self.threshold and self.val_tokens < self.max_val_tokens:
                val.append(ids)
                self.val_tokens += len(ids)
                self.val_documents += 1
                if self.val_tokens >= self.window:  # validation holds a window: the held ones are training's
                    train += self.held.release()
            elif not self.hold_out or self.val_tokens >= self.window:
                train.append(ids)
            else:
                train += self.held.offer(first + offset, digest64, ids)
        return train, val

    def finish(self, documents: int) -> tuple[list, list]:
        """At the corpus' end, (training's, validation's) share of what is held: the smallest hashes
        complete validation to a window."""
        entries = self.held.entries
        self.one_text = len(entries) == 1 and entries[0].copies == documents
        val: list[np.ndarray] = []
        while entries and self.val_tokens < self.window:
            entry = entries.pop(0)
            val += entry.parts()
            self.val_tokens += entry.tokens
            self.val_documents += entry.copies
            self.fallback = True
        return self.held.release(), val

    def check(self, train_tokens: int, documents: int, sources: Sequence[str], out: Path) -> None:
        """DataError unless both splits hold a window (when validation is asked for)."""
        if not self.hold_out or min(train_tokens, self.val_tokens) >= self.window:
            return
        where, incomplete = ", ".join(sources), f"(and delete {out}, which holds this incomplete run)"
        if self.one_text:
            raise DataError(
                f"all {documents:,} documents of {where} are the same text, which cannot be split into "
                f"training and validation: give tokenize different documents {incomplete}"
            )
        raise DataError(
            f"{where} holds {train_tokens + self.val_tokens:,} tokens, too few for a window of {self.window} "
            f"tokens (--seq-len {self.window - 1} + 1) in both training and validation: give tokenize more "
            f"text, or pass --seq-len with the run's model.seq_len if it is shorter {incomplete}"
        )


def tokenize(
    sources: Sequence[str],
    tokenizer: str,
    out_dir: str | os.PathLike[str],
    *,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    val_tokens: int = DEFAULT_VAL_TOKENS,
    seq_len: int | None = None,
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
    val_tokens above 0 both splits hold at least one window of `seq_len` + 1 tokens (None: the
    tokenizer's `default_seq_len`), or this raises DataError (see the module docstring)."""
    if shard_tokens <= 0 or val_tokens < 0 or not 0 <= val_fraction < 1 or chunk_chars <= 0:
        raise DataError("need shard_tokens > 0, val_tokens >= 0, 0 <= val_fraction < 1")
    seq_len = default_seq_len(tokenizer) if seq_len is None else seq_len
    hold_out = val_fraction > 0 and val_tokens > 0  # a validation split is asked for
    _check_window(seq_len, shard_tokens, val_tokens, hold_out)
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
        "seq_len": seq_len,
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

    dtype = token_dtype(vocab)
    docs = iter_documents(sources, text_field, max_bytes)
    split = _Split(hold_out, val_fraction, val_tokens, seq_len + 1, done)
    if done["documents"] == 0:
        docs = _first_documents(docs, sources, hold_out)
    else:
        docs, held = _skip_done(docs, done["documents"], done.get("reserve") or [], tok, eos, dtype)
        split.held = _HeldBack(seq_len + 1, held)
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
    resumed = documents = done["documents"]
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
            val_documents=split.val_documents,
            train_tokens=train.tokens_written,
            val_tokens=val.tokens_written,
            reserve=[entry.record() for entry in split.held.entries],
            val_fallback=split.fallback,
        )
        manifest["shards"] = train.shards() + val.shards()
        manifest["complete"] = complete
        write_manifest(out, manifest)

    def write(train_parts: list[np.ndarray], val_parts: list[np.ndarray]) -> None:
        if train_parts:
            train.write(np.concatenate(train_parts))
        if val_parts:
            val.write(np.concatenate(val_parts))

    reader.start()
    try:
        for chunk_index, (texts, hashes) in enumerate(reader, 1):
            arrays = encode_batch(tok, texts, eos, dtype)
            write(*split.chunk(documents, arrays, hashes))
            documents += len(texts)
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
        write(*split.finish(documents))
        split.check(train.tokens_written, documents, sources, out)
        train.finish()
        val.finish()
        checkpoint(complete=True)
    finally:
        reader.stop()
        train.close()
        val.close()
        bar.close()
    return _summary(manifest, out, digest, resumed, new_tokens, time.monotonic() - started)


def _first_documents(docs: Iterator[str], sources: Sequence[str], hold_out: bool) -> Iterator[str]:
    """`docs`, after reading the first ones before anything is written, so that a wrong --text-field,
    an empty source or a corpus of one document fails without leaving a directory behind."""
    first = list(itertools.islice(docs, 2))
    if not first:
        raise DataError(f"no text in {', '.join(sources)}")
    if len(first) == 1 and hold_out:
        raise DataError(
            f"{', '.join(sources)} holds a single document, which cannot be split into training and "
            f"validation: give tokenize at least 2 documents (e.g. 2 or more files; a text file is one "
            f"document up to {TEXT_BLOCK_BYTES // 2**20} MiB)"
        )
    return itertools.chain(first, docs)


def _skip_done(
    docs: Iterator[str], done: int, records: list[dict], tok: Any, eos: int, dtype: np.dtype
) -> tuple[Iterator[str], list[_Reserve]]:
    """`docs` after the `done` documents an interrupted run finished (consumed here), and the documents
    it held back, which `records` name, read again on the way."""
    wanted = {record["document"]: record for record in records}
    held = []
    for index, text in enumerate(itertools.islice(docs, done)):
        record = wanted.pop(index, None)
        if record is None:
            continue
        if document_hash(text) != int(record["hash"], 16):
            wanted[index] = record  # reported below
            break
        ids = encode_batch(tok, [text], eos, dtype)[0]
        held.append(_Reserve(index, int(record["hash"], 16), ids, record["copies"]))
    if wanted:
        raise DataError(
            f"document {min(wanted)} of the sources is not the one the interrupted run held back for "
            f"validation: the sources changed since; use another --out, or delete it to start over"
        )
    return docs, held


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
        seq_len=manifest["settings"]["seq_len"],
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
