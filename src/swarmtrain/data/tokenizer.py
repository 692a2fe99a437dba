"""Subword tokenizers: loading one (a tokenizer.json, a Hugging Face model directory, or one shipped with
the package), its identity hash, its document separator, training a byte-level BPE, and encoding
documents into one token stream.

Tokenizers are Hugging Face `tokenizers` objects, so a tokenizer trained here loads in
`transformers.PreTrainedTokenizerFast(tokenizer_file=...)` and any model directory's tokenizer.json loads
here. The hash is what token shards and caches record: two tokenizers with the same hash turn text
into the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from swarmtrain.data.corpus import DataError
from swarmtrain.data.shards import token_dtype

EOS_TOKEN = "<|endoftext|>"  # the document separator of tokenizers trained here (id 0)
PACKAGE_PREFIX = "swarmtrain:"
# Tokenizers shipped with the package. llama-tiny.json (vocab 2048) was trained on the default corpus
# by `swarmtrain tokenizer train --vocab-size 2048 --max-bytes 16000000 --out
# src/swarmtrain/data/tokenizers/llama-tiny.json stdlib` with CPython 3.11.7's standard library and
# tokenizers 0.23.3 (another Python's library gives a slightly different, equally good tokenizer).
PACKAGE_DIR = Path(__file__).parent / "tokenizers"
HASH_CHARS = 16

# End-of-document tokens of common model families, tried (in this order) when a tokenizer comes
# without a model directory that names its eos token.
_KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
# texts per encode_batch call when encoding a list of documents: enough to keep every thread busy,
# few enough that the per-token Encoding objects of one call (~120 bytes a token) stay small
_ENCODE_BATCH_CHARS = 2_000_000
# Longer documents are encoded in pieces of at most this many characters: tokenizers needs ~100 bytes
# per character of the text it is encoding (byte alignments, splits), per thread, so one 1 MB
# document would cost 100 MB. Pieces are cut before a space that starts a word, where the byte-level
# pre-tokenizer splits anyway, so the ids are those of the whole document.
PIECE_CHARS = 2**16


def resolve_tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a spec names: a file, a directory holding tokenizer.json, or
    `swarmtrain:NAME` (src/swarmtrain/data/tokenizers/NAME.json)."""
    if not spec:
        raise DataError("no tokenizer given (an empty tokenizer means byte-level data)")
    if spec.startswith(PACKAGE_PREFIX):
        name = spec[len(PACKAGE_PREFIX) :]
        path = PACKAGE_DIR / f"{name}.json"
        if not path.is_file():
            shipped = sorted(p.stem for p in PACKAGE_DIR.glob("*.json"))
            raise DataError(
                f"no tokenizer {spec!r} shipped with swarmtrain (looked for {path}); shipped: "
                f"{', '.join(PACKAGE_PREFIX + s for s in shipped) or 'none'}"
            )
        return path
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"tokenizer directory {spec} has no tokenizer.json (only fast, tokenizers-format "
                f"tokenizers are supported)"
            )
    elif not path.is_file():
        raise DataError(f"tokenizer file does not exist: {path}")
    return path


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer a spec names (see `resolve_tokenizer_file`); a clear DataError naming the path when
    it is missing or not a tokenizer.json."""
    path = resolve_tokenizer_file(spec)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise DataError(f"cannot load tokenizer {path}: {exc}") from None


def tokenizer_hash(tok: Tokenizer) -> str:
    """Identity of a tokenizer: sha256 of its JSON with sorted keys (independent of how the file was
    formatted or in which order a library wrote its maps), first 16 hex digits."""
    canonical = json.dumps(
        json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_CHARS]


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can produce (model vocabulary plus added tokens): the smallest
    model.vocab_size that can embed its output."""
    return int(tok.get_vocab_size(with_added_tokens=True))


def eos_id(tok: Tokenizer, spec: str = "") -> int:
    """The id placed after every document. A Hugging Face model directory's own eos token (from
    tokenizer_config.json, special_tokens_map.json or config.json) when `spec` is one; otherwise
    `<|endoftext|>` or another common end-of-text token the tokenizer has."""
    if spec and not spec.startswith(PACKAGE_PREFIX) and Path(spec).expanduser().is_dir():
        named = _model_dir_eos(Path(spec).expanduser(), tok)
        if named is not None:
            return named
    for token in _KNOWN_EOS:
        found = tok.token_to_id(token)
        if found is not None:
            return int(found)
    where = f" ({spec})" if spec else ""
    raise DataError(
        f"tokenizer{where} has no end-of-document token: expected an eos_token in the model directory's "
        f"tokenizer_config.json or one of {', '.join(_KNOWN_EOS)} in its vocabulary"
    )


