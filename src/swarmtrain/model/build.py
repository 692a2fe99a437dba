"""Building a stage of the configured architecture (`[model] arch`), deterministically from a seed."""

from __future__ import annotations

from swarmtrain.config.model import ModelConfig, StageSpec, partition_layers
from swarmtrain.model import gpt, llama
from swarmtrain.model.boundary import init_boundaries
from swarmtrain.model.stage import DecoderStage, name_seed
from swarmtrain.model.subspace import fixed_parts

# arch -> (stage class, its initializer)
_FAMILIES = {"gpt": (gpt.GPTStage, gpt.init_weights), "llama": (llama.LlamaStage, llama.init_weights)}


def build_stage(
    cfg: ModelConfig, spec: StageSpec, seed: int | None = 0, cuts: tuple[int, ...] = ()
) -> DecoderStage:
    """The module for one stage, initialized deterministically from `seed` (None: torch's default RNG).
    `cuts`: a whole model's stage cuts, where its boundary layers sit (`RunConfig.boundary_cuts`)."""
    stage_class, init_weights = _FAMILIES[cfg.arch]
    stage = stage_class(cfg, spec, cuts)
    init_weights(stage, cfg, seed)
    init_boundaries(stage.boundaries, cfg, lambda key: name_seed(seed, key))
    if stage.space is not None:
        stage.space.fill(*fixed_subspace(cfg, seed))
    return stage


def fixed_subspace(cfg: ModelConfig, seed: int | None = 0):
    """The fixed basis and token table of a subspace run (model/subspace.py) of seed `seed`."""
    return fixed_parts(cfg, lambda name: name_seed(seed, name))


def build_model(cfg: ModelConfig, seed: int | None = 0, cuts: tuple[int, ...] = ()) -> DecoderStage:
    """The whole model as one stage holding every layer (and the boundary layers at `cuts`)."""
    return build_stage(cfg, StageSpec(0, 1, 0, cfg.num_layers), seed, cuts)


def build_stages(
    cfg: ModelConfig, num_stages: int, layers_per_stage: list[int] | None = None, seed: int | None = 0
) -> list[DecoderStage]:
    return [
        build_stage(cfg, spec, seed)
        for spec in partition_layers(cfg.num_layers, num_stages, layers_per_stage)
    ]
