"""Request batching in the simulator (`SimConfig.max_batch_samples`) and its per-call cost
(`SimConfig.call_overhead_s`): what batching saves, that it saves no compute without a per-call cost,
that defaults are unchanged bit for bit, and that a peer failing mid-call loses none of a batch."""

import json
from dataclasses import replace

import pytest
from test_sim_cli import run_cli

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.churn import ChurnEvent, ChurnSchedule, churn_schedule
from swarmtrain.sim.costs import compute_s_per_sample, rate_table
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.fleet import synthetic_fleet
from swarmtrain.sim.optimal import optimal_allocation
from swarmtrain.sim.runner import build, costs_for, run_simulation

pytestmark = pytest.mark.unit

TINY = get_preset("tiny")  # 2 stages
COMPUTE_S_PER_SAMPLE = 1e-3  # forward + backward at each stage
CHUNK = 8  # samples per micro-batch: 8 ms of forward + backward per stage and chunk
OVERHEAD_S = 0.008  # a per-call cost as large as a chunk's compute at a stage


def peer(name: str, stage: int) -> PeerSpec:
    spec = PeerSpec.from_device(name, DEVICE_TYPES["cpu"], 0)
    return replace(
        spec,
        uplink_bytes_per_s=1e9,  # links far from the limit: compute and per-call cost decide
        downlink_bytes_per_s=1e9,
        compute_s_per_sample=(COMPUTE_S_PER_SAMPLE, COMPUTE_S_PER_SAMPLE),
        stage=stage,
        home_stage=stage,
    )


FLEET = Fleet(tuple(peer(f"s{s}-{k}", s) for s in (0, 1) for k in range(2)), single_location(latency_s=0.001))


def config(**kw) -> SimConfig:
    """Two peers per stage, three trainers with four micro-batches each in flight: queues form."""
    base = dict(
        mode="swarm-no-rebalance",
        duration_s=60.0,
        chunk_samples=CHUNK,
        in_flight=12,
        num_trainers=3,
        audit=True,
    )
    return SimConfig(**{**base, **kw})


def simulate(schedule=None, **kw) -> dict:
    return run_simulation(FLEET, TINY, config(**kw), schedule).summary


def batching(**kw) -> dict:
    return simulate(max_batch_samples=4 * CHUNK, **kw)


def test_without_a_per_call_cost_batching_saves_nothing():
    off, on = simulate(), batching()
    assert on["batched_calls"] > 1000  # queues formed and calls took several micro-batches
    # Batching moves no compute: both stages stay busy all the time, at the same rate. Not to the
    # sample: a batch's first parts come out when the whole call ends, so calls still running at the
    # end leave up to one chunk per peer unfinished. (Where the micro-batches in flight do not cover
    # that extra wait, it costs throughput: see `SimConfig.max_batch_samples`.)
    assert on["stage_utilization"] == pytest.approx(off["stage_utilization"], abs=1e-3)
    assert off["samples_per_s"] == pytest.approx(2 / COMPUTE_S_PER_SAMPLE, rel=1e-3)
    assert on["samples_per_s"] == pytest.approx(off["samples_per_s"], rel=1e-3)
    assert abs(on["samples"] - off["samples"]) <= len(FLEET.peers) * CHUNK
    assert on["audit"]["violations"] == 0 and on["timeouts"] == 0


def test_with_a_per_call_cost_batching_serves_more():
    free = simulate()["samples_per_s"]
    off = simulate(call_overhead_s=OVERHEAD_S)
    on = batching(call_overhead_s=OVERHEAD_S)
    # without batching stage 0 makes two calls per chunk (forward, backward): 2 peers x 8 samples per
    # 8 ms of compute + 2 calls of 8 ms
    assert off["samples_per_s"] == pytest.approx(
        2 * CHUNK / (CHUNK * COMPUTE_S_PER_SAMPLE + 2 * OVERHEAD_S), rel=0.01
    )
    assert off["samples_per_s"] < free
    assert on["samples_per_s"] > 1.2 * off["samples_per_s"]
    assert on["batched_chunks"] > 2 * on["batched_calls"] > 0  # more than two chunks a call on average
    assert on["stage_utilization"][0] == pytest.approx(1.0, abs=0.01)  # the per-call cost counts as busy
    assert on["audit"]["violations"] == 0 and on["timeouts"] == 0
    assert on["samples"] == on["audit"]["chunks"] * CHUNK


# Recorded before batching existed (same fleets and configs, unmodified simulator): the event digest
# covers every event's time and handler, so the default path is unchanged bit for bit. Recorded again
# (2026-11-29) when stage 0's token ids went from int64 to int16 on the wire (sim/costs.py `token_bytes`),
# which moves the transfer events; the digests then matched with batching off as well. Recorded again
# (2026-11-29, twenty-eighth session) when ids and labels went packed (8 bits for `tiny`'s 256 tokens,
# 16 for gpt3-xl's 50,257 instead of int32: the churn run's samples/s went from 20.64 to 21.28).
DIGEST_BEFORE = "bbbf6930c6423d20907a41e7fc9a8659e3cb50d041fba7c3d650d2d6451ab13c"
DIGEST_BEFORE_CHURN = "f94df95f9e746acafd669014e808f81368dd151d8473dda72c42748262f377f4"


