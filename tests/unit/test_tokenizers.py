"""BPE tokenizers (data/tokenizer.py), document sources (data/sources.py) and the in-memory tokenized
data path of build_datasets, on tiny corpora made here (offline)."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from swarmtrain.cli.main import main
from swarmtrain.config import get_preset
from swarmtrain.data import DataError, build_datasets, packing, unigram_entropy_nats
from swarmtrain.data.sources import _cut_point, iter_documents
from swarmtrain.data.tokenizer import (
    EOS_TOKEN,
    PIECE_CHARS,
    encode_batch,
    eos_id,
    load_tokenizer,
    split_pieces,
    tokenizer_hash,
    train_bpe,
    vocab_size,
)

pytestmark = pytest.mark.unit

WORDS = (
    "swarm pipeline stage peer trainer gradient average replica throughput latency bandwidth tensor "
    "activation compression checkpoint optimizer schedule warmup cosine shard token window sample "
    "déjà vu naïve Größe 東京 データ 🙂 def return import class self None True"
).split()


def make_docs(count, seed=0, words=80):
    rng = random.Random(seed)
    return [
        f"doc {i}: "
        + " ".join(rng.choice(WORDS) for _ in range(words))
        + ("\n\tindented(x)\n" if i % 3 else "\n")
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(make_docs(120)):
        (root / f"doc-{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory, corpus_dir):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([str(corpus_dir)], 400, path, progress=False)
    return path


def test_training_reaches_the_vocab_and_round_trips(tok_file):
    tok = load_tokenizer(str(tok_file))
    assert vocab_size(tok) == 400
    assert tok.token_to_id(EOS_TOKEN) == 0 == eos_id(tok)
    for text in ("def f(x):\n\treturn x  # é 東京 🙂", "  leading and trailing  \n\n", "unseen: ʃʒ ∮ ☃"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert max(ids) < 400 and tok.decode(ids) == text  # byte-level: every string, exactly


def test_training_is_deterministic_and_the_hash_is_the_files(tmp_path, corpus_dir, tok_file):
    again = train_bpe([str(corpus_dir)], 400, tmp_path / "again.json", progress=False)
    assert tokenizer_hash(again) == tokenizer_hash(load_tokenizer(str(tok_file)))
    assert (tmp_path / "again.json").read_bytes() == tok_file.read_bytes()
    other = train_bpe([str(corpus_dir)], 350, tmp_path / "other.json", progress=False)
    assert tokenizer_hash(other) != tokenizer_hash(again) and len(tokenizer_hash(other)) == 16


def test_long_documents_are_encoded_in_pieces_with_the_same_ids(tok_file):
    tok = load_tokenizer(str(tok_file))
    rng = random.Random(3)
    parts = [
        rng.choice(WORDS) + rng.choice([" ", "  ", "\n", " \n\n   ", "\t", "", "."]) for _ in range(40_000)
    ]
    doc = "".join(parts)
    pieces = split_pieces(doc, limit=1000)
    assert "".join(pieces) == doc and len(pieces) > 100 and max(map(len, pieces)) <= 1000
    assert [len(p) for p in split_pieces("x" * 2500, limit=1000)] == [
        1000,
        1000,
        500,
    ]  # no boundary: hard cut
    whole = tok.encode(doc, add_special_tokens=False).ids
    [ours] = encode_batch(tok, [doc], 0, np.dtype(np.uint16))
    assert len(doc) > PIECE_CHARS and ours.tolist() == whole + [0]


def test_trained_file_loads_in_transformers(tok_file):
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer(str(tok_file))
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    text = "pipeline stage 東京 🙂\n\treturn None"
    ids = ours.encode(text, add_special_tokens=False).ids
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids
    assert theirs.decode(ids) == text
    assert theirs.convert_tokens_to_ids(EOS_TOKEN) == 0


def test_the_three_spec_forms(tmp_path, tok_file):
    from transformers import PreTrainedTokenizerFast

    bundled = load_tokenizer("swarmtrain:llama-tiny")
    assert vocab_size(bundled) == 2048 and eos_id(bundled, "swarmtrain:llama-tiny") == 0
    text = "import os\nfor i in range(10):\n    print(i)\n"
    assert bundled.decode(bundled.encode(text).ids) == text
    # a Hugging Face model directory: its tokenizer_config.json names the eos token
    model_dir = tmp_path / "model"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="</doc>")
    hf.save_pretrained(str(model_dir))
    from_dir = load_tokenizer(str(model_dir))
    assert eos_id(from_dir, str(model_dir)) == from_dir.token_to_id("</doc>") != 0
    assert tokenizer_hash(from_dir) != tokenizer_hash(load_tokenizer(str(tok_file)))  # one more token


def test_missing_and_invalid_tokenizers_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer file does not exist: .*nowhere.json"):
        load_tokenizer(str(tmp_path / "nowhere.json"))
    with pytest.raises(DataError, match="no tokenizer 'swarmtrain:nope'.*swarmtrain:llama-tiny"):
        load_tokenizer("swarmtrain:nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty_dir"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=f"cannot load tokenizer {bad}"):
        load_tokenizer(str(bad))


def test_a_tokenizer_without_an_eos_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "plain.json"
    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(path))
    with pytest.raises(DataError, match="no end-of-document token"):
        eos_id(load_tokenizer(str(path)), str(path))


def test_cli_trains_a_tokenizer(tmp_path, corpus_dir, capsys):
    out = tmp_path / "cli.json"
    assert (
        main(
            ["tokenizer", "train", "--vocab-size", "300", "--out", str(out), "--no-progress", str(corpus_dir)]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert f"wrote {out}" in line and "vocab 300" in line and tokenizer_hash(load_tokenizer(str(out))) in line
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(out), str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data path does not exist" in err[0]


# --- sources ---------------------------------------------------------------------------------------


def test_structured_sources_name_the_missing_field(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    with pytest.raises(DataError, match=r"no text field 'text'; its fields are 'content', 'id'"):
        list(iter_documents([str(rows)]))
    assert list(iter_documents([str(rows)], text_field="content")) == ["x"]


def test_byte_cap_and_large_text_files(tmp_path):
    big = tmp_path / "big.txt"
    paragraph = "é" * 1000 + "\n\n"
    big.write_text(paragraph * 2000, encoding="utf-8")  # ~4 MB: cut into ~1 MiB documents at blank lines
    docs = list(iter_documents([str(big)]))
    assert len(docs) > 2 and "".join(docs) == paragraph * 2000 and all(d.endswith("\n\n") for d in docs)
    capped = list(iter_documents([str(big)], max_bytes=5001))
    assert (
        sum(len(d.encode()) for d in capped) <= 5001
        and "".join(capped) == (paragraph * 3)[: len("".join(capped))]
    )
    assert _cut_point("aé".encode() * 10, 5) == 4  # never inside a character


def test_hub_errors_are_data_errors(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="cannot load Hugging Face dataset 'someone/corpus'.*reachable"):
        next(iter_documents(["hf:someone/corpus"]))


# --- build_datasets with data.tokenizer ------------------------------------------------------------


def _cfg(source, tokenizer, vocab=512, seq_len=16):
    cfg = get_preset("tiny")
    return cfg.replace(
        data=dataclasses.replace(
            cfg.data, source=str(source), tokenizer=str(tokenizer), validation_fraction=0.1
        ),
        model=dataclasses.replace(cfg.model, seq_len=seq_len, vocab_size=vocab),
    )


def test_in_memory_tokenized_datasets_are_cached(tmp_path, monkeypatch, corpus_dir, tok_file):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = _cfg(corpus_dir, tok_file)
    train, val = build_datasets(cfg)
    assert train.windows.dtype == torch.int16 and len(val) >= 1 and len(train) > len(val)
    inputs, labels = train.batch([0, 3])
    assert inputs.dtype == labels.dtype == torch.int64 and torch.equal(inputs[:, 1:], labels[:, :-1])
    stream = torch.cat([train.windows.reshape(-1), val.windows.reshape(-1)])
    tok = load_tokenizer(str(tok_file))
    first = make_docs(1)[0]
    assert stream[: len(tok.encode(first).ids) + 1].tolist() == tok.encode(first).ids + [0]  # doc, then EOS
    assert 0 < unigram_entropy_nats(val) < np.log(400)

    cached = list((tmp_path / "cache" / "swarmtrain" / "tokens").glob("*.npy"))
    assert len(cached) == 1

    def no_tokenizing(*args):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(packing, "_tokenize_source", no_tokenizing)
    again, _ = build_datasets(cfg)
    assert torch.equal(again.windows, train.windows)
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    cached[0].write_bytes(b"\x93NUMPY garbage")  # a corrupt cache is rebuilt
    rebuilt, _ = build_datasets(cfg)
    assert torch.equal(rebuilt.windows, train.windows)
    assert np.load(cached[0]).dtype == np.int16  # and the cache file was rewritten


def test_a_changed_source_gets_a_new_cache_entry(tmp_path, monkeypatch, tok_file):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "texts"
    source.mkdir()
    (source / "a.txt").write_text(" ".join(make_docs(40)))
    before, _ = build_datasets(_cfg(source, tok_file))
    (source / "a.txt").write_text(" ".join(make_docs(40, seed=1)))
    after, _ = build_datasets(_cfg(source, tok_file))
    assert not torch.equal(before.windows[:4], after.windows[:4])
    assert len(list((tmp_path / "cache" / "swarmtrain" / "tokens").glob("*.npy"))) == 2


def test_tokenizer_larger_than_the_model_vocab_is_refused(tmp_path, monkeypatch, corpus_dir, tok_file):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(DataError, match="vocab_size 400 but model.vocab_size is 256"):
        build_datasets(_cfg(corpus_dir, tok_file, vocab=256))


def test_jsonl_source_in_memory(tmp_path, monkeypatch, tok_file):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rows = tmp_path / "rows.jsonl"
    docs = make_docs(60)
    rows.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    cfg = _cfg(rows, tok_file)
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, text_field="body"))
    train, val = build_datasets(cfg)
    tok = load_tokenizer(str(tok_file))
    expected = [i for d in docs for i in tok.encode(d).ids + [0]]
    got = torch.cat([train.windows.reshape(-1), val.windows.reshape(-1)]).tolist()
    assert got == expected[: len(got)] and len(expected) - len(got) < 17
