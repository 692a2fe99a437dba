"""Checkpoints in safetensors, keyed by global layer index (`layers.<i>.<param>`), so any stage can be
built from a whole-model checkpoint and a whole model assembled from stage checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from swarmtrain.config.errors import UserError
from swarmtrain.model.stage import DecoderStage


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable or does not contain what a stage needs."""


def save_stage_checkpoint(stage: DecoderStage, path: str | Path, metadata: dict | None = None) -> None:
    """Write one stage's parameters; tensors are cloned contiguous so shared storage cannot bite."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in stage.state_dict().items()}
    meta = {"layer_start": str(stage.spec.layer_start), "layer_end": str(stage.spec.layer_end)}
    meta.update({k: json.dumps(v) for k, v in (metadata or {}).items()})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


save_model_checkpoint = save_stage_checkpoint  # a whole model is the stage holding every layer


def _read(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def assemble_state_dict(paths: list[str | Path]) -> dict[str, torch.Tensor]:
    """Merge stage checkpoints (or whole-model ones) into one state dict keyed by global layer."""
    merged: dict[str, torch.Tensor] = {}
    for path in paths:
        merged.update(_read(path))
    return merged


def load_stage_from_checkpoint(stage: DecoderStage, paths: str | Path | list[str | Path]) -> DecoderStage:
    """Fill `stage` with the parameters it owns from one or more checkpoint files."""
    paths = [paths] if isinstance(paths, (str, Path)) else paths
    available = assemble_state_dict(paths)
    wanted = stage.state_dict()
    missing = [k for k in wanted if k not in available]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensor(s) this stage needs, e.g. {missing[0]}"
        )
    for key, tensor in wanted.items():
        if available[key].shape != tensor.shape:
            raise CheckpointError(
                f"{key}: checkpoint shape {tuple(available[key].shape)} != model {tuple(tensor.shape)}"
            )
    stage.load_state_dict({k: available[k] for k in wanted})
    return stage


load_model_checkpoint = load_stage_from_checkpoint
