"""Starting peers from a placement plan (`swarmtrain plan ... --json > plan.json`): which stage device I
serves, and the stage cut (number of stages, layers per stage) every peer of the run must share (it is
part of the config digest). Pure functions on the plan's JSON object."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from swarmtrain.config import RunConfig
from swarmtrain.config.errors import UserError


class PlanError(UserError):
    """A plan file that cannot be used for this run."""


def load_plan(path: str | Path) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanError(f"cannot read plan {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"plan {path} is not JSON ({exc.msg}); write it with `swarmtrain plan ... --json`"
        ) from None
    groups = plan.get("groups") if isinstance(plan, dict) else None
    if not (isinstance(groups, list) and groups and all(isinstance(g, list) and g for g in groups)):
        raise PlanError(f"plan {path} has no `groups` (one list of device indices per stage)")
    return plan


def config_from_plan(cfg: RunConfig, plan: dict) -> RunConfig:
    """The run config with the plan's stage cut: as many stages as groups, and the plan's layers per
    stage when it chose them (`plan --compute`), else an even cut."""
    stages = len(plan["groups"])
    layers = plan.get("layers_per_stage")
    if layers is not None:
        if len(layers) != stages or sum(layers) != cfg.model.num_layers:
            raise PlanError(
                f"the plan cuts {sum(layers)} layers into {len(layers)} stages; this run's model has "
                f"{cfg.model.num_layers} layers (make the plan with --model of this run)"
            )
        layers = tuple(int(n) for n in layers)
    if stages > cfg.model.num_layers:
        raise PlanError(f"the plan has {stages} stages; this run's model has {cfg.model.num_layers} layers")
    swarm = dataclasses.replace(cfg.swarm, num_stages=stages, layers_per_stage=layers)
    return cfg.replace(swarm=swarm)


def stage_of_device(plan: dict, device_index: int) -> int:
    for stage, group in enumerate(plan["groups"]):
        if device_index in group:
            return stage
    devices = sorted(d for g in plan["groups"] for d in g)
    raise PlanError(
        f"device {device_index} is in no stage group of the plan (devices {devices[0]}..{devices[-1]})"
    )
