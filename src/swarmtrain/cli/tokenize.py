"""`swarmtrain tokenize`: text sources to memory-mappable token shards (data.source = the shard folder)."""

from __future__ import annotations

import argparse
import sys

from swarmtrain.cli.common import add_command, checked_number, non_negative_int, positive_int
from swarmtrain.cli.tokenizer import SOURCES_HELP

HELP = "tokenize a corpus into token shards that training reads by memory map (data.source = DIR)"


_fraction = checked_number(float, lambda value: 0 <= value < 1, "a number in [0, 1)", "_fraction")


def register(subparsers) -> None:
    from swarmtrain.data.shards import DEFAULT_SHARD_TOKENS
    from swarmtrain.data.tokenize_job import DEFAULT_SEQ_LEN, DEFAULT_VAL_FRACTION, DEFAULT_VAL_TOKENS

    parser = add_command(
        subparsers,
        "tokenize",
        run,
        HELP,
        ". Documents are streamed from SOURCES, tokenized on all cores and written with "
        "the tokenizer's end-of-text id after each into DIR/train-NNNNN.tok and DIR/val-NNNNN.tok (fixed-size "
        "shards, uint16 or uint32 tokens after a 256-byte header) plus DIR/manifest.json. Memory does not "
        "grow with the corpus. A document goes to validation when a hash of its text falls below "
        "--val-fraction (until --val-tokens), so the splits never share a document. Validation holds at least "
        "one window of --seq-len + 1 tokens, what training reads: if the fraction gives less (a small "
        "corpus), the documents with the smallest hashes complete it, with a warning. A corpus that cannot "
        "give training and validation a window each (a single document, too few tokens) is an error. "
        "Interrupted (Ctrl-C, "
        "kill, crash)? Run the same command again: it continues from the last checkpoint and writes the "
        "same shards an uninterrupted run would. Train with data.source = DIR (and data.tokenizer = T to "
        "have the tokenizer checked against the shards).",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="T",
        help="a tokenizer.json, a Hugging Face model directory holding one, or swarmtrain:NAME (shipped: "
        "swarmtrain:llama-tiny)",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the shard directory (new, or one to resume)"
    )
    parser.add_argument(
        "--text-field", default="text", metavar="F", help="text column of structured sources (default: text)"
    )
    parser.add_argument(
        "--shard-tokens",
        type=positive_int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument(
        "--val-fraction",
        type=_fraction,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"share of documents held out for validation, chosen by a hash of their text; at least one "
        f"document is held out, 0 holds out none (no validation split; training needs one) (default: "
        f"{DEFAULT_VAL_FRACTION})",
    )
    parser.add_argument(
        "--val-tokens",
        type=non_negative_int,
        default=DEFAULT_VAL_TOKENS,
        metavar="N",
        help=f"stop holding out documents once validation has N tokens; 0 holds out none (default: "
        f"{DEFAULT_VAL_TOKENS:,})",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="the model.seq_len of the run that will train on the shards: validation (and training) then "
        "hold at least one window of N + 1 tokens (default: the longest seq_len of the presets that use "
        f"--tokenizer, 64 for swarmtrain:llama-tiny; {DEFAULT_SEQ_LEN} for any other tokenizer)",
    )
    parser.add_argument(
        "--max-bytes",
        type=positive_int,
        default=None,
        metavar="N",
        help="read at most N bytes of text (default: all)",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokenizer threads (default: all cores)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help=SOURCES_HELP)


def run(args: argparse.Namespace) -> int:
    from swarmtrain.data.tokenize_job import tokenize

    try:
        summary = tokenize(
            args.sources,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            val_fraction=args.val_fraction,
            val_tokens=args.val_tokens,
            seq_len=args.seq_len,
            max_bytes=args.max_bytes,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except KeyboardInterrupt:
        print(
            f"swarmtrain tokenize: interrupted; progress up to the last checkpoint is kept in {args.out}: run "
            f"the same command again to continue",
            file=sys.stderr,
        )
        return 130
    print(summary.line())
    if summary.val_fallback:
        print(
            f"warning: {summary.documents:,} documents are too few for --val-fraction {args.val_fraction} to "
            f"hold out one window of {summary.seq_len + 1} tokens (--seq-len {summary.seq_len} + 1): "
            f"validation holds the documents with the smallest hashes ({summary.val_documents:,} "
            f"document(s), {summary.val_tokens:,} tokens); for more, rerun into a new --out with a larger "
            f"--val-fraction",
            file=sys.stderr,
        )
    elif summary.val_tokens == 0:
        print(
            "warning: --val-fraction 0 or --val-tokens 0 wrote no validation split; training needs one: rerun "
            "into a new --out with both above 0",
            file=sys.stderr,
        )
    return 0
