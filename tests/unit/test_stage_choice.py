"""`--stage auto`: which stage a joining server takes, from the stages' announcements."""

import pytest

from swarmtrain.config import get_preset
from swarmtrain.net.dht_records import StageAnnouncement
from swarmtrain.runtime.server.stage_choice import choose_stage

pytestmark = pytest.mark.unit


class Records:
    def __init__(self, peers):
        self.peers = peers

    def stage_peers(self, stage):
        return self.peers.get(stage, {})


def ann(stage, throughput, digest, state="online"):
    return StageAnnouncement(stage, [], throughput, 0, digest, 0, state)


def test_empty_stages_first_then_the_bottleneck():
    cfg = get_preset("tiny")
    d = cfg.digest()
    assert choose_stage(cfg, Records({})).stage == 0
    assert choose_stage(cfg, Records({0: {"a": ann(0, 100.0, d, "joining")}})).stage == 1
    loads = {0: {"a": ann(0, 100.0, d)}, 1: {"b": ann(1, 60.0, d), "c": ann(1, 30.0, d)}}
    choice = choose_stage(cfg, Records(loads))
    assert choice.stage == 1 and choice.capacities_samples_per_s == [100.0, 90.0]
    assert choice.peers_per_stage == [1, 2]


def test_peers_of_another_config_do_not_count():
    cfg = get_preset("tiny")
    loads = {0: {"a": ann(0, 100.0, cfg.digest())}, 1: {"x": ann(1, 900.0, "another-run")}}
    assert choose_stage(cfg, Records(loads)).stage == 1
