"""The simulator's runtime data path (bench/replicas_vs_swarm.py): a trainer that relays every boundary
tensor over its own limited link, synchronous steps (a stage's forwards of step s wait for step s - 1), and
replicas whose all-reduce sends a given number of bytes per parameter. The defaults (peer-to-peer, unlimited
trainer, delayed updates, fp16 averaging) must stay as they were."""

from dataclasses import replace

import pytest

from swarmtrain.config import get_preset
from swarmtrain.sim.base import SimConfig
from swarmtrain.sim.entities import DEVICE_TYPES, Fleet, PeerSpec, single_location
from swarmtrain.sim.runner import costs_for, run_simulation

pytestmark = pytest.mark.unit

TINY = get_preset("tiny")  # 2 stages; 8-bit activations of 64 x 64 per sample, int16 tokens (128 B)
LINK = 1e6  # bytes/s each way: every run below is link-bound (compute is 10 us per sample)


def peer(name, stage=None, link=LINK, compute=1e-5):
    spec = PeerSpec.from_device(name, DEVICE_TYPES["cpu"], 0)
    return replace(
        spec,
        uplink_bytes_per_s=link,
        downlink_bytes_per_s=link,
        compute_s_per_sample=(compute, compute),
        stage=stage,
        home_stage=stage,
    )


def swarm(
    compute=1e-5, link=LINK, latency_s=0.001, replicas=1, run_cfg=TINY, duration_s=60.0, in_flight=4, **kw
):
    """`replicas` peers on each of tiny's two stages, one trainer."""
    peers = tuple(peer(f"s{s}-{k}", s, link, compute) for s in (0, 1) for k in range(replicas))
    fleet = Fleet(peers, single_location(latency_s=latency_s))
    config = SimConfig(
        mode="swarm-no-rebalance",
        duration_s=duration_s,
        chunk_samples=8,
        in_flight=in_flight,
        num_trainers=1,
        audit=True,
        **kw,
    )
    return run_simulation(fleet, run_cfg, config).summary


def test_defaults_are_the_peer_to_peer_model():
    config = SimConfig()
    assert not config.relay_via_trainer
    assert config.trainer_link_bytes_per_s == float("inf")
    assert config.replica_averaging_bytes_per_param == 2.0
    assert config.max_staleness is None
    with pytest.raises(ValueError):
        SimConfig(trainer_link_bytes_per_s=0)


def test_peer_to_peer_swarm_is_bound_by_the_busiest_stage_link():
    costs = costs_for(TINY)
    busiest = max(max(costs.up_bytes_per_sample(s), costs.down_bytes_per_sample(s)) for s in range(2))
    summary = swarm()
    assert summary["samples_per_s"] == pytest.approx(LINK / busiest, rel=0.1)
    assert summary["audit"]["violations"] == 0


def test_a_relaying_trainer_on_a_limited_link_carries_every_boundary_tensor():
    costs = costs_for(TINY)
    act, tokens = costs.activation_bytes_per_sample, costs.token_bytes_per_sample
    # the trainer sends: tokens to stage 0; activations + labels to stage 1; tokens + gradient to stage 0
    trainer_up = tokens + (act + tokens) + (tokens + act)
    summary = swarm(relay_via_trainer=True, trainer_link_bytes_per_s=LINK)
    assert summary["samples_per_s"] == pytest.approx(LINK / trainer_up, rel=0.1)
    assert summary["audit"]["violations"] == 0
    # every byte the trainer and the peers sent: the trainer's, plus each stage's output back to it
    sent = sum(summary["bytes_by_kind"][k] for k in ("tokens", "activations", "gradients"))
    per_sample = trainer_up + 2 * act
    assert sent / summary["samples"] == pytest.approx(per_sample, rel=0.05)


