"""Token shards: the file format, `swarmtrain tokenize` over every source format, resume after an
interruption, ShardDataset under iterate_batches, build_datasets' checks, and bounded memory."""

import dataclasses
import itertools
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from swarmtrain.cli.main import main
from swarmtrain.config import get_preset
from swarmtrain.data import DataError, ShardDataset, build_datasets, iterate_batches, unigram_entropy_nats
from swarmtrain.data.shards import HEADER_BYTES, ShardWriter, read_header, read_manifest
from swarmtrain.data.tokenize_job import DEFAULT_VAL_FRACTION, document_hash, tokenize
from swarmtrain.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe

pytestmark = pytest.mark.unit

WORDS = (
    "swarm pipeline stage peer trainer gradient average replica throughput latency bandwidth tensor "
    "activation compression checkpoint optimizer schedule warmup cosine shard token window sample "
    "déjà vu naïve Größe 東京 データ 🙂 def return import class self None True"
).split()
SHARD = 700  # tokens per shard: the small corpus below spans several shards


def make_docs(count, seed=0):
    rng = random.Random(seed)
    return [
        f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "\n"
        for i in range(count)
    ]


DOCS = make_docs(150)


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text("".join(make_docs(200, seed=5)), encoding="utf-8")
    path = root / "tokenizer.json"
    train_bpe([str(root / "corpus.txt")], 400, path, progress=False)
    return path


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(DOCS):
        (root / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


def run_tokenize(sources, tok_file, out, **kwargs):
    options = {
        "shard_tokens": SHARD,
        "val_fraction": 0.2,
        "seq_len": 16,
        "progress": False,
        "chunk_chars": 3000,
    }
    options.update(kwargs)
    return tokenize([str(s) for s in sources], str(tok_file), out, **options)


def shard_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.tok"))}


def split_documents(directory, split, eos=0):
    """The split's token stream, cut at EOS into documents (tuples of ids)."""
    paths = sorted(directory.glob(f"{split}-*.tok"))
    stream = np.concatenate([np.fromfile(p, dtype=read_header(p).dtype, offset=HEADER_BYTES) for p in paths])
    cuts = np.flatnonzero(stream == eos)
    assert len(stream) and cuts[-1] == len(stream) - 1  # every document ends with EOS
    return [tuple(d) for d in np.split(stream, cuts + 1)[:-1]]


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory, text_dir, tok_file):
    out = tmp_path_factory.mktemp("shards") / "out"
    run_tokenize([text_dir], tok_file, out)
    return out


# --- the format ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab", "dtype"), [(400, np.uint16), (65536, np.uint16), (70_000, np.uint32)])
def test_header_fields_and_fixed_size_shards(tmp_path, vocab, dtype):
    writer = ShardWriter(
        tmp_path, "train", vocab_size=vocab, eos_id=3, tokenizer_hash="0123456789abcdef", shard_tokens=100
    )
    tokens = vocab - 250 + np.arange(250)  # the highest ids: 65,535 fits uint16, 69,999 needs uint32
    writer.write(tokens[:120])
    writer.write(tokens[120:])
    writer.finish()
    paths = sorted(tmp_path.glob("*.tok"))
    assert [p.name for p in paths] == ["train-00000.tok", "train-00001.tok", "train-00002.tok"]
    headers = [read_header(p) for p in paths]
    assert [h.token_count for h in headers] == [100, 100, 50]
    first = headers[0]
    assert (first.vocab_size, first.eos_id, first.tokenizer_hash, first.version) == (
        vocab,
        3,
        "0123456789abcdef",
        1,
    )
    assert first.dtype == np.dtype(dtype) and first.token_bytes == np.dtype(dtype).itemsize
    assert paths[0].stat().st_size == HEADER_BYTES + 100 * np.dtype(dtype).itemsize
    stream = np.concatenate([np.fromfile(p, dtype=dtype, offset=HEADER_BYTES) for p in paths])
    assert np.array_equal(stream, tokens)
    assert writer.shards()[-1] == {"name": "train-00002.tok", "split": "train", "tokens": 50}


