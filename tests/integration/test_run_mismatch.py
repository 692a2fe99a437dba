"""A trainer whose run settings match no server of a stage (here `--compression 4bit` against servers
whose run file says 8-bit: a codec below 8 bits is part of the run digest) stops within a minute with a
one-line error naming the setting that differs and exit code 2, instead of waiting for a peer for ever.
Every process is stopped at teardown (the `make_swarm` fixture), also when the test fails."""

import time

import pytest

from swarm_fixtures import start_servers
from swarmtrain.runtime.trainer.peer_table import MISMATCH_GRACE_PERIODS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.timed]

EXIT_WITHIN_S = 60.0


# the trainer's grace is MISMATCH_GRACE_PERIODS announce periods, all of it a wait: at half the tests'
# period (records re-announced every 0.5 s, alive 3 periods) the same check takes 5 s instead of 10 s
ANNOUNCE_PERIOD_S = 0.5


def test_a_trainer_with_other_settings_than_the_servers_exits_2_naming_them(make_swarm):
    swarm, cfg = make_swarm("tiny", {"swarm": {"announce_period_s": ANNOUNCE_PERIOD_S}})
    assert cfg.swarm.compression == "8bit"
    start_servers(swarm, {"s0": 0, "s1": 1})
    started_s = time.monotonic()
    trainer = swarm.start_trainer("trainer", "--compression", "4bit", "--max-samples", "64")
    code = swarm.wait_exit("trainer", EXIT_WITHIN_S + 30)
    took_s = time.monotonic() - started_s
    log = trainer.log_text()
    assert code == 2, f"exit code {code} after {took_s:.0f} s:\n{log[-3000:]}"
    # the grace is announce periods: 5 s at this test's 0.5 s period (20 s at the default 2 s)
    assert MISMATCH_GRACE_PERIODS * cfg.swarm.announce_period_s <= took_s < EXIT_WITHIN_S, took_s
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith("swarmtrain trainer: error: ") and "stage 0" in errors[0]
    assert "swarm.compression: this run 4bit, the servers 8bit" in errors[0], errors[0]
    print(f"after {took_s:.0f} s: {errors[0]}")
    assert "Traceback" not in log
    assert all(swarm.processes[name].alive for name in ("s0", "s1"))  # the servers serve on
