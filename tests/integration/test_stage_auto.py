"""`swarmtrain server --stage auto` on a live swarm: servers started one after another fill the empty
stage first, then the stage with the least capacity; a trainer then trains through them."""

import re

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

CHOICE = re.compile(
    r"--stage auto: stages have \[(.*?)\] peer\(s\), \[(.*?)\] samples/s: serving stage (\d+)"
)


def _choice(log_text: str) -> tuple[list[int], list[float], int]:
    match = CHOICE.search(log_text)
    assert match, log_text[-2000:]
    counts = [int(x) for x in match[1].split(",")]
    capacities = [float(x) for x in match[2].split(",")]
    return counts, capacities, int(match[3])


def test_auto_servers_fill_the_bottleneck(make_swarm):
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht()
    chosen = []
    for name in ("a", "b", "c"):
        swarm.start_server(name, "auto")
        swarm.wait_ready([name])
        counts, capacities, stage = _choice(swarm.processes[name].log_text())
        chosen.append(stage)
        if 0 in counts:
            assert stage == counts.index(0)  # an empty stage first
        else:
            assert capacities[stage] == min(capacities)
    assert chosen[:2] == [0, 1]  # one each, then the weaker stage gets the third
    swarm.start_trainer("trainer", "--max-samples", "256", "--in-flight", "2")
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