def test_a_relaying_trainer_with_an_unlimited_link_leaves_the_stage_links_as_the_limit():
    costs = costs_for(TINY)
    act, tokens = costs.activation_bytes_per_sample, costs.token_bytes_per_sample
    # stage 0 receives its tokens twice (forward, backward) and the gradient of its output
    busiest = max(2 * tokens + act, act + tokens)
    # three calls one after the other per micro-batch: more in flight than the default keep a link busy
    summary = swarm(relay_via_trainer=True, in_flight=8)
    assert summary["samples_per_s"] == pytest.approx(LINK / busiest, rel=0.1)


def test_replica_averaging_bytes_per_param_sets_the_all_reduce_payload():
    fleet = Fleet((peer("r0"), peer("r1")), single_location())

    def replicas(**kw):
        config = SimConfig(
            mode="async-replicas", duration_s=600.0, average_every_steps=1, local_batch_samples=16, **kw
        )
        return run_simulation(fleet, TINY, config).summary

    fp16, codec = replicas(), replicas(replica_averaging_bytes_per_param=1.0)
    params = costs_for(TINY).model_params
    # averaging dominates (16 samples of compute take 160 us): rounds take payload / link
    assert codec["samples_per_s"] == pytest.approx(2 * fp16["samples_per_s"], rel=0.02)
    assert codec["samples_per_s"] == pytest.approx(2 * 16 * LINK / params, rel=0.02)
    per_sample = {
        k: v["bytes_by_kind"]["averaging"] / v["samples"] for k, v in (("fp16", fp16), ("codec", codec))
    }
    assert per_sample["codec"] == pytest.approx(per_sample["fp16"] / 2, rel=0.05)


def test_synchronous_steps_drain_the_pipeline_every_step():
    """tiny: 4 micro-batches of 8 per step, all in flight, two stages computing c per sample (forward c/3,
    the last stage's fused call c, a backward 2c/3), no link limit or latency. Stage 0 runs the 4 forwards
    (4 x 8c/3), stage 1 the fused calls back to back from the first forward's end (the last ends at 8c/3
    + 4 x 8c = 104c/3), stage 0 the last backward by 104c/3 + 16c/3 = 40c; only then may step s + 1's
    forwards start: 32 samples per 40c. Delayed updates keep both stages busy: 32 samples per 4 x 8c."""
    c = 0.01
    kw = {"compute": c, "link": float("inf"), "latency_s": 0.0}
    synchronous = swarm(max_staleness=0, **kw)
    assert synchronous["samples_per_s"] == pytest.approx(32 / (40 * c), rel=0.03)
    assert synchronous["audit"]["violations"] == 0
    delayed = swarm(**kw)
    assert delayed["samples_per_s"] == pytest.approx(32 / (32 * c), rel=0.03)
    one_behind = swarm(max_staleness=1, **kw)
    assert synchronous["samples_per_s"] < one_behind["samples_per_s"] <= delayed["samples_per_s"] * 1.01


def test_direct_hand_offs_carry_the_labels_to_the_last_stage():
    """As net/hand_off.py sends them: the trainer sends stage 0 the ids and the labels, and each forward
    hop carries the labels on; relayed, the trainer sends them with the last stage's request only."""
    costs = costs_for(TINY)
    act, tokens = costs.activation_bytes_per_sample, costs.token_bytes_per_sample
    assert costs.label_bytes_per_sample == tokens  # int64 per position, like the ids
    summary = swarm()
    per_sample = {k: v / summary["samples"] for k, v in summary["bytes_by_kind"].items()}
    assert per_sample["tokens"] == pytest.approx(2 * tokens, rel=0.02)
    assert per_sample["activations"] == pytest.approx(act + tokens, rel=0.02)
    # the analytic per-stage figures the optimum and the rates use say the same
    assert costs.down_bytes_per_sample(0) == pytest.approx(2 * tokens + act)
    assert costs.up_bytes_per_sample(0) == pytest.approx(act + tokens)
    assert costs.down_bytes_per_sample(1) == pytest.approx(act + tokens)
    assert costs.up_bytes_per_sample(1) == pytest.approx(act)


