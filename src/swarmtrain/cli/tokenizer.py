"""`swarmtrain tokenizer train`: a byte-level BPE tokenizer (tokenizer.json) trained on text sources."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import positive_int

HELP = "train a byte-level BPE tokenizer (a tokenizer.json for data.tokenizer and `swarmtrain tokenize`)"

SOURCES_HELP = (
    "where the text comes from, read in order: `stdlib` (this Python's standard library sources), text "
    "files or folders (recursive; hidden and binary files skipped), .jsonl / .jsonl.zst / .parquet files "
    "(the --text-field column), a directory saved by `datasets` (its train split), or hf:NAME[:CONFIG] "
    "(a Hugging Face hub dataset, streamed)"
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tokenizer",
        help=HELP,
        description="Tokenizers for subword-level training. `swarmtrain tokenizer train` writes a byte-level "
        "BPE (GPT-2 style: every string has a tokenization, no unknown tokens) with <|endoftext|> at id 0 as "
        "the document separator. The file loads in Hugging Face `tokenizers` and in "
        "transformers.PreTrainedTokenizerFast(tokenizer_file=...).",
    )
    actions = parser.add_subparsers(dest="tokenizer_action", metavar="ACTION")
    train = actions.add_parser(
        "train",
        help="train a byte-level BPE on SOURCES and write tokenizer.json",
        description="Train a byte-level BPE with --vocab-size ids (1 special token, the 256 bytes, then "
        "merges) on SOURCES and write it to --out. Training counts words on all cores; memory grows with "
        "the number of distinct words, not the corpus size. The bundled swarmtrain:llama-tiny tokenizer is "
        "`swarmtrain tokenizer train --vocab-size 2048 --max-bytes 16000000 --out "
        "src/swarmtrain/data/tokenizers/llama-tiny.json stdlib`.",
    )
    train.add_argument(
        "--vocab-size", type=positive_int, required=True, metavar="N", help="ids in the vocabulary"
    )
    train.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write")
    train.add_argument(
        "--text-field", default="text", metavar="F", help="text column of structured sources (default: text)"
    )
    train.add_argument(
        "--max-bytes",
        type=positive_int,
        default=None,
        metavar="N",
        help="read at most N bytes of text (default: all)",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES_HELP)
    train.set_defaults(func=run_train)

    def no_action(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=no_action)


def run_train(args: argparse.Namespace) -> int:
    import time

    from swarmtrain.data.tokenizer import tokenizer_hash, train_bpe, vocab_size

    started = time.monotonic()
    tok = train_bpe(
        args.sources,
        args.vocab_size,
        args.out,
        text_field=args.text_field,
        progress=not args.no_progress,
        max_bytes=args.max_bytes,
    )
    vocab = vocab_size(tok)
    short = f" (the corpus ran out of merges before {args.vocab_size})" if vocab < args.vocab_size else ""
    print(
        f"wrote {args.out}: byte-level BPE, vocab {vocab}{short}, tokenizer {tokenizer_hash(tok)}, "
        f"{time.monotonic() - started:.1f} s"
    )
    return 0
