"""`swarmtrain export`: one whole-model safetensors file from a swarm's stage checkpoints."""

from __future__ import annotations

import argparse

HELP = "assemble the whole model from stage checkpoints (for train-local --init-from, or inference)"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help=HELP,
        description=HELP + ". Reads DIR/stage<N>/step*.safetensors as servers write them with "
        "--checkpoint-dir, takes the newest step every stage has, and writes the parameters (no optimizer "
        "state) keyed by global layer, as train-local's checkpoints are.",
    )
    parser.add_argument(
        "--checkpoint-dir", required=True, metavar="DIR", help="the servers' --checkpoint-dir"
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write")
    parser.add_argument(
        "--step", type=int, help="export this step (default: the newest common to all stages)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from swarmtrain.config.errors import UserError
    from swarmtrain.runtime.server.stage_checkpoint import export_model

    named, meta = export_model(args.checkpoint_dir, args.step)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(named, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
        tmp.replace(out)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror}") from None
    params = sum(t.numel() for t in named.values())
    print(f"wrote {out}: {meta['stages']} stage(s) at step {meta['step']}, {params:,} parameters")
    return 0
