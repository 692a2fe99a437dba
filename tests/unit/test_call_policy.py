"""The trainer's call policy as a whole (runtime/trainer/call_policy.py): one set of counters (`CallStats`)
that the retry loop, the relayed calls and the chains all count into, under the names the trainer's
summary gives them; and trainer modules that import each other in one direction only."""

import asyncio
import dataclasses

import grimp
import pytest
import torch
from test_stage_calls import A, B, C, ScriptedClient, SpyTable, _caller, _chain_reply

from swarmtrain.net import codec
from swarmtrain.net.protocol import Message
from swarmtrain.net.transport import RemoteError
from swarmtrain.runtime.trainer import call_policy
from swarmtrain.runtime.trainer.call_policy import CallStats
from swarmtrain.runtime.trainer.chain_calls import ChainCaller

pytestmark = pytest.mark.unit

# the summary's keys (tests/faults, tests/integration and bench/ read them by these names)
SUMMARY_NAMES = {
    "retries": "retries",
    "timeouts": "timeouts",
    "connection_errors": "connection_errors",
    "not_accumulated": "retries_not_accumulated",
    "frozen": "frozen_peers",
    "hedges": "hedges",
    "hedges_won": "hedges_won",
}


def _reply(peer, message):
    """A chain's reply to a chain, an accumulated one to anything else."""
    return _chain_reply(peer, message) if message.kind == "chain" else Message("result", {"acc": 8})


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(call_policy, "BACKOFF_MAX_S", 0.0)


def test_call_stats_start_at_zero_and_summarize_under_the_summarys_names():
    fields = [f.name for f in dataclasses.fields(CallStats)]
    assert fields == list(SUMMARY_NAMES) and CallStats().summary() == dict.fromkeys(SUMMARY_NAMES.values(), 0)
    stats = CallStats(**{name: i + 1 for i, name in enumerate(fields)})
    assert stats.summary() == {SUMMARY_NAMES[name]: i + 1 for i, name in enumerate(fields)}


def test_relayed_calls_and_chains_count_into_one_call_stats():
    table = SpyTable([[A, B], [C]])
    client = ScriptedClient(
        TimeoutError(), ConnectionResetError("gone"), RemoteError("unavailable", "busy"), reply=_reply
    )
    caller = _caller(client, table, max_retries=5)
    chains = ChainCaller(caller, num_stages=2, digest="d", codec="none")
    assert chains.stats is caller.stats and chains.peers is caller.peers and chains.hedger is caller.hedger
    # a relayed backward: A times out (retried without accumulating), B is gone (banned), A answers
    asyncio.run(caller.call_peer(0, "backward", "t.0-1", 8, {}, 1.0, prefer=A, step=0))
    # a chain: refused before any work, then answered
    tokens = codec.encode(torch.zeros(2, 4, dtype=torch.int64), "none")
    table.unban(0, B)
    asyncio.run(chains.run("t.0-2", 0, 8, tokens, tokens))
    assert caller.stats == CallStats(retries=3, timeouts=1, connection_errors=1, not_accumulated=1)


def test_trainer_modules_import_each_other_in_one_direction_only():
    """No import cycle among runtime/trainer's modules, imports under `if TYPE_CHECKING` included."""
    graph = grimp.build_graph("swarmtrain", exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(m for m in graph.modules if m.startswith("swarmtrain.runtime.trainer."))
    cycles = [
        (a, b)
        for a in modules
        for b in modules
        if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a)
    ]
    assert cycles == []
