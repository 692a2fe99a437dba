"""Byte-level tokens packed into fixed-length samples, a held-out validation split, and sharded batches.

Documents are joined with a NUL byte (absent from text) as separator and cut into windows of
seq_len + 1 tokens: inputs are the first seq_len, labels the last seq_len. The validation split is
the tail of the token stream, so it never overlaps training data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from swarmtrain.config import RunConfig
from swarmtrain.data.corpus import DataError, load_documents

SEPARATOR = 0


class PackedDataset:
    """Samples of seq_len + 1 byte tokens stored as one uint8 tensor (num_samples, seq_len + 1)."""

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


def build_datasets(cfg: RunConfig) -> tuple[PackedDataset, PackedDataset]:
    """(train, validation) for the run's data source and sequence length."""
    docs = load_documents(cfg.data)
    stream = np.frombuffer(bytes([SEPARATOR]).join(docs), dtype=np.uint8)
    if cfg.model.vocab_size < 256:
        raise DataError(f"byte-level data needs model.vocab_size >= 256, got {cfg.model.vocab_size}")
    window = cfg.model.seq_len + 1
    num_windows = len(stream) // window
    num_val = max(1, int(round(num_windows * cfg.data.validation_fraction)))
    if num_windows - num_val < 1:
        raise DataError(
            f"data source {cfg.data.source!r} is too small: {len(stream)} bytes make {num_windows} samples of "
            f"{window} tokens; need at least 2"
        )
    windows = torch.from_numpy(stream[: num_windows * window].reshape(num_windows, window).copy())
    return PackedDataset(windows[: num_windows - num_val]), PackedDataset(windows[num_windows - num_val :])


def iterate_batches(
    dataset: PackedDataset,
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


def unigram_entropy_nats(dataset: PackedDataset) -> float:
    """Cross-entropy of predicting the corpus's byte frequencies: the loss a model must beat to show
    it learned more than which bytes are common."""
    counts = torch.bincount(dataset.windows[:, 1:].reshape(-1).long(), minlength=256).double()
    probs = counts / counts.sum()
    nonzero = probs[probs > 0]
    return float(-(nonzero * nonzero.log()).sum())