def test_not_a_shard_is_a_clear_error(tmp_path):
    (tmp_path / "x.tok").write_bytes(b"hello" * 100)
    with pytest.raises(DataError, match="not a swarmtrain token shard"):
        read_header(tmp_path / "x.tok")


def test_windows_never_cross_shard_boundaries(tmp_path):
    writer = ShardWriter(
        tmp_path, "train", vocab_size=1000, eos_id=0, tokenizer_hash="f" * 16, shard_tokens=100
    )
    writer.write(np.arange(255))
    writer.finish()
    data = ShardDataset(sorted(tmp_path.glob("train-*.tok")), seq_len=9)  # windows of 10 tokens
    assert len(data) == 10 + 10 + 5  # the 55-token shard holds 5; no window spans two shards
    inputs, labels = data.batch(range(len(data)))
    windows = torch.cat([inputs, labels[:, -1:]], dim=1)
    assert inputs.dtype == labels.dtype == torch.int64 and torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(25, 9, dtype=torch.int64))  # contiguous
    assert torch.equal(windows[:, 0] // 100, windows[:, -1] // 100)  # one shard each
    assert windows[:, 0].tolist() == list(range(0, 100, 10)) + list(range(100, 200, 10)) + list(
        range(200, 250, 10)
    )
    with pytest.raises(IndexError):
        data.batch([25])


def test_shard_dataset_under_iterate_batches(shards_dir):
    data = ShardDataset(sorted(shards_dir.glob("train-*.tok")), seq_len=8)
    assert len(data) > 40

    def rows(shard):
        batches = itertools.islice(iterate_batches(data, 4, seed=1, shard_index=shard, shard_count=2), 5)
        return [tuple(row) for inputs, _ in batches for row in inputs.tolist()]

    assert set(rows(0)).isdisjoint(rows(1))  # trainer shards never share a window
    assert rows(0) == rows(0) and len(set(rows(0))) == 20  # deterministic, no repeats within an epoch
    full = [x for x, _ in itertools.islice(iterate_batches(data, 4, seed=2), 12)]
    resumed = [x for x, _ in itertools.islice(iterate_batches(data, 4, seed=2, skip_samples=4 * 9), 3)]
    for a, b in zip(full[9:], resumed, strict=True):
        assert torch.equal(a, b)


def test_shard_dataset_pickles_by_path(shards_dir):
    import pickle

    data = ShardDataset(sorted(shards_dir.glob("train-*.tok")), seq_len=8)
    copy = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data)) < 2000 and torch.equal(copy.batch([0, 7])[0], data.batch([0, 7])[0])


# --- tokenize --------------------------------------------------------------------------------------


def test_every_source_format_gives_the_same_shards(tmp_path, text_dir, shards_dir, tok_file):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = [json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)]
    half = len(lines) // 2
    compressor = zstandard.ZstdCompressor()
    # two zstd frames back to back, as files concatenated from pieces are
    (tmp_path / "docs.jsonl.zst").write_bytes(
        compressor.compress("".join(lines[:half]).encode())
        + compressor.compress("".join(lines[half:]).encode())
    )
    (tmp_path / "docs.jsonl").write_text("".join(lines), encoding="utf-8")
    pq.write_table(
        pa.table({"id": list(range(len(DOCS))), "text": DOCS}), tmp_path / "docs.parquet", row_group_size=16
    )
    dataset = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(
        str(tmp_path / "saved_dict")
    )

    expected = shard_bytes(shards_dir)
    assert len(expected) >= 4
    for name in ("docs.jsonl.zst", "docs.jsonl", "docs.parquet", "saved", "saved_dict"):
        out = tmp_path / f"out-{name}"
        run_tokenize([tmp_path / name], tok_file, out)
        assert shard_bytes(out) == expected, name


def test_validation_never_overlaps_training(shards_dir, tok_file):
    train, val = split_documents(shards_dir, "train"), split_documents(shards_dir, "val")
    tok = load_tokenizer(str(tok_file))
    everything = {tuple(tok.encode(d).ids) + (0,) for d in DOCS}
    assert set(train).isdisjoint(val) and set(train) | set(val) == everything
    assert 0.1 < len(val) / len(DOCS) < 0.3  # --val-fraction 0.2, chosen by a hash of each document
    manifest = read_manifest(shards_dir)
    assert manifest["complete"] and manifest["progress"]["documents"] == len(DOCS)
    assert manifest["tokenizer_hash"] == tokenizer_hash(tok) and manifest["dtype"] == "uint16"
    assert sum(s["tokens"] for s in manifest["shards"]) == sum(map(len, train)) + sum(map(len, val))


