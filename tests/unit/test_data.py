import dataclasses
import itertools

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.data import DataError, build_datasets, iterate_batches, unigram_entropy_nats
from swarmtrain.data.packing import PackedDataset

pytestmark = pytest.mark.unit


def _cfg(source, seq_len=16):
    cfg = get_preset("tiny")
    return cfg.replace(
        data=dataclasses.replace(cfg.data, source=str(source), validation_fraction=0.1),
        model=dataclasses.replace(cfg.model, seq_len=seq_len),
    )


def test_user_folder_skips_binary_and_hidden(small_text_dir):
    train, val = build_datasets(_cfg(small_text_dir))
    text = bytes(torch.cat([train.windows.reshape(-1), val.windows.reshape(-1)]).tolist())
    assert b"hello swarm" in text and b"pipeline stages" in text
    assert b"secret" not in text and b"\x01\x02" not in text
    assert len(val) >= 1 and len(train) > len(val)


def test_labels_are_inputs_shifted_by_one(small_text_dir):
    train, _ = build_datasets(_cfg(small_text_dir))
    inputs, labels = train.batch([0, 1])
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert inputs.dtype == labels.dtype == torch.int64


def test_missing_and_empty_sources_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_datasets(_cfg(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty"):
        build_datasets(_cfg(tmp_path / "empty"))
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(DataError, match="too small"):
        build_datasets(_cfg(tmp_path / "short.txt"))


def test_stdlib_corpus_is_deterministic_and_real():
    cfg = get_preset("tiny")
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, max_corpus_bytes=300_000))
    train_a, val_a = build_datasets(cfg)
    train_b, _ = build_datasets(cfg)
    assert torch.equal(train_a.windows, train_b.windows)
    assert b"def " in bytes(train_a.windows[:200].reshape(-1).tolist())
    assert 2.5 < unigram_entropy_nats(val_a) < 4.5  # English-ish Python source, bytes


def test_shards_are_disjoint_and_deterministic():
    windows = torch.arange(40 * 5, dtype=torch.uint8).reshape(40, 5)
    data = PackedDataset(windows)

    def first_column(shard):
        batches = itertools.islice(iterate_batches(data, 4, seed=1, shard_index=shard, shard_count=2), 5)
        return {int(v) for inputs, _ in batches for v in inputs[:, 0]}

    assert first_column(0).isdisjoint(first_column(1))
    assert first_column(0) == first_column(0)


def test_skip_samples_resumes_the_same_stream():
    data = PackedDataset(torch.arange(30 * 3, dtype=torch.uint8).reshape(30, 3))
    full = [x for x, _ in itertools.islice(iterate_batches(data, 4, seed=2), 12)]
    resumed = [x for x, _ in itertools.islice(iterate_batches(data, 4, seed=2, skip_samples=4 * 9), 3)]
    for a, b in zip(full[9:], resumed, strict=True):
        assert torch.equal(a, b)


def test_bad_shard_index():
    data = PackedDataset(torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(DataError, match="shard index"):
        next(iterate_batches(data, 2, shard_index=2, shard_count=2))
