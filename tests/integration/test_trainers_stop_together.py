"""Several trainer shards on a time limit stop at the same step (planner/stop_step.py), so the run's last
step is a whole global batch. Before, each stopped when its own time was up: the shard that started
later trained on alone, and each of its last steps waited out the close timeout and was applied short.
One trainer sends its chains over stage 0's data plane (the default), the other with `--no-data-plane`
over libp2p: stage 0 serves both ways at once."""

import json
import time

import pytest

from swarm_fixtures import start_servers
from swarmtrain.runtime.ledger import read_ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

DURATION_S = 10.0
STAGGER_S = 3.0  # the second trainer starts this much later, as a user starting them one by one would


def test_trainers_on_a_time_limit_agree_on_their_last_step(make_swarm):
    swarm, cfg = make_swarm("tiny")
    servers = {"s0": 0, "s1": 1}
    start_servers(swarm, servers)
    for k, transport in enumerate(([], ["--no-data-plane"])):
        swarm.start_trainer(f"trainer{k}", "--shard", f"{k}/2", "--duration-s", str(DURATION_S), *transport)
        time.sleep(STAGGER_S * (k == 0))
    for k in range(2):
        code = swarm.wait_exit(f"trainer{k}", 120)
        assert code == 0, swarm.processes[f"trainer{k}"].log_text()[-3000:]

    last_closed, completed = [], []
    for k in range(2):
        closes = [e["step"] for e in read_ledger(swarm.ledger_path(f"trainer{k}")) if e["e"] == "close"]
        last_closed.append(max(closes))
        summary = json.loads(swarm.summary_path(f"trainer{k}").read_text())
        assert summary["microbatches_failed"] == 0, summary
        completed.append((summary["microbatches_completed"], summary["retries"]))
    print(f"last step closed by each trainer: {last_closed}")
    assert last_closed[0] == last_closed[1]

    batch = cfg.training.global_batch_size
    for name in servers:
        steps = [e for e in read_ledger(swarm.ledger_path(name)) if e["e"] == "step"]
        short = [(e["step"], sum(e["group"].values())) for e in steps if sum(e["group"].values()) != batch]
        print(f"{name}: {len(steps)} steps, short ones: {short}")
        assert steps and steps[-1]["step"] == last_closed[0], (name, steps[-1])
        assert not short, (name, short)
        assert "trainers closed it" not in swarm.processes[name].log_text()
    probe = make_swarm.probe(cfg, swarm)
    probe.wait_for_peers([1, 1])
    (stage_0,) = probe.peers(0)
    # the first trainer's chains (and their retries, if any) came over the data plane, the second's did not
    (done, retried), _ = completed
    assert done <= probe.info(stage_0).header["direct_in"] <= done + retried, completed
