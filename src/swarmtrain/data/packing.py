"""Token streams packed into fixed-length samples, a held-out validation split, and sharded batches.

`build_datasets` picks one of three data paths from the config:

- `data.source` is a directory of token shards (`swarmtrain tokenize`): the shards are memory-mapped
  (shards.ShardDataset) and their validation shards are the validation set;
- `data.tokenizer` is set: the text source (read up to `data.max_corpus_bytes`) is tokenized in memory,
  each document followed by the tokenizer's EOS, and the token array is cached on disk
  (~/.cache/swarmtrain/tokens) because every process of a swarm builds the same datasets;
- otherwise bytes: token = byte value, documents joined with a NUL byte (absent from text).

In memory, the stream is cut into windows of seq_len + 1 tokens: inputs are the first seq_len, labels
the last seq_len. The validation split is the tail of the token stream, so it never overlaps training
data. Every dataset has the same interface (`__len__`, `batch`, `ordered_batches`), so
`iterate_batches` shuffles and shards any of them the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from swarmtrain.config import DataConfig, RunConfig
from swarmtrain.data.corpus import DataError, _stdlib_files, load_documents
from swarmtrain.data.shards import ShardDataset, is_shard_dir, open_shard_dir

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SEPARATOR = 0
TOKEN_CACHE_VERSION = 1  # part of the cache key: bump when the tokenized stream's definition changes
_UNIGRAM_SAMPLE_TOKENS = 2**22  # labels a shard dataset's unigram entropy is estimated from


class PackedDataset:
    """Samples of seq_len + 1 tokens stored as one integer tensor (num_samples, seq_len + 1): uint8 for
    bytes, int16 or int32 for a tokenizer's ids; batches are int64 either way."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.windows[torch.as_tensor(indices, dtype=torch.long)].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def ordered_batches(self, batch_size: int, max_samples: int | None = None):
        """Deterministic, unshuffled batches (for validation)."""
        count = len(self) if max_samples is None else min(len(self), max_samples)
        for start in range(0, count, batch_size):
            yield self.batch(range(start, min(start + batch_size, count)))


# what build_datasets returns: both have `__len__`, `batch(indices)` and `ordered_batches`
TokenDataset = PackedDataset | ShardDataset


def build_datasets(cfg: RunConfig) -> tuple[TokenDataset, TokenDataset]:
    """(train, validation) for the run's data source, tokenizer and sequence length (see the module
    docstring for the three paths)."""
    source = cfg.data.source
    if source != "stdlib" and not source.startswith("hf:") and is_shard_dir(source):
        return _shard_datasets(cfg)
    if cfg.data.tokenizer:
        return _tokenized_datasets(cfg)
    return _byte_datasets(cfg)


def _byte_datasets(cfg: RunConfig) -> tuple[PackedDataset, PackedDataset]:
    docs = load_documents(cfg.data)
    stream = np.frombuffer(bytes([SEPARATOR]).join(docs), dtype=np.uint8)
    if cfg.model.vocab_size < 256:
        raise DataError(f"byte-level data needs model.vocab_size >= 256, got {cfg.model.vocab_size}")
    return _split_windows(stream, cfg, "bytes")


