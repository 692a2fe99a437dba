"""A server that stops gracefully leaves the trainers' view at once: its offline record replaces its online
one. The DHT replaces a record only by one that expires later, so an offline record with a shorter life
than the online one was refused, and trainers kept routing to the stopped server until its online record
expired (3 announce periods; the same rule hid a server that had moved stage, see test_rebalance_live)."""

import time

import pytest

from swarm_fixtures import start_servers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.timed]

ANNOUNCE_PERIOD_S = 20.0  # an online record lives 60 s


def test_a_stopped_server_leaves_the_trainers_view_at_once(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"announce_period_s": ANNOUNCE_PERIOD_S}})
    start_servers(swarm, {"s0a": 0, "s0b": 0, "s1": 1})
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([2, 1])
    swarm.processes["s0b"].stop(grace_s=30)
    stopped_at = time.monotonic()
    while True:
        probe.run(probe.trainer.caller.refresh())
        if probe.trainer.table.peers_per_stage() == [1, 1]:
            break
        assert time.monotonic() - stopped_at < ANNOUNCE_PERIOD_S / 2, probe.trainer.table.peers_per_stage()
        time.sleep(0.3)
    print(f"gone from the view {time.monotonic() - stopped_at:.1f} s after the server stopped")
