"""Typed, frozen configuration: model shape, training, swarm-wide settings, presets, TOML, size math.

No torch and no hivemind here: the planner and the simulator depend on this package.
"""

from swarmtrain.config.errors import ConfigError, UserError
from swarmtrain.config.loading import load_run_config, run_config_from_dict
from swarmtrain.config.model import ModelConfig, StageSpec, partition_layers
from swarmtrain.config.presets import PRESETS, get_preset, preset_names
from swarmtrain.config.run import DataConfig, DilocoConfig, RunConfig, SwarmConfig, TrainingConfig

__all__ = [
    "ConfigError",
    "UserError",
    "DataConfig",
    "ModelConfig",
    "PRESETS",
    "RunConfig",
    "StageSpec",
    "SwarmConfig",
    "TrainingConfig",
    "DilocoConfig",
    "get_preset",
    "load_run_config",
    "partition_layers",
    "preset_names",
    "run_config_from_dict",
]
