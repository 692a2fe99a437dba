"""Starting servers from a placement plan: stage of a device, the plan's stage cut, clear errors."""

import json

import pytest

from swarmtrain.config import get_preset
from swarmtrain.planner.plan_file import PlanError, config_from_plan, load_plan, stage_of_device

pytestmark = pytest.mark.unit


def test_stage_and_cut_from_a_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"groups": [[2, 3], [0, 1]], "layers_per_stage": [1, 3]}))
    plan = load_plan(path)
    assert [stage_of_device(plan, i) for i in range(4)] == [1, 1, 0, 0]
    cfg = config_from_plan(get_preset("tiny"), plan)
    assert cfg.swarm.num_stages == 2 and [(s.layer_start, s.layer_end) for s in cfg.stages()] == [
        (0, 1),
        (1, 4),
    ]
    assert cfg.digest() != get_preset("tiny").digest()  # every peer must take the same plan
    even = config_from_plan(get_preset("tiny"), {"groups": [[0], [1], [2], [3]]})
    assert [s.num_layers for s in even.stages()] == [1, 1, 1, 1]
    with pytest.raises(PlanError, match="device 7"):
        stage_of_device(plan, 7)


def test_bad_plans_are_user_errors(tmp_path):
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        load_plan(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"cost_s": 1.0}))
    with pytest.raises(PlanError, match="groups"):
        load_plan(tmp_path / "y.json")
    with pytest.raises(PlanError, match="24 layers"):  # a plan made for gpt3-xl, a tiny run
        config_from_plan(get_preset("tiny"), {"groups": [[0], [1]], "layers_per_stage": [12, 12]})