def test_defaults_give_the_results_recorded_before_batching_existed():
    default = run_simulation(FLEET, TINY, config(record_events=True), None).summary
    explicit = simulate(record_events=True, call_overhead_s=0.0, max_batch_samples=0)
    assert default["event_digest"] == explicit["event_digest"] == DIGEST_BEFORE
    assert default["samples_per_s"] == 1999.4666666666667
    assert "batched_calls" not in default  # the summary keeps its keys
    fleet = synthetic_fleet(24, seed=3)
    churn = churn_schedule("exponential", fleet, 600.0, 1)
    swarm = SimConfig(duration_s=600.0, seed=1, chunk_samples=32, record_events=True, num_samples=10)
    summary = run_simulation(fleet, get_preset("gpt3-xl"), swarm, churn, global_batch_size=16384).summary
    assert summary["event_digest"] == DIGEST_BEFORE_CHURN
    assert summary["samples_per_s"] == 21.28 and summary["failures"] == 4


def _built(schedule: ChurnSchedule, **kw):
    """The simulation object (not just its result), so a test can watch its calls."""
    costs = costs_for(TINY)
    compute = [compute_s_per_sample(p, costs) for p in FLEET.peers]
    table = rate_table(list(FLEET.peers), compute)
    live = list(range(FLEET.num_peers))
    optimum = optimal_allocation(table, costs, live).throughput_samples_per_s
    return build(FLEET, costs, config(**kw), schedule, compute, table, live, optimum, TINY)


def _watched(schedule: ChurnSchedule):
    """A batching run recording its batched calls (start, peer, parts) and each finished chunk."""
    sim = _built(schedule, call_overhead_s=OVERHEAD_S, max_batch_samples=4 * CHUNK)
    calls, finished = [], []
    start_call, chunk_done = sim._start_call, sim.on_chunk_done

    def record_call(peer, parts):
        calls.append((sim.engine.now_s, peer.index, list(parts)))
        start_call(peer, parts)

    def record_done(chunk):
        finished.append((sim.engine.now_s, chunk))
        chunk_done(chunk)

    sim._start_call, sim.on_chunk_done = record_call, record_done
    return sim, calls, finished


def test_a_peer_failing_mid_call_loses_none_of_its_batch():
    victim = FLEET.index_of()["s0-0"]
    sim, calls, _ = _watched(ChurnSchedule(()))
    sim.run()
    start_s, _, parts = next(c for c in calls if c[0] > 20.0 and c[1] == victim and len(c[2]) >= 3)
    fail_s = start_s + 0.001  # every call takes its 8 ms per-call cost at least: still running then
    churn = ChurnSchedule((ChurnEvent(fail_s, victim, "fail"),))
    sim, calls, finished = _watched(churn)
    summary = sim.run().summary
    # the run is the same up to the failure: the peer is in the middle of that call when it fails
    last_start, _, batch = [c for c in calls if c[1] == victim and c[0] <= fail_s][-1]
    assert last_start == start_s and len(batch) == len(parts) >= 3
    assert summary["failures"] == 1 and summary["reroutes"] >= len(batch)
    audit = sim.audit()
    assert audit["violations"] == 0  # no part finished twice, none skipped a stage
    assert summary["samples"] == audit["chunks"] * CHUNK
    # every micro-batch in flight, the failed call's parts too, keeps finishing after the retry
    after = {id(chunk) for t, chunk in finished if t > fail_s + sim.config.fail_detect_s + 1.0}
    assert len(after) == sim.in_flight == 12
    assert all(id(chunk) in after for chunk in batch)


def test_the_deadline_check_knows_which_chunks_will_share_a_call():
    """At arrival a chunk is charged the per-call cost only if it opens a call (`_joins_call`), so the
    backlog a deadline is checked against ends exactly when the peer's last accepted call does."""
    sim = _built(ChurnSchedule(()), call_overhead_s=OVERHEAD_S, max_batch_samples=4 * CHUNK, compute_cv=0.5)
    gaps_s = []
    start_compute, start_call = sim._start_compute, sim._start_call

    def check(peer, end_s):
        if not peer.queue:  # the call just started is the last one accepted
            gaps_s.append(abs(peer.backlog_until_s - end_s))

    def watch_compute(peer, chunk):
        start_compute(peer, chunk)
        check(peer, sim.engine.now_s + sim.call_overhead_s + sim._duration(peer, chunk))

    def watch_call(peer, parts):
        start_call(peer, parts)
        check(peer, sim.engine.now_s + sim.call_overhead_s + sum(sim._duration(peer, c) for c in parts))

    sim._start_compute, sim._start_call = watch_compute, watch_call
    sim.run()
    assert len(gaps_s) > 1000 and max(gaps_s) < 1e-9


def test_negative_settings_are_refused():
    with pytest.raises(ValueError, match="call_overhead_s"):
        SimConfig(call_overhead_s=-0.001)
    with pytest.raises(ValueError, match="call_overhead_s"):
        SimConfig(call_overhead_s=float("nan"))
    with pytest.raises(ValueError, match="max_batch_samples"):
        SimConfig(max_batch_samples=-1)


def test_cli_flags_reach_the_simulation(tmp_path, capsys):
    path = tmp_path / "s.json"
    quick = ["--num-peers", "8", "--duration-s", "60", "--chunk-samples", "32", "--summary-json", str(path)]
    code, _, err = run_cli(capsys, *quick, "--call-overhead-s", "0.05", "--max-batch-samples", "128")
    assert code == 0, err
    summary = json.loads(path.read_text())
    assert summary["batched_calls"] > 0 and summary["batched_chunks"] > summary["batched_calls"]
    for argv, message in (
        (["--call-overhead-s", "-1"], "--call-overhead-s"),
        (["--max-batch-samples", "1.5"], "--max-batch-samples"),
        (["--call-overhead-s", "0.01", "--choose-mode"], "per-call cost"),
    ):
        code, _, err = run_cli(capsys, *quick, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
