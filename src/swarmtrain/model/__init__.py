"""Decoders of two families (GPT, Llama) cut into pipeline stages, with checkpoints keyed by global layer."""

from swarmtrain.model.build import build_model, build_stage, build_stages
from swarmtrain.model.checkpoint import (
    assemble_state_dict,
    load_model_checkpoint,
    load_stage_from_checkpoint,
    save_model_checkpoint,
    save_stage_checkpoint,
)
from swarmtrain.model.gpt import Block, GPTStage
from swarmtrain.model.llama import LlamaStage
from swarmtrain.model.stage import DecoderStage

__all__ = [
    "Block",
    "DecoderStage",
    "LlamaStage",
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
