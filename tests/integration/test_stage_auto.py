"""`swarmtrain server --stage auto` on a live swarm: servers started one after another fill the empty
stage first, then the stage with the least capacity; a trainer then trains through them."""

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def _choice(swarm, name: str) -> tuple[list[int], list[float], int]:
    """`--stage auto`'s inputs and choice, from the server's ledger (`stage_choice`)."""
    [choice] = swarm.ledger_events(name, "stage_choice")
    return choice["peers_per_stage"], choice["capacities_samples_per_s"], choice["stage"]


def test_auto_servers_fill_the_bottleneck(make_swarm):
    swarm, cfg = make_swarm("tiny")
    swarm.start_dht()
    chosen = []
    for name in ("a", "b", "c"):
        swarm.start_server(name, "auto")
        swarm.wait_ready([name])
        counts, capacities, stage = _choice(swarm, name)
        chosen.append(stage)
        if 0 in counts:
            assert stage == counts.index(0)  # an empty stage first
        else:
            assert capacities[stage] == min(capacities)
    assert chosen[:2] == [0, 1]  # one each, then the weaker stage gets the third
    swarm.start_trainer("trainer", "--max-samples", "256", "--in-flight", "2")
    assert swarm.wait_exit("trainer", 120) == 0, swarm.processes["trainer"].log_text()[-3000:]