def _model_dir_eos(directory: Path, tok: Tokenizer) -> int | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _read_json(directory / name).get("eos_token")
        if isinstance(token, dict):  # AddedToken serialized as {"content": ..., ...}
            token = token.get("content")
        found = tok.token_to_id(token) if isinstance(token, str) else None
        if found is not None:
            return int(found)
    for name in ("generation_config.json", "config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        if isinstance(value, list) and value:  # several stop ids (chat models): the first ends documents
            value = value[0]
        if isinstance(value, int) and 0 <= value < vocab_size(tok):
            return value
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE (GPT-2 style): text is split into words by the GPT-2 regex and
    mapped to 256 printable stand-ins of its bytes, so every string has a tokenization (no unknowns)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # as GPT-2's tokenizer.json: adds no tokens, leaves offsets as the pre-tokenizer made them
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(
    sources: Sequence[str],
    vocab_size: int,
    out_path: str | os.PathLike[str],
    text_field: str = "text",
    progress: bool = True,
    max_bytes: int | None = None,
) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` ids (id 0 = `<|endoftext|>`, then the 256 bytes, then
    merges) on the documents of `sources` (see sources.iter_documents) and write it to `out_path`.
    tokenizers counts words on all cores; memory grows with the number of distinct words, not the
    corpus size."""
    from swarmtrain.data.sources import iter_documents

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"a byte-level BPE needs vocab_size >= {len(alphabet) + 1}, got {vocab_size}")
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=progress,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
    )
    stats = _Counted(iter_documents(sources, text_field, max_bytes))
    tok.train_from_iterator(stats, trainer=trainer)
    if stats.documents == 0:
        raise DataError(f"no text in {', '.join(sources)}")
    save_tokenizer(tok, out_path)
    return tok


class _Counted:
    """Passes documents through while counting them (an empty corpus trains an empty BPE silently)."""

    def __init__(self, docs: Iterable[str]) -> None:
        self._docs = docs
        self.documents = 0

    def __iter__(self) -> Iterator[str]:
        for doc in self._docs:
            self.documents += 1
            yield doc


def save_tokenizer(tok: Tokenizer, out_path: str | os.PathLike[str]) -> Path:
    """Write tokenizer.json atomically (a reader never sees half a file)."""
    out = Path(out_path).expanduser()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp), pretty=True)
        os.replace(tmp, out)
    except Exception as exc:  # OSError from mkdir/replace, a bare Exception from tokenizers' writer
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write tokenizer {out}: {exc}") from None
    return out


def encode_documents(
    tok: Tokenizer, docs: Sequence[str], eos: int, dtype: np.dtype | None = None
) -> np.ndarray:
    """Token ids of `docs` as one stream with `eos` after every document. Encodes in batches on all
    cores (tokenizers' encode_batch releases the GIL); memory holds one batch's Encoding objects."""
    dtype = dtype if dtype is not None else token_dtype(vocab_size(tok))
    parts: list[np.ndarray] = []
    start = 0
    while start < len(docs):
        stop, chars = start, 0
        while stop < len(docs) and (stop == start or chars < _ENCODE_BATCH_CHARS):
            chars += len(docs[stop])
            stop += 1
        parts.extend(encode_batch(tok, docs[start:stop], eos, dtype))
        start = stop
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def encode_batch(tok: Tokenizer, docs: Sequence[str], eos: int, dtype: np.dtype) -> list[np.ndarray]:
    """One array per document: its ids followed by `eos` (no other special tokens are added)."""
    pieces: list[str] = []
    owners: list[int] = []  # the document each piece belongs to
    for index, doc in enumerate(docs):
        for piece in split_pieces(doc):
            pieces.append(piece)
            owners.append(index)
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast skips offsets (0.20+)
    ids: list[list[int]] = [[] for _ in docs]
    for owner, enc in zip(owners, encode(pieces, add_special_tokens=False), strict=True):
        ids[owner].extend(enc.ids)
    for doc_ids in ids:
        doc_ids.append(eos)
    return [np.array(doc_ids, dtype=dtype) for doc_ids in ids]


def split_pieces(doc: str, limit: int = PIECE_CHARS) -> list[str]:
    """`doc` cut into pieces of at most `limit` characters, each cut just before a space followed by a
    non-space (a pre-token boundary of byte-level BPE), else after a newline, else at the limit."""
    if len(doc) <= limit:
        return [doc]
    pieces = []
    start = 0
    while len(doc) - start > limit:
        end = start + limit
        cut = doc.rfind(" ", start + 1, end)
        while cut > start and doc[cut + 1].isspace():  # inside a run of spaces: not a boundary
            cut = doc.rfind(" ", start + 1, cut)
        if cut <= start:
            newline = doc.rfind("\n", start, end - 1)
            cut = newline + 1 if newline >= start else end
        pieces.append(doc[start:cut])
        start = cut
    pieces.append(doc[start:])
    return pieces
