"""`swarmtrain export`: the whole model from a swarm's stage checkpoints (or a train-local checkpoint),
as one swarmtrain safetensors file (`--out`) and/or a Hugging Face model directory (`--hf-out`)."""

from __future__ import annotations

import argparse

from swarmtrain.cli.common import add_command, add_run_config_args, positive_int

HELP = (
    "assemble the whole model from stage checkpoints (for train-local --init-from, inference, Hugging Face)"
)

DESCRIPTION = """\
Reads DIR/stage<N>/step*.safetensors as servers write them with --checkpoint-dir, takes the newest step
every stage has (or --step), or reads one whole-model file (--from-file: train-local's
CHECKPOINT_DIR/model.safetensors, or an earlier --out). Writes the parameters (no optimizer state):

  --out FILE     keyed by global layer, as train-local's checkpoints are (train-local --init-from FILE)
  --hf-out DIR   a Hugging Face model directory: config.json, model.safetensors (sharded past
                 --max-shard-mb, with model.safetensors.index.json), and the run's tokenizer
                 (data.tokenizer; byte-level runs get a tokenizer whose ids are the bytes), so
                 transformers' AutoModelForCausalLM/AutoTokenizer.from_pretrained(DIR) load it.
                 Llama runs export LlamaForCausalLM, GPT runs GPT2LMHeadModel (exact GELU); shared
                 layers are unrolled. Needs the run's config (--preset/--config/--init-from-hf as the
                 peers had; default: the preset recorded in the checkpoints): the tensors are checked
                 against it. A model with subspace boundaries (model.boundary = subspace) is folded
                 into a plain one computing the same function (its fixed token table and basis come
                 from the run's seed, so the config must be the run's own); other boundary layers are
                 refused (use --out).
"""


def register(subparsers) -> None:
    parser = add_command(subparsers, "export", run, HELP, description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", metavar="DIR", help="the servers' --checkpoint-dir")
    source.add_argument(
        "--from-file",
        metavar="FILE",
        help="a whole-model .safetensors: train-local's CHECKPOINT_DIR/model.safetensors or an --out file",
    )
    parser.add_argument("--out", metavar="FILE", help="the .safetensors file to write")
    parser.add_argument("--hf-out", metavar="DIR", help="the Hugging Face model directory to write")
    parser.add_argument(
        "--step", type=int, help="export this step (default: the newest common to all stages)"
    )
    parser.add_argument(
        "--max-shard-mb",
        type=positive_int,
        default=2048,
        metavar="MB",
        help="--hf-out: split the weights into files of at most MB megabytes (default: 2048)",
    )
    add_run_config_args(parser)


def run(args: argparse.Namespace) -> int:
    from swarmtrain.config.errors import UserError

    if not args.out and not args.hf_out:
        raise UserError("nothing to write: give --out FILE and/or --hf-out DIR")
    if args.step is not None and not args.checkpoint_dir:
        raise UserError("--step needs --checkpoint-dir (a --from-file holds one step)")
    named, meta = _read(args)
    if args.out:
        _write_safetensors(named, meta, args.out)
    if args.hf_out:
        _write_hf(named, meta, args)
    return 0


def _read(args: argparse.Namespace) -> tuple[dict, dict]:
    """(parameters by our names, what is known of where they come from)."""
    if args.checkpoint_dir:
        from swarmtrain.runtime.server.stage_checkpoint import export_model

        named, found = export_model(args.checkpoint_dir, args.step)
        found["source"] = f"{args.checkpoint_dir} (step {found['step']})"
        return named, found
    import json
    from pathlib import Path

    from safetensors import safe_open

    from swarmtrain.model.checkpoint import CheckpointError

    path = Path(args.from_file)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            stored = handle.metadata() or {}
            named = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # safetensors raises several types for unreadable or corrupt files
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    meta: dict = {"source": str(path)}
    for key in ("step", "digest", "preset"):  # what an --out file records (train-local's records none)
        try:
            meta[key] = json.loads(stored[key]) if key in stored else None
        except ValueError:
            meta[key] = None
    return named, meta


def _write_safetensors(named: dict, meta: dict, out_path: str) -> None:
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from swarmtrain.config.errors import UserError

    out = Path(out_path)
    tmp = out.with_name(out.name + ".tmp")
    recorded = {k: v for k, v in meta.items() if k != "source"}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(named, str(tmp), metadata={k: json.dumps(v) for k, v in recorded.items()})
        tmp.replace(out)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror}") from None
    params = sum(t.numel() for t in named.values())
    if "stages" in meta:
        print(f"wrote {out}: {meta['stages']} stage(s) at step {meta['step']}, {params:,} parameters")
    else:
        print(f"wrote {out}: {params:,} parameters from {meta['source']}")


