"""Per-stage accounting of micro-batches from ledgers (what the fault test and the demo rely on)."""

import pytest

from swarmtrain.runtime.harness.accounting import account_stage

pytestmark = pytest.mark.unit


def _acc(*mbs):
    return [{"e": "acc", "mb": mb, "n": 8} for mb in mbs]


def test_survivor_dead_and_pending_add_up():
    ledgers = {
        "a": [
            {"e": "start", "peer": "PA"},
            *_acc("m1", "m2", "m5", "m6"),
            {"e": "step", "step": 0, "mbs": ["m1", "m2"], "group": {"PA": 16, "PB": 8}},
        ],
        "b": [
            {"e": "start", "peer": "PB"},
            *_acc("m3", "m4"),
            {"e": "step", "step": 0, "mbs": ["m3"], "group": {"PA": 16, "PB": 8}},
        ],
    }
    account = account_stage(0, ledgers, dead={"b"}, completed={"m1", "m2", "m3", "m4", "m5", "m6"})
    assert account.applied == {"m1", "m2", "m3"}  # m3: the dead peer's share of a round the survivor finished
    assert account.pending == {"m5", "m6"}
    assert account.lost_with_dead == {"m4"} and account.samples_lost_with_dead == 8
    assert account.balanced


def test_a_retried_micro_batch_is_not_lost_twice_and_doubles_are_reported():
    ledgers = {
        "a": [{"e": "start", "peer": "PA"}, *_acc("m1", "m2")],
        "b": [{"e": "start", "peer": "PB"}, *_acc("m2")],  # died after accumulating m2; retried on a
    }
    account = account_stage(0, ledgers, dead={"b"}, completed={"m1", "m2"})
    assert account.lost_with_dead == set() and account.pending == {"m1", "m2"} and account.balanced
    doubled = {"a": [{"e": "start", "peer": "PA"}, *_acc("m1", "m1")]}
    assert account_stage(0, doubled, dead=set(), completed={"m1"}).double_applied == ["m1"]


def test_completed_work_missing_from_every_ledger_is_unaccounted():
    account = account_stage(1, {"s": [{"e": "start", "peer": "P"}, *_acc("m1")]}, set(), {"m1", "m2"})
    assert account.unaccounted == {"m2"} and not account.balanced


def test_work_dropped_by_a_resync_counts_where_a_retry_applied_it():
    ledgers = {
        "a": [
            {"e": "start", "peer": "PA"},
            *_acc("m1", "m2", "m3"),
            {"e": "step", "step": 0, "mbs": ["m1", "m2"], "group": {"PA": 16}},
        ],
        # b hung with m2 (retried on a) and m4 accumulated, woke up behind and resynced: both dropped
        "b": [{"e": "start", "peer": "PB"}, *_acc("m2", "m4"), {"e": "lost", "mbs": ["m2", "m4"], "n": 16}],
    }
    account = account_stage(0, ledgers, dead=set(), completed={"m1", "m2", "m3", "m4"})
    assert account.applied == {"m1", "m2"} and account.pending == {"m3"}
    assert account.lost_to_resync == {"m4"}
    assert account.balanced


def test_a_retry_that_did_not_accumulate_is_counted_once():
    ledgers = {
        # b went silent: m2 expired in its queue, m3 it accumulated and then dropped in a resync
        "a": [{"e": "start", "peer": "PA"}, *_acc("m1"), {"e": "noacc", "mb": "m2", "n": 8}],
        "b": [
            {"e": "start", "peer": "PB"},
            *_acc("m3"),
            {"e": "lost", "mbs": ["m3"], "n": 8},
        ],
    }
    ledgers["a"].append({"e": "noacc", "mb": "m3", "n": 8})
    account = account_stage(0, ledgers, dead=set(), completed={"m1", "m2", "m3"})
    assert account.pending == {"m1"} and account.not_accumulated == {"m2"}
    assert account.lost_to_resync == {"m3"} and account.balanced


def test_steps_of_replicas_that_all_died_count_where_a_survivor_downloaded_them():
    """A chaos run counted 606 micro-batches "lost with dead peers" where 37 were: the steps the dead
    replicas applied lived on in the state a fresh replica downloaded."""
    ledgers = {
        "a": [
            {"e": "start", "peer": "PA"},
            *_acc("m1", "m2"),
            {"e": "step", "step": 0, "mbs": ["m1", "m2"], "group": {"PA": 16}},
            *_acc("m3"),
        ],
        "c": [{"e": "start", "peer": "PC"}, {"e": "resync", "epoch": 1, "reason": "joining"}, *_acc("m4")],
    }
    account = account_stage(0, ledgers, dead={"a"}, completed={"m1", "m2", "m3", "m4"})
    assert account.applied == {"m1", "m2"} and account.lost_with_dead == {"m3"}
    assert account.pending == {"m4"} and account.balanced


def test_steps_of_stopped_replicas_count_as_applied_when_a_survivor_restored_past_them():
    """A whole-swarm restart: the first incarnation applied steps 0 and 1 and was stopped; the new one
    restored the checkpoint of step 2 (it holds both); a checkpoint of step 1 would hold step 0 only."""
    old = [
        {"e": "start", "peer": "P1"},
        *_acc("m1", "m2"),
        {"e": "step", "step": 0, "mbs": ["m1"], "group": {"P1": 8}},
        {"e": "step", "step": 1, "mbs": ["m2"], "group": {"P1": 8}},
    ]
    for state_step, applied in ((2, {"m1", "m2"}), (1, {"m1"})):
        new = [
            {"e": "start", "peer": "P2"},
            {"e": "restore", "source": "checkpoint", "state_step": state_step},
        ]
        account = account_stage(0, {"old": old, "new": new}, dead={"old"}, completed={"m1", "m2"})
        assert account.applied == applied and account.balanced
