"""Corpora, byte-level tokenization, packing into fixed-length samples, and per-trainer sharding."""

from swarmtrain.data.corpus import DataError, load_documents
from swarmtrain.data.packing import PackedDataset, build_datasets, iterate_batches, unigram_entropy_nats

__all__ = [
    "DataError",
    "PackedDataset",
    "build_datasets",
    "iterate_batches",
    "load_documents",
    "unigram_entropy_nats",
]
