"""`swarmtrain boundary-table`: the fixed token table of a subspace run, from its training data."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import add_run_config_args, positive_int, run_config_from_args

HELP = "make a subspace run's fixed token table from its training data ([model] boundary_table)"
DEFAULT_MAX_TOKENS = 20_000_000  # co-occurrence statistics of a few tens of millions of tokens settle
ROWS_PER_BATCH = 1024  # training sequences counted at once
PROGRESS_EVERY_S = 10.0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "boundary-table",
        help=HELP,
        description='A run with exact subspace boundaries ([model] boundary = "subspace") keeps a fixed, '
        "full-rank token table in its residual stream; drawn at random it tells the model nothing. This "
        "writes one made from the run's training data instead (token co-occurrences within a few "
        "positions, positive PMI, truncated SVD: tokens used alike get similar rows), still fixed, so "
        "boundaries stay exact and the model still exports as a plain one. Use it with "
        '`--boundary-table FILE` or `boundary_table = "FILE"` in the run file\'s [model]; every peer needs '
        "a file of the same content (its hash is in the run digest).",
    )
    add_run_config_args(parser, default_preset="llama-tiny", compression=False)
    parser.add_argument("--out", required=True, metavar="FILE", help="the table to write (.safetensors)")
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"count at most N training tokens (default: {DEFAULT_MAX_TOKENS:,})",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from swarmtrain.data.packing import build_datasets
    from swarmtrain.data.token_table import cooccurrence_counts, token_table
    from swarmtrain.model.subspace import save_token_table, seen_rows

    started = time.monotonic()
    cfg = run_config_from_args(args)
    model = cfg.model
    train, _ = build_datasets(cfg)
    max_rows = max(1, args.max_tokens // model.seq_len)
    batches = (inputs for inputs, _ in train.ordered_batches(ROWS_PER_BATCH, max_rows))
    counts = cooccurrence_counts(_reported(batches, model.seq_len, started), model.vocab_size)
    rows = token_table(counts, model.d_model)
    save_token_table(args.out, rows)
    seen = int(seen_rows(rows).sum())
    print(
        f"wrote {args.out}: {model.vocab_size:,} x {model.d_model} token table from "
        f"{min(len(train), max_rows) * model.seq_len:,} tokens ({seen:,} of the ids seen; the others are "
        f"drawn from the run's seed), {time.monotonic() - started:.1f} s. Use it with --boundary subspace "
        f"--boundary-dim K --boundary-table {args.out}"
    )
    return 0


def _reported(batches, seq_len: int, started: float):
    """`batches` as they are, with a line of progress every PROGRESS_EVERY_S."""
    import time

    tokens, last = 0, started
    for batch in batches:
        tokens += batch.shape[0] * seq_len
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            print(f"counted {tokens:,} tokens ({last - started:.0f} s)", flush=True)
        yield batch
