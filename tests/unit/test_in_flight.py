"""A trainer's micro-batches in flight by default (planner/in_flight.py): four per stage of the run, at
least four, used by `swarmtrain trainer` and `swarmtrain demo` unless --in-flight says otherwise."""

import io
import types

import pytest

from swarmtrain.cli.main import build_parser
from swarmtrain.planner.in_flight import default_in_flight
from swarmtrain.runtime.harness import demo
from swarmtrain.runtime.harness.demo import DemoOptions

pytestmark = pytest.mark.unit

PEER = "/ip4/127.0.0.1/tcp/1/p2p/X"


def test_four_per_stage_and_never_fewer_than_four():
    assert [default_in_flight(n) for n in (1, 2, 4, 8)] == [4, 8, 16, 32]


def test_the_commands_leave_it_to_the_rule_unless_told():
    parser = build_parser()
    trainer = ["trainer", "--preset", "gpt2-small", "--initial-peers", PEER]
    assert parser.parse_args(trainer).in_flight is None
    assert parser.parse_args([*trainer, "--in-flight", "3"]).in_flight == 3
    assert parser.parse_args(["demo"]).in_flight is None
    with pytest.raises(SystemExit):
        parser.parse_args([*trainer, "--in-flight", "0"])


class _FinishedSwarm:
    """Records what the demo starts its trainer with; the trainer has already finished."""

    def __init__(self):
        self.args: tuple[str, ...] = ()
        finished = types.SimpleNamespace(alive=False, proc=types.SimpleNamespace(returncode=0))
        self.processes = {"trainer": finished}

    def start_trainer(self, name, *args):
        self.args = args


@pytest.mark.parametrize("given, passed", [(None, None), (6, "6")])
def test_the_demo_passes_in_flight_to_its_trainer_only_when_given(given, passed):
    swarm = _FinishedSwarm()
    assert demo._train(swarm, None, [], DemoOptions(in_flight=given), [], io.StringIO())
    args = list(swarm.args)
    assert (args[args.index("--in-flight") + 1] if "--in-flight" in args else None) == passed