def _write_hf(named: dict, meta: dict, args: argparse.Namespace) -> None:
    from swarmtrain.cli.common import run_config_from_args
    from swarmtrain.config import preset_names
    from swarmtrain.model.hf_checkpoint import save_hf_model

    given = args.preset or args.config or args.init_from_hf
    if not given and meta.get("preset") in preset_names():
        args.preset = meta["preset"]  # the run's own preset, as its checkpoints record it
    cfg = run_config_from_args(args)
    how = (
        "--init-from-hf " + args.init_from_hf if args.init_from_hf else args.config or f"preset {cfg.preset}"
    )
    named, model = _plain_model(named, meta, cfg, how)
    tokenizer_file = None
    if cfg.data.tokenizer:
        from swarmtrain.data.tokenizer import resolve_tokenizer_file

        tokenizer_file = resolve_tokenizer_file(cfg.data.tokenizer)
    byte_level = not cfg.data.tokenizer and cfg.model.vocab_size >= 256
    report = save_hf_model(
        named,
        model,
        args.hf_out,
        tokenizer_file=tokenizer_file,
        max_shard_bytes=args.max_shard_mb << 20,
        byte_level_tokenizer=byte_level,
        source=meta["source"],
    )
    tokenizer = report.tokenizer or "none (byte-level data with a vocabulary under 256)"
    print(
        f"wrote {report.directory}: {report.parameters:,} parameters ({report.bytes_written / 2**20:.1f} MB) "
        f"from {meta['source']}; {cfg.model.arch} model config from {how}; tokenizer: {tokenizer}; "
        f"files: {', '.join(report.files)}"
    )


def _plain_model(named: dict, meta: dict, cfg, how: str):
    """(parameters, model config) of the plain model to write: as they are, or folded from subspace
    boundaries (model/subspace.py); other boundary layers are refused."""
    import dataclasses

    from swarmtrain.config.errors import UserError
    from swarmtrain.config.model import SUBSPACE
    from swarmtrain.model.build import fixed_subspace
    from swarmtrain.model.hf_checkpoint import check_state_dict
    from swarmtrain.model.subspace import fold_subspace

    source = f"{meta['source']} (model config from {how})"
    digest_differs = bool(meta.get("digest")) and meta["digest"] != cfg.digest()
    if cfg.model.boundary == SUBSPACE:
        if digest_differs:
            raise UserError(
                f"--hf-out: the checkpoint was made under run config digest {meta['digest']}, this config's "
                f"is {cfg.digest()}; a subspace model's fixed token table and basis come from the run's "
                "config (seed, shape, boundary table), so pass the peers' exact --preset/--config and flags"
            )
        check_state_dict(named, cfg.model, source, cfg.boundary_cuts())
        folded = fold_subspace(named, cfg.model.arch, *fixed_subspace(cfg.model, cfg.training.seed))
        return folded, dataclasses.replace(cfg.model, boundary="none", boundary_dim=0, boundary_table="")
    if cfg.model.boundary != "none" or any(name.startswith("boundaries.") for name in named):
        raise UserError(
            f"--hf-out: this model has {cfg.model.boundary if cfg.model.boundary != 'none' else 'boundary'} "
            "layers between its stages ([model] boundary), so it is no longer a plain "
            f"{'Llama' if cfg.model.arch == 'llama' else 'GPT-2'} that transformers can load; use --out"
        )
    check_state_dict(named, cfg.model, source)
    if digest_differs:
        # the model's tensors fit; the run's other settings (schedule, stage cut, ...) or a field that
        # shapes no tensor (norm epsilon, rotary base) may still differ from this config
        print(
            f"note: the checkpoint was made under run config digest {meta['digest']}, this config's is "
            f"{cfg.digest()}: config.json is written from this config ({how}); pass the peers' "
            f"--preset/--config/--init-from-hf if they differ"
        )
    return named, cfg.model
