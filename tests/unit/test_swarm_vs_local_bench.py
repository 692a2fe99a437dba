"""bench/swarm_vs_local.py's byte accounting from fake results: every process's sent bytes, each
message counted once by its sender (the trainer's requests, each server's requests and replies)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))  # it imports codec_throughput from its folder
    try:
        spec = importlib.util.spec_from_file_location("bench_swarm_vs_local", BENCH / "swarm_vs_local.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


SWARM = {
    "transport": {
        "per_stage": {
            "0": {
                "chain_out_wire_bytes": 100,
                "chain_out_fp32_bytes": 400,
                "chain_back_wire_bytes": 50,  # received: the server counted it when it replied
                "chain_back_fp32_bytes": 60,
            },
            "1": {"close_out_wire_bytes": 10, "close_out_fp32_bytes": 10},
        }
    },
    "servers_sent": {"stage0": {"wire": 300, "fp32": 1200}, "stage1": {"wire": 200, "fp32": 800}},
}


def test_every_sender_counts_once_and_received_bytes_are_not_counted_again():
    assert _bench().sent_bytes(SWARM) == (100 + 10 + 300 + 200, 400 + 10 + 1200 + 800)


def test_the_table_has_the_trainer_s_requests_then_each_server():
    rows = _bench().bytes_table(SWARM, samples=10)
    assert rows == [
        ("trainer to stage 0, chain", 10.0, 40.0),
        ("trainer to stage 1, close", 1.0, 1.0),
        ("server stage0, all it sent", 30.0, 120.0),
        ("server stage1, all it sent", 20.0, 80.0),
    ]
