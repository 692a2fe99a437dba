"""The deadline of a state download (planner/download_deadline.py): it follows the state's size."""

import math

import pytest

from swarmtrain.config.presets import get_preset
from swarmtrain.config.sizes import params_per_stage, stage_state_bytes, total_params
from swarmtrain.planner.download_deadline import (
    BYTES_PER_MBIT,
    DEFAULT_RULE,
    REPLICA_COPIES,
    DownloadRule,
    describe,
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


def test_a_peer_on_a_home_link_sets_a_rule_its_link_can_meet():
    """The default minimum (100 Mbit/s) cuts every donor of a joiner whose own link is slower: llama-8b's
    first stage (11.5 GB) takes 9,200 s at 10 Mbit/s and a donor gets 953 s. With
    --state-download-min-mbit 5 (half its link) the deadline is past the time its link needs."""
    first = get_preset("llama-8b")
    state = stage_state_bytes(first.model, first.stages()[0])
    link_s = state / (10 * BYTES_PER_MBIT)
    assert donor_deadline_s(state) < link_s / 9
    home = DownloadRule.of(min_mbit=5.0)
    assert home.base_s == DEFAULT_RULE.base_s and home.min_mbit == 5.0
    assert donor_deadline_s(state, home) > link_s
    assert DownloadRule.of() == DEFAULT_RULE and DEFAULT_RULE.min_mbit == 100.0
    assert DownloadRule.of(min_mbit=4, base_s=2) == DownloadRule(2.0, 5e5)


def test_the_rule_in_words_is_what_a_peer_prints_at_start():
    rule = DownloadRule.of(min_mbit=4, base_s=2)
    assert describe(1_397_760, rule) == (
        "each donor 4.8 s (2 s + 1.4 MB at 4 Mbit/s), at most 3 donors: 14.4 s in all "
        "(--state-download-min-mbit, --state-download-base-s)"
    )


def test_a_replica_downloads_under_its_own_rule():
    rule = DownloadRule(base_s=1.0, min_rate_bytes_per_s=1e3, max_donors=2)
    donor_s = 1.0 + 1000 * 4 * REPLICA_COPIES / 1e3
    assert replica_plan(1000, math.inf, rule) == (donor_s, 2)
    assert replica_plan(1000, 1.5 * donor_s, rule) == (donor_s, 1)
    assert replica_deadline_s(1000, rule) == 2 * donor_s


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_s": -1.0},
        {"min_rate_bytes_per_s": 0.0},
        {"max_donors": 0},
        {"base_s": math.inf},  # no deadline at all: what the rule exists to prevent
        {"min_rate_bytes_per_s": math.nan},
    ],
)
def test_an_invalid_rule_is_refused(kwargs):
    with pytest.raises(ValueError):
        DownloadRule(**kwargs)
    with pytest.raises(ValueError):
        donor_deadline_s(-1.0)
