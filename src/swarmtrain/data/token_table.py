"""A fixed token table from the training data's co-occurrence statistics, for exact subspace boundaries.

A subspace run (model/subspace.py) keeps the residual stream as E0[token] + coordinates @ B.T with E0
fixed: its rows are the only full-rank token identity the confined layers ever read, and a random E0
says nothing about which tokens behave alike. This table is the classic count-based word embedding
(positive pointwise mutual information of tokens within `window` positions of each other, smoothed
context counts, truncated SVD): tokens used in similar contexts get similar rows, at no cost on the
wire and still a fixed table, so boundaries stay exact and the model still folds into a plain one.
Measured in docs/LOG.md ("A fixed token table from the data").

Rows have norm sqrt(dim) (entries of unit variance, `model/subspace.py` scales them as it scales a
random E0); a token that never occurs gets a row of zeros, which the model fills with the seed's random
row. Computed once by `swarmtrain boundary-table` and shipped with the run as a file.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

WINDOW = 4  # neighbours on each side counted as context, each weighted 1 / distance
CONTEXT_SMOOTHING = 0.75  # context counts ** 0.75: rare contexts weigh less in PMI (Levy et al. 2015)
DENSE_MAX_VOCAB = 8192  # above it counts stay sparse and the SVD is randomized (`torch.svd_lowrank`)
SVD_SEED = 0
FLUSH_PAIRS = (
    1 << 23
)  # pairs gathered before they are summed into the counts (memory against time)  # the randomized SVD's start: the same data gives the same table


def cooccurrence_counts(
    rows: Iterable[np.ndarray | torch.Tensor], vocab_size: int, window: int = WINDOW
) -> torch.Tensor:
    """Symmetric, distance-weighted co-occurrence counts (vocab_size x vocab_size, sparse COO float64) of
    token rows (each batch a 2-d integer array of ids below vocab_size, one sequence per row: pairs
    never cross rows). Kept as (pair key, weight) sums, so memory grows with the distinct pairs seen."""
    keys, sums = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float64)
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending_pairs = 0
    for batch in rows:
        ids = torch.as_tensor(np.asarray(batch), dtype=torch.long)
        for distance in range(1, window + 1):
            left, right = ids[:, :-distance].reshape(-1), ids[:, distance:].reshape(-1)
            pair_keys = torch.cat([left * vocab_size + right, right * vocab_size + left])
            pending.append((pair_keys, torch.full(pair_keys.shape, 1.0 / distance, dtype=torch.float64)))
            pending_pairs += pair_keys.numel()
        if pending_pairs >= FLUSH_PAIRS:
            keys, sums = _summed([(keys, sums), *pending])
            pending, pending_pairs = [], 0
    keys, sums = _summed([(keys, sums), *pending])
    indices = torch.stack([keys // vocab_size, keys % vocab_size])
    return _sparse(indices, sums, vocab_size)


def _summed(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct keys, sorted; the sum of each key's weights) over all parts."""
    keys, inverse = torch.unique(torch.cat([k for k, _ in parts]), return_inverse=True)
    sums = torch.zeros(keys.numel(), dtype=torch.float64)
    return keys, sums.index_add_(0, inverse, torch.cat([w for _, w in parts]))


def _sparse(indices: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A coalesced sparse matrix of row-major sorted, distinct `indices` (as `_summed` leaves them)."""
    return torch.sparse_coo_tensor(
        indices, values, (vocab_size, vocab_size), is_coalesced=True, check_invariants=True
    )


def ppmi(counts: torch.Tensor) -> torch.Tensor:
    """Positive PMI of sparse counts with smoothed context probabilities, on the counts' nonzeros."""
    counts = counts.coalesce()
    (rows, cols), values = counts.indices(), counts.values()
    row_sums = torch.zeros(counts.shape[0], dtype=torch.float64).index_add_(0, rows, values)
    context = torch.zeros(counts.shape[1], dtype=torch.float64).index_add_(0, cols, values)
    context = context**CONTEXT_SMOOTHING
    total = values.sum()
    context = context / context.sum() * total
    pmi = torch.log(values * total / (row_sums[rows] * context[cols]))
    return _sparse(counts.indices(), pmi.clamp(min=0.0), counts.shape[0])


def token_table(counts: torch.Tensor, dim: int) -> torch.Tensor:
    """(vocab_size, dim) float32: the top-`dim` left singular vectors of PPMI(counts), each scaled by the
    square root of its singular value, rows rescaled to norm sqrt(dim); zero rows for tokens never seen.
    Columns past the matrix's rank stay zero (a vocabulary smaller than `dim`)."""
    vocab_size = counts.shape[0]
    matrix = ppmi(counts)
    rank = min(dim, vocab_size)
    if vocab_size <= DENSE_MAX_VOCAB:
        left, singular, _ = torch.linalg.svd(matrix.to_dense())
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SVD_SEED)
            left, singular, _ = torch.svd_lowrank(matrix.float(), q=min(rank + 8, vocab_size), niter=4)
    table = torch.zeros(vocab_size, dim, dtype=torch.float64)
    table[:, :rank] = left[:, :rank].double() * singular[:rank].double().sqrt()
    norms = table.norm(dim=1, keepdim=True)
    seen = norms.squeeze(1) > 0
    table[seen] = table[seen] / norms[seen] * dim**0.5
    return table.float()