def _steps(closes_at_return: bool):
    from types import SimpleNamespace

    from swarmtrain.sim.engine import EventQueue
    from swarmtrain.sim.metrics import Metrics
    from swarmtrain.sim.stage_steps import StageSteps

    engine = EventQueue()
    steps = StageSteps(
        costs_for(TINY),
        0,
        [{}, {}],
        engine,
        Metrics(2),
        closed_step=lambda: 0,
        release=lambda chunk: None,
        closes_at_return=closes_at_return,
    )
    chunks = [SimpleNamespace(samples=8, step=0) for _ in range(4)]
    for chunk in chunks:
        steps.assign(chunk, 0)
    for chunk in chunks:  # every chunk's fused call at the last stage finished
        steps.progress(1, chunk, SimpleNamespace(samples_since_step=0.0))
    engine.run(1.0)
    return steps, chunks, engine


def test_a_stage_handed_off_to_directly_applies_a_step_once_its_chunks_are_back_at_the_trainer():
    """The trainer closes a stage once it knows each chunk finished there, and direct hand-offs report
    a chunk's hops only when it returns (runtime/trainer/step_tracker.py): the last stage's step waits for
    the return, where relayed calls (closes_at_return False) let it apply at once."""
    relayed, _, _ = _steps(closes_at_return=False)
    assert relayed.applied == [-1, 0]
    direct, chunks, engine = _steps(closes_at_return=True)
    assert direct.applied == [-1, -1]
    for chunk in chunks[:-1]:
        direct.returned(chunk)
    engine.run(2.0)
    assert direct.applied == [-1, -1]
    direct.returned(chunks[-1])
    engine.run(3.0)
    assert direct.applied == [-1, 0]  # stage 0 still waits for its own backwards


def test_the_stage_exchange_costs_each_peer_what_its_topology_and_codec_send():
    costs = costs_for(TINY, exchange="all-to-all")
    params = costs.params[0]
    assert costs.exchange_bytes(0, 1) == 0.0
    assert costs.exchange_bytes(0, 3) == 2 * 4 * params  # fp32 sums to each of the 2 others
    butterfly = costs_for(TINY)
    assert butterfly.exchange_bytes(0, 3) == pytest.approx(2 * 2 * params * 2 / 3)
    eight_bit = TINY.replace(swarm=replace(TINY.swarm, exchange_compression="8bit"))
    assert costs_for(eight_bit, exchange="all-to-all").exchange_bytes(0, 3) == pytest.approx(
        2 * (1 + 4 / 256) * params
    )
    with pytest.raises(ValueError):
        SimConfig(stage_exchange="ring")


def test_the_live_all_to_all_exchange_loads_the_stage_links_by_its_codec():
    """Two replicas per stage, synchronous steps, links of 1 MB/s: per step a peer sends its stage's
    sums once (fp32: 4 B per parameter) where a butterfly all-reduce of two moves fp16 both ways (2 B),
    and 8-bit sums about 1 B. The exchange holds up the next step, so fewer bytes train faster."""

    def run(run_cfg, exchange):
        return swarm(
            replicas=2,
            run_cfg=run_cfg,
            duration_s=120.0,
            in_flight=8,
            max_staleness=0,
            stage_exchange=exchange,
        )

    eight_bit = TINY.replace(swarm=replace(TINY.swarm, exchange_compression="8bit"))
    results = {
        "butterfly": run(TINY, "butterfly"),
        "fp32": run(TINY, "all-to-all"),
        "8bit": run(eight_bit, "all-to-all"),
    }
    per_sample = {k: r["bytes_by_kind"]["averaging"] / r["samples"] for k, r in results.items()}
    assert per_sample["fp32"] == pytest.approx(2 * per_sample["butterfly"], rel=0.05)
    assert per_sample["8bit"] == pytest.approx((1 + 4 / 256) / 2 * per_sample["butterfly"], rel=0.05)
    speed = {k: r["samples_per_s"] for k, r in results.items()}
    assert speed["fp32"] < speed["butterfly"] < speed["8bit"]
