"""Live adaptive rebalancing: 3 servers on stage 0 and 1 on stage 1 (the bottleneck: it holds 7 of the
model's 8 layers) with a trainer running. A stage-0 server moves to stage 1 (the policy is
deterministic, so the servers agree on who, and a lease allows one move at a time), logs and publishes
what the move cost, joins stage 1 by downloading its state in the same process and with the same peer
id, and after the next step holds the same parameters as stage 1's other server. Nobody moves back and
stage 0 is never emptied."""

import json
import time

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

MOVING = "rebalancing: moving from stage 0 to stage 1"


def test_a_server_moves_to_the_bottleneck_stage(make_swarm):
    # stage 1 holds 5 of 6 layers: with `tiny`'s even cut, stage 0 (embedding, two calls per micro-batch)
    # costs a server more per sample than stage 1, so 3+1 was not imbalanced and the test passed only
    # while idle servers' overhead and uneven routing made stage 0's capacity read high
    # 7 of 8 layers (was 5 of 6): on 2 shared cores the servers' own figures once read 3+1 with 5 layers
    # as 963 vs 718 samples per CPU second, inside the hysteresis margin, and nobody moved (CI)
    overrides = {
        "model": {"num_layers": 8},
        "swarm": {"rebalance_period_s": 2.0, "layers_per_stage": [1, 7]},
        "training": {"max_samples": 100000},
    }
    swarm, cfg = make_swarm("tiny", overrides)
    swarm.start_dht()
    servers = {"a": 0, "b": 0, "c": 0, "d": 1}
    for name, stage in servers.items():
        swarm.start_server(name, stage)
    swarm.wait_ready(list(servers))
    swarm.start_trainer("trainer", "--max-samples", "100000", "--in-flight", "4", "--log-period-s", "2")

    deadline = time.monotonic() + 120
    while not (movers := [n for n in "abc" if MOVING in swarm.processes[n].log_text()]):
        assert time.monotonic() < deadline, {n: swarm.processes[n].log_text()[-1500:] for n in servers}
        time.sleep(0.5)
    mover = movers[0]
    while "rebalancing: moved here" not in swarm.processes[mover].log_text():
        assert time.monotonic() < deadline and swarm.processes[mover].alive, swarm.processes[
            mover
        ].log_text()[-3000:]
        time.sleep(0.5)
    log = swarm.processes[mover].log_text()
    cost = json.loads(log.split("rebalancing: moved here ")[1].splitlines()[0])
    assert cost["from"] == 0 and cost["to"] == 1 and cost["seconds"] > 0
    # the servers may move on their start-up figures before the trainer's first step: then stage 1 has
    # nothing to download yet (a fresh start at step 0 is right), otherwise the move downloaded its state
    assert cost["bytes"] > 0 or "stage 1 starts at step 0 from fresh" in log, log[-3000:]

    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 2], timeout_s=60)
    # the move happened in the process, on its DHT node: the peer id that served stage 0 serves stage 1
    ready = swarm.ledger_events(mover, "ready")
    assert [r["stage"] for r in ready] == [0, 1] and ready[0]["peer"] == ready[1]["peer"], ready
    assert ready[0]["peer"] in probe.peers(1)
    time.sleep(8)  # several more rebalancing periods
    # announced capacities are noisy on 2 shared cores (two stage-0 servers read 244 and 652 samples/s
    # in one run), so a second server may follow while 2+2 still reads as stage 1 short; what the
    # policy guarantees: no move back, stage 0 never emptied
    movers = [n for n in "abc" if MOVING in swarm.processes[n].log_text()]
    assert mover in movers and len(movers) < 3, movers
    back = MOVING.replace("0 to stage 1", "1 to stage 0")
    assert not any(back in swarm.processes[n].log_text() for n in servers)
    # the mover drained: no trainer request waited out its timeout on a server that had left stage 0 (one
    # that stopped with requests unanswered stalled the swarm for 30 s); and trainers routed to it at
    # stage 1 within the sleep above (an intent record that outlived its online records hid it for 30 s)
    assert "failed (timeout" not in swarm.processes["trainer"].log_text()
    served = probe.info(ready[1]["peer"]).header["counters"]["samples_forward"]
    assert served > 0, (
        swarm.processes[mover].log_text()[-4000:],
        swarm.processes["trainer"].log_text()[-3000:],
    )
    # its stage peers reach it once it serves stage 1: the next stage's averager process once deleted the
    # socket through which the moved server received streams, and every gradient exchange with it failed
    # from then on (its stage-0 peers may miss it once while it leaves: its handlers are gone)
    joined_at = time.strftime("%H:%M:%S", time.localtime(ready[1]["t"]))  # as log lines are stamped
    unreachable = f"stage peer {ready[1]['peer'][-8:]} unreachable"
    late = [
        line
        for n in servers
        for line in swarm.processes[n].log_text().splitlines()
        if unreachable in line and line.split()[0] > joined_at
    ]
    assert not late, late

    swarm.processes["trainer"].kill()  # a quiet stage: compare the stage-1 replicas at one step
    time.sleep(5)
    # a second mover may still be downloading stage 1's state; the probe's view of the DHT is refreshed
    # only by wait_for_peers (a stale view once missed a mover that had joined during the sleep above)
    movers = [n for n in "abc" if MOVING in swarm.processes[n].log_text()]
    deadline = time.monotonic() + 60
    while not all("rebalancing: moved here" in swarm.processes[n].log_text() for n in movers):
        assert time.monotonic() < deadline, {n: swarm.processes[n].log_text()[-1500:] for n in movers}
        time.sleep(0.5)
    probe.wait_for_peers([3 - len(movers), 1 + len(movers)], timeout_s=60)
    infos = [probe.info(peer, want="params") for peer in probe.peers(1)]
    assert len(infos) == 1 + len(movers) and infos[0].header["epoch"] > 0
    for other in infos[1:]:
        assert other.header["epoch"] == infos[0].header["epoch"]
        for name in infos[0].tensors:
            torch.testing.assert_close(
                infos[0].tensor(name), other.tensor(name), rtol=1e-5, atol=1e-6, msg=name
            )
