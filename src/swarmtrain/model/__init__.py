"""Single-device GPT-style decoder, cut into pipeline stages, with checkpoints keyed by global layer."""

from swarmtrain.model.checkpoint import (
    assemble_state_dict,
    load_model_checkpoint,
    load_stage_from_checkpoint,
    save_model_checkpoint,
    save_stage_checkpoint,
)
from swarmtrain.model.gpt import Block, GPTStage, build_model, build_stage, build_stages

__all__ = [
    "Block",
    "GPTStage",
    "assemble_state_dict",
    "build_model",
    "build_stage",
    "build_stages",
    "load_model_checkpoint",
    "load_stage_from_checkpoint",
    "save_model_checkpoint",
    "save_stage_checkpoint",
]