def _shard_datasets(cfg: RunConfig) -> tuple[ShardDataset, ShardDataset]:
    shards = open_shard_dir(cfg.data.source)
    if shards.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the token shards in {shards.path} have vocab_size {shards.vocab_size} but model.vocab_size is "
            f"{cfg.model.vocab_size}: the model cannot embed their ids (set model.vocab_size >= "
            f"{shards.vocab_size})"
        )
    if cfg.data.tokenizer:
        from swarmtrain.data.tokenizer import load_tokenizer, resolve_tokenizer_file, tokenizer_hash

        digest = tokenizer_hash(load_tokenizer(cfg.data.tokenizer))
        if digest != shards.tokenizer_hash:
            raise DataError(
                f"data.tokenizer {resolve_tokenizer_file(cfg.data.tokenizer)} has hash {digest} but the token "
                f"shards in {shards.path} were written by tokenizer {shards.tokenizer_hash}: tokenize again "
                f"with this tokenizer, or set data.tokenizer to the one the shards were made with"
            )
    if not shards.val:
        raise DataError(
            f"no validation shards (val-*.tok) in {shards.path}: tokenize again with a larger --val-fraction"
        )
    train, val = ShardDataset(shards.train, cfg.model.seq_len), ShardDataset(shards.val, cfg.model.seq_len)
    seq_len = cfg.model.seq_len
    for name, dataset in (("training", train), ("validation", val)):
        if len(dataset) < 1:
            # shards tokenized for a shorter --seq-len (or before tokenize knew one): it holds a window now
            raise DataError(
                f"the {name} shards in {shards.path} hold {dataset.tokens} tokens: not one sample of "
                f"{seq_len + 1} tokens (model.seq_len {seq_len} + 1): tokenize again into a new --out with "
                f"--seq-len {seq_len}, which gives training and validation a window each or says what is missing"
            )
    return train, val


def _tokenized_datasets(cfg: RunConfig) -> tuple[PackedDataset, PackedDataset]:
    from swarmtrain.data.tokenizer import load_tokenizer, vocab_size

    tok = load_tokenizer(cfg.data.tokenizer)
    vocab = vocab_size(tok)
    if vocab > cfg.model.vocab_size:
        raise DataError(
            f"tokenizer {cfg.data.tokenizer} has vocab_size {vocab} but model.vocab_size is "
            f"{cfg.model.vocab_size}: the model cannot embed its ids (set model.vocab_size >= {vocab})"
        )
    stream = cached_token_stream(cfg.data, tok)
    return _split_windows(stream, cfg, "tokens")