def test_val_tokens_caps_the_validation_split(tmp_path, text_dir, tok_file):
    out = tmp_path / "out"
    summary = run_tokenize([text_dir], tok_file, out, val_tokens=300)
    val_docs = split_documents(out, "val")
    assert (
        300 <= summary.val_tokens < 300 + max(map(len, val_docs)) and len(val_docs) == summary.val_documents
    )


class _Interrupt(KeyboardInterrupt):
    pass


def test_resume_after_ctrl_c_is_byte_identical(tmp_path, text_dir, shards_dir, tok_file):
    out = tmp_path / "out"

    def interrupt(chunk):
        if chunk == 6:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        run_tokenize([text_dir], tok_file, out, checkpoint_every_s=0, on_chunk=interrupt)
    progress = read_manifest(out)["progress"]
    assert not read_manifest(out)["complete"] and 0 < progress["documents"] < len(DOCS)
    with pytest.raises(DataError, match="incomplete.*rerun"):
        build_datasets(_cfg(out))
    summary = run_tokenize([text_dir], tok_file, out, checkpoint_every_s=0)
    assert summary.resumed_documents == progress["documents"]
    assert shard_bytes(out) == shard_bytes(shards_dir)
    assert not list(out.glob("*.partial"))


@pytest.mark.parametrize("kill_at", [1, 3, 9])
def test_resume_after_sigkill_is_byte_identical(tmp_path, text_dir, shards_dir, tok_file, kill_at):
    out = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import os, signal
        from swarmtrain.data.tokenize_job import tokenize

        def kill(chunk):
            if chunk == {kill_at}:  # after this chunk's writes, before its checkpoint: work is lost
                os.kill(os.getpid(), signal.SIGKILL)

        tokenize([{str(text_dir)!r}], {str(tok_file)!r}, {str(out)!r}, shard_tokens={SHARD}, val_fraction=0.2,
                 seq_len=16, progress=False, chunk_chars=3000, checkpoint_every_s=0, on_chunk=kill)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()
    assert list(out.glob("*.partial")) and not read_manifest(out)["complete"]
    run_tokenize([text_dir], tok_file, out)
    assert shard_bytes(out) == shard_bytes(shards_dir)


def test_rerun_with_other_settings_is_refused(tmp_path, text_dir, shards_dir, tok_file):
    summary = run_tokenize([text_dir], tok_file, shards_dir)
    assert summary.already_complete
    with pytest.raises(DataError, match="different tokenize run.*shard_tokens: 700 there, 800 now"):
        run_tokenize([text_dir], tok_file, shards_dir, shard_tokens=800)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty and holds no token shards"):
        run_tokenize([text_dir], tok_file, tmp_path / "busy")


