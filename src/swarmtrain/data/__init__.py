"""Corpora, tokenizers (byte-level or BPE), token shards on disk, packing into fixed-length samples, and
per-trainer sharding.

Names are imported on first use (PEP 562), so `swarmtrain tokenize`, which needs only the tokenizer
and the shard writer, does not pay for torch (~200 MB of memory, seconds of start-up)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmtrain.data.corpus import DataError, load_documents
    from swarmtrain.data.packing import (
        PackedDataset,
        TokenDataset,
        build_datasets,
        iterate_batches,
        unigram_entropy_nats,
    )
    from swarmtrain.data.shards import ShardDataset

_WHERE = {
    "DataError": "swarmtrain.data.corpus",
    "load_documents": "swarmtrain.data.corpus",
    "PackedDataset": "swarmtrain.data.packing",
    "TokenDataset": "swarmtrain.data.packing",
    "build_datasets": "swarmtrain.data.packing",
    "iterate_batches": "swarmtrain.data.packing",
    "unigram_entropy_nats": "swarmtrain.data.packing",
    "ShardDataset": "swarmtrain.data.shards",
}

__all__ = [
    "DataError",
    "PackedDataset",
    "ShardDataset",
    "TokenDataset",
    "build_datasets",
    "iterate_batches",
    "load_documents",
    "unigram_entropy_nats",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'swarmtrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
