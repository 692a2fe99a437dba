"""The deadline of a state download (planner/download_deadline.py): it follows the state's size."""

import math

import pytest

from swarmtrain.config.presets import get_preset
from swarmtrain.config.sizes import params_per_stage, stage_state_bytes, total_params
from swarmtrain.planner.download_deadline import (
    DEFAULT_RULE,
    REPLICA_COPIES,
    DownloadRule,
    donor_deadline_s,
    donors_that_fit,
    download_deadline_s,
    replica_deadline_s,
    replica_plan,
    state_bytes,
)

pytestmark = pytest.mark.unit


def test_a_donor_deadline_is_the_base_plus_the_state_at_the_minimum_rate():
    rule = DownloadRule(base_s=10.0, min_rate_bytes_per_s=1e6, max_donors=3)
    assert donor_deadline_s(0, rule) == 10.0
    assert donor_deadline_s(5e6, rule) == pytest.approx(15.0)
    assert download_deadline_s(5e6, rule) == pytest.approx(45.0)


def test_the_state_size_is_the_one_config_sizes_counts():
    cfg = get_preset("tiny")
    for stage in cfg.stages():
        assert state_bytes(params_per_stage(cfg.model, stage)) == stage_state_bytes(cfg.model, stage)


def test_a_large_stage_gets_minutes_a_tiny_one_the_base():
    tiny, big = get_preset("tiny"), get_preset("llama-8b")
    tiny_s = max(donor_deadline_s(stage_state_bytes(tiny.model, s)) for s in tiny.stages())
    big_s = max(donor_deadline_s(stage_state_bytes(big.model, s)) for s in big.stages())
    assert DEFAULT_RULE.base_s <= tiny_s < DEFAULT_RULE.base_s + 5
    assert big_s > 10 * tiny_s  # the fixed 1,800 s was too short or far too long, never right
    replica_s = replica_deadline_s(total_params(big.model))
    assert replica_s == pytest.approx(download_deadline_s(total_params(big.model) * 4 * REPLICA_COPIES))


def test_the_donors_tried_fit_in_the_time_left():
    assert donors_that_fit(math.inf, 10.0) == DEFAULT_RULE.max_donors
    assert donors_that_fit(25.0, 10.0) == 2
    assert donors_that_fit(5.0, 10.0) == 1  # at least one: the caller decides whether to try at all
    assert donors_that_fit(1e9, 10.0) == DEFAULT_RULE.max_donors
    donor_s, donors = replica_plan(1000, left_s=math.inf)
    assert donor_s == donor_deadline_s(1000 * 4 * REPLICA_COPIES) and donors == DEFAULT_RULE.max_donors


@pytest.mark.parametrize("kwargs", [{"base_s": -1.0}, {"min_rate_bytes_per_s": 0.0}, {"max_donors": 0}])
def test_an_invalid_rule_is_refused(kwargs):
    with pytest.raises(ValueError):
        DownloadRule(**kwargs)
    with pytest.raises(ValueError):
        donor_deadline_s(-1.0)