def test_cli_tokenize(tmp_path, text_dir, tok_file, capsys):
    out = tmp_path / "out"
    argv = [
        "tokenize",
        "--tokenizer",
        str(tok_file),
        "--out",
        str(out),
        "--shard-tokens",
        "1000",
        "--seq-len",
        "16",
    ]
    assert main([*argv, "--val-fraction", "0.2", "--no-progress", str(text_dir)]) == 0
    line = capsys.readouterr().out.strip()
    assert f"tokenized {len(DOCS)} documents into {out}" in line and "tokens/s" in line
    assert tokenizer_hash(load_tokenizer(str(tok_file))) in line
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    assert main([*argv[:3], "--out", str(tmp_path / "out2"), str(rows)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no text field 'text'; its fields are 'body', 'id'" in err[0]
    assert not (tmp_path / "out2").exists()  # nothing written before the source was checked


# --- a validation split for every corpus that can be split -----------------------------------------


def small_corpus(root, count=30, seed=11):
    """`count` tiny documents, one per file, none of whose hashes falls below the default
    --val-fraction: the hash rule alone would hold out nothing."""
    threshold = DEFAULT_VAL_FRACTION * 2**64
    docs = [d for d in make_docs(3 * count, seed=seed) if document_hash(d) >= threshold][:count]
    assert len(docs) == count
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return docs


def encoded(tok_file, docs):
    tok = load_tokenizer(str(tok_file))
    return [tuple(tok.encode(d).ids) + (0,) for d in docs]


def expected_validation(tok_file, docs, window):
    """What validation holds when no hash falls below --val-fraction: the distinct texts in hash order,
    each with all its copies, until they hold `window` tokens."""
    texts = sorted(set(docs), key=document_hash)
    out, tokens = [], 0
    for text, ids in zip(texts, encoded(tok_file, texts), strict=True):
        if tokens >= window:
            break
        out += [ids] * docs.count(text)
        tokens += len(ids) * docs.count(text)
    return out


def test_small_corpus_gets_the_smallest_hash_as_validation_with_a_warning(tmp_path, tok_file, capsys):
    docs = small_corpus(tmp_path / "texts")
    # default --val-fraction 0.01; a window of 5 tokens, which the smallest hash's document holds alone
    argv = ["tokenize", "--tokenizer", str(tok_file), "--no-progress", "--seq-len", "4"]
    assert main([*argv, "--out", str(tmp_path / "out"), str(tmp_path / "texts")]) == 0
    captured = capsys.readouterr()
    assert "1 val shard(s)" in captured.out and "(1 documents)" in captured.out
    warning = captured.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(
        "warning: 30 documents are too few for --val-fraction 0.01 to hold out one window of 5 tokens"
    )
    assert "smallest hashes" in warning[0] and "larger --val-fraction" in warning[0]

    out = tmp_path / "out"
    assert [p.name for p in sorted(out.glob("val-*.tok"))] == ["val-00000.tok"]
    smallest = min(docs, key=document_hash)
    train, val = split_documents(out, "train"), split_documents(out, "val")
    assert val == encoded(tok_file, [smallest])
    assert sorted(train) == sorted(encoded(tok_file, [d for d in docs if d != smallest]))  # disjoint, all
    manifest = read_manifest(out)
    assert manifest["complete"] and manifest["progress"]["val_documents"] == 1
    assert manifest["progress"]["val_fallback"] and manifest["progress"]["reserve"] == []
    _, val_data = build_datasets(_cfg(out, tok_file, seq_len=4))  # what the trainer refused before
    assert len(val_data) >= 1

    # the same command into another directory writes the same bytes; rerun where it is done: the same warning
    assert main([*argv, "--out", str(tmp_path / "again"), str(tmp_path / "texts")]) == 0
    assert shard_bytes(tmp_path / "again") == shard_bytes(out)
    capsys.readouterr()
    assert main([*argv, "--out", str(out), str(tmp_path / "texts")]) == 0
    captured = capsys.readouterr()
    assert "is already complete" in captured.out and "too few for --val-fraction" in captured.err


@pytest.mark.parametrize("seq_len", [4, 150])
def test_small_corpus_split_is_a_property_of_the_corpus(tmp_path, tok_file, seq_len):
    """Chunk after chunk (and resumed after an interruption that left documents held back), in
    another order, and with a copy of the smallest hash's document: the same validation text, at least
    one window, never in training. A window of 5 tokens takes one document, one of 151 several."""
    docs = small_corpus(tmp_path / "texts")
    window = seq_len + 1
    smallest = min(docs, key=document_hash)
    options = {"val_fraction": DEFAULT_VAL_FRACTION, "chunk_chars": 600, "checkpoint_every_s": 0}
    options["seq_len"] = seq_len
    whole = tmp_path / "whole"
    summary = run_tokenize([tmp_path / "texts"], tok_file, whole, **options)
    expected = expected_validation(tok_file, docs, window)
    assert summary.val_fallback and summary.documents == 30 and summary.val_documents == len(expected)
    assert split_documents(whole, "val") == expected and summary.val_tokens >= window
    assert (len(expected) > 1) == (seq_len > 4)

    out = tmp_path / "interrupted"

    def interrupt(chunk):
        if chunk == 3:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        run_tokenize([tmp_path / "texts"], tok_file, out, on_chunk=interrupt, **options)
    progress = read_manifest(out)["progress"]
    assert 0 < progress["documents"] < 30 and progress["reserve"]  # held back, not written
    assert progress["val_tokens"] == 0 and not progress["val_fallback"]
    resumed = run_tokenize([tmp_path / "texts"], tok_file, out, **options)
    assert resumed.resumed_documents == progress["documents"] and resumed.val_fallback
    assert shard_bytes(out) == shard_bytes(whole)

    reordered = tmp_path / "reordered"
    reordered.mkdir()
    for i, doc in enumerate(reversed(docs + [smallest])):  # another order, the smallest hash's text twice
        (reordered / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    summary = run_tokenize([reordered], tok_file, tmp_path / "out2", **options)
    train, val = split_documents(tmp_path / "out2", "train"), split_documents(tmp_path / "out2", "val")
    assert summary.val_fallback and val == expected_validation(tok_file, docs + [smallest], window)
    assert val[:2] == encoded(tok_file, [smallest]) * 2  # duplicates land together
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(encoded(tok_file, docs))


def test_thirty_short_files_give_llama_tiny_a_validation_window_and_it_trains(tmp_path, capsys):
    """The issue's case: 30 short files, every default, the bundled tokenizer. tokenize knows the window
    from the presets that use the tokenizer (llama-tiny: 64 + 1 tokens), holds out enough documents for
    one, and `train-local --preset llama-tiny` trains on the shards with validation."""
    texts = tmp_path / "texts"
    texts.mkdir()
    rng = random.Random(3)
    for i in range(30):  # ~15-25 tokens each: no single document holds a window
        (texts / f"note-{i:02d}.txt").write_text(" ".join(rng.choice(WORDS[:24]) for _ in range(8)) + "\n")
    out = tmp_path / "shards"
    argv = [
        "tokenize",
        "--tokenizer",
        "swarmtrain:llama-tiny",
        "--no-progress",
        "--out",
        str(out),
        str(texts),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "one window of 65 tokens (--seq-len 64 + 1)" in captured.err, captured.err
    manifest = read_manifest(out)
    assert manifest["settings"]["seq_len"] == 64 and manifest["progress"]["val_documents"] > 1
    assert manifest["progress"]["val_tokens"] >= 65 and manifest["progress"]["train_tokens"] >= 65

    summary = tmp_path / "summary.json"
    train = ["train-local", "--preset", "llama-tiny", "--data", str(out), "--max-samples", "32"]
    assert main([*train, "--summary-json", str(summary), "--threads", "1", "--no-progress"]) == 0
    result = json.loads(summary.read_text())
    assert np.isfinite(result["initial_val_loss"]) and np.isfinite(result["final_val_loss"]), result


def test_a_corpus_too_small_for_a_window_each_is_a_one_line_error_naming_the_flag(tmp_path, tok_file, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(make_docs(3, seed=4)):
        (texts / f"doc-{i}.txt").write_text(doc, encoding="utf-8")
    argv = ["tokenize", "--tokenizer", str(tok_file), "--no-progress", str(texts)]
    assert main([*argv, "--out", str(tmp_path / "out"), "--seq-len", "4000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("swarmtrain tokenize: error: ")
    assert "too few for a window of 4001 tokens" in err[0] and "--seq-len" in err[0], err[0]
    assert not read_manifest(tmp_path / "out")["complete"]  # never marked usable

    # settings under which no shard could hold a window: refused before anything is written
    for flag, value in (("--val-tokens", "100"), ("--shard-tokens", "150")):
        assert main([*argv, "--out", str(tmp_path / flag), "--seq-len", "4000", flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag} {value} is less than one window of 4001 tokens" in err[0], err
        assert f"use {flag} >= 4001" in err[0] and not (tmp_path / flag).exists()


def test_shards_without_a_window_name_the_tokenize_flag_that_fixes_them(tmp_path, tok_file):
    out = tmp_path / "out"
    small_corpus(tmp_path / "texts")
    run_tokenize([tmp_path / "texts"], tok_file, out, val_fraction=DEFAULT_VAL_FRACTION, seq_len=4)
    with pytest.raises(DataError, match=r"not one sample of 501 tokens .*--out with --seq-len 500"):
        build_datasets(_cfg(out, tok_file, seq_len=500))


def test_a_corpus_that_cannot_be_split_is_a_one_line_error(tmp_path, tok_file, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "only.txt").write_text(DOCS[0], encoding="utf-8")
    argv = ["tokenize", "--tokenizer", str(tok_file), "--no-progress", str(tmp_path / "texts")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("swarmtrain tokenize: error: ")
    assert "holds a single document" in err[0] and "at least 2 documents" in err[0]
    assert not (tmp_path / "out").exists()  # nothing written

    # --val-fraction 0 still means no validation split: one document is fine, and training refuses it
    assert main([*argv, "--out", str(tmp_path / "noval"), "--val-fraction", "0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wrote no validation split" in err[0]
    assert not list((tmp_path / "noval").glob("val-*.tok")) and list((tmp_path / "noval").glob("train-*.tok"))
    with pytest.raises(DataError, match="no validation shards .*larger --val-fraction"):
        build_datasets(_cfg(tmp_path / "noval", tok_file, seq_len=4))

    for i in range(3):
        (tmp_path / "texts" / f"copy-{i}.txt").write_text(DOCS[0], encoding="utf-8")
    with pytest.raises(DataError, match="all 4 documents .* are the same text"):
        run_tokenize([tmp_path / "texts"], tok_file, tmp_path / "same")


# --- build_datasets on shards ----------------------------------------------------------------------


def _cfg(source, tokenizer="", vocab=512, seq_len=16):
    cfg = get_preset("tiny")
    return cfg.replace(
        data=dataclasses.replace(cfg.data, source=str(source), tokenizer=str(tokenizer)),
        model=dataclasses.replace(cfg.model, seq_len=seq_len, vocab_size=vocab),
    )


def test_build_datasets_reads_shards(shards_dir, tok_file):
    train, val = build_datasets(_cfg(shards_dir, tok_file))
    assert isinstance(train, ShardDataset) and isinstance(val, ShardDataset)
    assert len(train) > 20 and len(val) >= 1
    inputs, labels = next(iterate_batches(train, 4, seed=0))
    assert inputs.shape == (4, 16) and inputs.dtype == torch.int64 and int(inputs.max()) < 400
    assert sum(x.shape[0] for x, _ in val.ordered_batches(2, max_samples=3)) == min(len(val), 3)
    assert 0 < unigram_entropy_nats(val) < np.log(400)


def test_shards_without_a_manifest_are_read_by_their_headers(tmp_path, shards_dir):
    import shutil

    for shard in shards_dir.glob("*.tok"):
        shutil.copy(shard, tmp_path / shard.name)
    train, val = build_datasets(_cfg(tmp_path))
    expected, _ = build_datasets(_cfg(shards_dir))
    assert len(train) == len(expected) and torch.equal(train.batch([0, 5])[0], expected.batch([0, 5])[0])


def test_shard_vocab_and_tokenizer_mismatches_name_both(tmp_path, shards_dir, tok_file):
    with pytest.raises(DataError, match="vocab_size 400 but model.vocab_size is 256"):
        build_datasets(_cfg(shards_dir, vocab=256))
    other = tmp_path / "other.json"
    (tmp_path / "c.txt").write_text("".join(make_docs(50, seed=9)))
    train_bpe([str(tmp_path / "c.txt")], 300, other, progress=False)
    theirs, ours = tokenizer_hash(load_tokenizer(str(tok_file))), tokenizer_hash(load_tokenizer(str(other)))
    with pytest.raises(DataError) as exc:
        build_datasets(_cfg(shards_dir, other))
    message = str(exc.value)
    assert theirs in message and ours in message and str(other) in message and str(shards_dir) in message


# --- memory ----------------------------------------------------------------------------------------


CORPUS_MB = 64
PEAK_LIMIT_MB = 128  # the job needs ~90 MB (45 MB of it imports) whatever the size
# how much the job's peak may grow over the last three quarters of the corpus, per MB of them. Measured:
# ~1 MB in all (its chunks' memory is reached within the first quarter), the same over 150 MB of a 200 MB
# corpus. Holding the text read grows it by ~1 MB per MB, the token ids as uint16 by ~0.16.
GROWTH_LIMIT_PER_MB = 0.125


def test_tokenize_memory_does_not_grow_with_the_corpus(tmp_path):
    """A 64 MB corpus through the real CLI in a child process: its peak RSS stays bounded, and does not
    grow while the last three quarters of the corpus go through (the peak after the first quarter was
    encoded against the peak at the end; a wrapper around the job's encode_batch takes the first)."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = np.array(["".join(rng.choice(letters, rng.integers(8, 16))) for _ in range(300)], dtype=object)
    tok_path = tmp_path / "words.json"
    sample = tmp_path / "sample.txt"
    sample.write_text(" ".join(words[rng.integers(0, len(words), 200_000)]))
    train_bpe([str(sample)], 6000, tok_path, progress=False)  # enough merges for most words to be one token
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    paragraphs = [" ".join(words[rng.integers(0, len(words), 70_000)]) + "\n" for _ in range(16)]  # ~0.9 MB
    total = 0
    for i in range(CORPUS_MB * 2**20 // len(paragraphs[0]) + 1):
        text = f"file {i}\n" + paragraphs[i % 16]
        (corpus / f"{i:04d}.txt").write_text(text)
        total += len(text)
    assert total >= CORPUS_MB * 2**20
    # VmHWM (the peak RSS of this process image) rather than ru_maxrss, which on Linux keeps the peak
    # of the forked pytest process the child started as
    script = textwrap.dedent(
        """
        import re, resource, sys
        import swarmtrain.data.tokenize_job as job
        from swarmtrain.cli.main import main

        def peak_kb():
            try:
                with open("/proc/self/status") as status:
                    return int(re.search(r"VmHWM:\\s+(\\d+) kB", status.read()).group(1))
            except OSError:
                return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        encode, quarter, encoded = job.encode_batch, int(sys.argv.pop(1)), [0]

        def encode_batch(tok, texts, *args):
            before = encoded[0]
            encoded[0] += sum(len(text) for text in texts)
            if before < quarter <= encoded[0]:
                print("QUARTER_PEAK_KB", encoded[0], peak_kb())
            return encode(tok, texts, *args)

        job.encode_batch = encode_batch
        code = main(sys.argv[1:])
        print("PEAK_RSS_KB", peak_kb())
        sys.exit(code)
        """
    )
    argv = [
        str(total // 4),
        "tokenize",
        "--tokenizer",
        str(tok_path),
        "--out",
        str(tmp_path / "out"),
        "--shard-tokens",
        "4000000",
    ]
    argv += ["--no-progress", str(corpus)]
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    readings = {line.split()[0]: [int(x) for x in line.split()[1:]] for line in lines if "_KB " in line}
    assert readings.keys() == {"QUARTER_PEAK_KB", "PEAK_RSS_KB"}, done.stdout  # both taken
    (quarter_chars, quarter_kb), (peak_kb,) = readings["QUARTER_PEAK_KB"], readings["PEAK_RSS_KB"]
    peak_mb, grown_mb = peak_kb / 1024, (peak_kb - quarter_kb) / 1024
    rest_mb = (total - quarter_chars) / 2**20
    manifest = read_manifest(tmp_path / "out")
    tokens = manifest["progress"]["train_tokens"] + manifest["progress"]["val_tokens"]
    summary = next(line for line in lines if "_KB " not in line)
    print(
        f"corpus {total / 2**20:.0f} MB, {tokens:,} tokens, peak RSS {peak_mb:.0f} MB, {grown_mb:.1f} MB of it "
        f"over the last {rest_mb:.0f} MB; {summary}"
    )
    assert manifest["complete"] and tokens > total / 20
    assert peak_mb < PEAK_LIMIT_MB, f"peak RSS {peak_mb:.0f} MB for a {total / 2**20:.0f} MB corpus"
    assert rest_mb > CORPUS_MB / 2 and grown_mb < GROWTH_LIMIT_PER_MB * rest_mb, (
        f"peak RSS grew by {grown_mb:.1f} MB over the last {rest_mb:.0f} MB of the corpus"
    )