def token_cache_dir() -> Path:
    """Where tokenized corpora are cached: $XDG_CACHE_HOME/swarmtrain/tokens (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "swarmtrain" / "tokens"


def cached_token_stream(data: DataConfig, tok: Tokenizer) -> np.ndarray:
    """The source's documents (up to data.max_corpus_bytes) as one token stream, EOS after each document:
    int16 when the ids fit, else int32. Cached on disk under a key of the source files (paths, sizes,
    modification times), the byte cap, the text field and the tokenizer hash; the processes of a swarm
    that start together build it once (a file lock) and the others load it."""
    from swarmtrain.data.tokenizer import tokenizer_hash, vocab_size

    key = _cache_key(data, tokenizer_hash(tok))
    if key is None:  # a hub dataset: nothing to check staleness against
        return _tokenize_source(data, tok)
    directory = token_cache_dir()
    path = directory / f"{key}.npy"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return _tokenize_source(data, tok)  # a read-only home: work without a cache
    with _file_lock(directory / f"{key}.lock"):
        cached = _load_cached(path, vocab_size(tok))
        if cached is not None:
            return cached
        stream = _tokenize_source(data, tok)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as handle:
                np.save(handle, stream)
            os.replace(tmp, path)  # readers see the old file or the whole new one
        except OSError:
            tmp.unlink(missing_ok=True)
        return stream


def _tokenize_source(data: DataConfig, tok: Tokenizer) -> np.ndarray:
    from swarmtrain.data.sources import iter_documents
    from swarmtrain.data.tokenizer import encode_documents, eos_id, vocab_size

    docs = list(iter_documents([data.source], data.text_field, data.max_corpus_bytes))
    if not docs:
        raise DataError(f"data source {data.source!r} contains no text")
    dtype = np.dtype(np.int16) if vocab_size(tok) <= 2**15 else np.dtype(np.int32)
    return encode_documents(tok, docs, eos_id(tok, data.tokenizer), dtype)


def _cache_key(data: DataConfig, digest: str) -> str | None:
    from swarmtrain.data.sources import HF_PREFIX, STDLIB, folder_files

    if data.source.startswith(HF_PREFIX):
        return None
    if data.source == STDLIB:
        files = _stdlib_files()
    else:
        path = Path(data.source).expanduser().resolve()
        files = folder_files(path) if path.is_dir() else [path] if path.exists() else []
    stats = []
    for file in files:
        try:
            info = file.stat()
        except OSError:
            continue
        stats.append((str(file), info.st_size, info.st_mtime_ns))
    if not stats:
        return None  # let reading the source raise its clear error
    payload = {
        "version": TOKEN_CACHE_VERSION,
        "source": data.source,
        "files": stats,
        "max_bytes": data.max_corpus_bytes,
        "text_field": data.text_field,
        "tokenizer": digest,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _load_cached(path: Path, vocab: int) -> np.ndarray | None:
    """The cached stream, or None when it is missing or unreadable (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        stream = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if (
        stream.ndim != 1
        or stream.dtype.kind != "i"
        or not len(stream)
        or stream.min() < 0
        or stream.max() >= vocab
    ):
        return None
    return stream


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (POSIX); no lock where flock is unavailable."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def iterate_batches(
    dataset: TokenDataset,
    batch_size: int,
    seed: int = 0,
    shard_index: int = 0,
    shard_count: int = 1,
    skip_samples: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches of this shard: each epoch permutes all samples with a seed that depends on
    (seed, epoch); shard k of n takes every n-th sample of the permutation, so shards never overlap.
    `skip_samples` resumes the exact stream after that many samples of this shard (checkpoint resume)."""
    if not 0 <= shard_index < shard_count:
        raise DataError(f"shard index {shard_index} outside 0..{shard_count - 1}")
    if len(dataset) < shard_count:
        raise DataError(f"{len(dataset)} samples cannot be split into {shard_count} shards")
    shard_len = len(range(shard_index, len(dataset), shard_count))
    batches_per_epoch = max(1, shard_len // batch_size)
    skip_batches = skip_samples // batch_size
    epoch, skip_batches = divmod(skip_batches, batches_per_epoch)
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(dataset))[shard_index::shard_count]
        if len(order) < batch_size:
            order = np.resize(order, batch_size)  # a shard smaller than a batch repeats samples
        for batch_index in range(skip_batches, batches_per_epoch):
            yield dataset.batch(order[batch_index * batch_size : (batch_index + 1) * batch_size])
        skip_batches = 0
        epoch += 1


def unigram_entropy_nats(dataset: TokenDataset) -> float:
    """Cross-entropy of predicting the corpus's token (byte) frequencies: the loss a model must beat to
    show it learned more than which tokens are common. Shard datasets are estimated from their first
    2**22 label tokens (validation sets are read from the start, so that is the part evaluated)."""
    if isinstance(dataset, ShardDataset):
        counts = torch.from_numpy(dataset.label_counts(_UNIGRAM_SAMPLE_TOKENS)).double()
    else:
        counts = torch.bincount(dataset.windows[:, 1:].reshape(-1).long(), minlength=256).double()
    probs = counts / counts.sum()
    nonzero = probs[probs > 0]
    return float(-(nonzero * nonzero.log()).sum())


def _split_windows(stream: np.ndarray, cfg: RunConfig, unit: str) -> tuple[PackedDataset, PackedDataset]:
    """Windows of seq_len + 1 tokens; the tail `validation_fraction` of them is the validation split."""
    window = cfg.model.seq_len + 1
    num_windows = len(stream) // window
    num_val = max(1, int(round(num_windows * cfg.data.validation_fraction)))
    if num_windows - num_val < 1:
        raise DataError(
            f"data source {cfg.data.source!r} is too small: {len(stream)} {unit} make {num_windows} samples of "
            f"{window} tokens; need at least 2"
        )
    windows = torch.from_numpy(stream[: num_windows * window].reshape(num_windows, window).copy())
    return PackedDataset(windows[: num_windows - num_val]), PackedDataset(windows[num_windows - num_val :])
