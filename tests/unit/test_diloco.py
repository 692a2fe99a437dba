"""DiLoCo pieces of `swarmtrain replica`: the outer optimizer, the inner loop (train-local's step on a
shard), the round rule that keeps replicas equal, AdamW state transfer, and the [diloco] config."""

import dataclasses

import pytest
import torch

from swarmtrain.config import ConfigError, DilocoConfig, get_preset, run_config_from_dict
from swarmtrain.model.diloco import OuterOptimizer
from swarmtrain.model.optim import adam_state_tensors, load_adam_state
from swarmtrain.planner.outer_rounds import (
    INITIAL_LINEAGE,
    RoundState,
    next_lineage,
    reference_member,
    started_from_reference,
)
from swarmtrain.runtime.local import local_reference_val_loss
from swarmtrain.runtime.replica.replica_inner import InnerTrainer, diloco_reference, replica_batch_samples

# torch on one thread: two xdist workers with torch's default threads each oversubscribe two cores (the
# reference trainings took 13-20 s in the unit tier, ~2 s alone)
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def with_diloco(cfg, **changes):
    return cfg.replace(diloco=dataclasses.replace(cfg.diloco, **changes))


def small_cfg(tmp_path, text_dir):
    cfg = run_config_from_dict(
        {
            "preset": "tiny",
            "training": {"warmup_samples": 64, "eval_samples": 32, "max_samples": 512},
            "data": {"source": str(text_dir), "validation_fraction": 0.1},
        }
    )
    return cfg


def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0]))]
    outer = OuterOptimizer(params, learning_rate=0.5, momentum=0.9)
    with torch.no_grad():
        params[0].sub_(torch.tensor([0.2, -0.4]))  # the inner steps moved the weights
    delta = outer.pseudo_gradients()
    assert torch.allclose(delta[0], torch.tensor([0.2, -0.4]))
    outer.apply(delta)
    # first Nesterov step: buffer = g, update = g + 0.9 * g
    expected = torch.tensor([1.0, 2.0]) - 0.5 * 1.9 * torch.tensor([0.2, -0.4])
    assert torch.allclose(outer.anchor[0], expected)
    assert torch.equal(params[0].detach(), outer.anchor[0])  # the inner loop restarts from the anchor
    assert outer.outer_step == 1


def test_outer_learning_rate_one_without_momentum_is_plain_averaging():
    replicas = [[torch.nn.Parameter(torch.zeros(3))] for _ in range(2)]
    outers = [OuterOptimizer(p, 1.0, 0.0) for p in replicas]
    with torch.no_grad():
        replicas[0][0].add_(torch.tensor([1.0, 2.0, 3.0]))
        replicas[1][0].add_(torch.tensor([3.0, 2.0, 1.0]))
    mean = [
        (a + b) / 2 for a, b in zip(outers[0].pseudo_gradients(), outers[1].pseudo_gradients(), strict=True)
    ]
    for outer in outers:
        outer.apply(mean)
    assert torch.allclose(replicas[0][0].detach(), torch.tensor([2.0, 2.0, 2.0]))
    assert torch.equal(replicas[0][0].detach(), replicas[1][0].detach())


def test_non_finite_mean_is_skipped_and_the_round_is_dropped():
    params = [torch.nn.Parameter(torch.ones(2))]
    outer = OuterOptimizer(params, 0.7, 0.9)
    with torch.no_grad():
        params[0].mul_(5)
    outer.apply([torch.tensor([float("nan"), 1.0])])
    assert torch.equal(outer.anchor[0], torch.ones(2))
    assert torch.equal(params[0].detach(), torch.ones(2))
    assert outer.outer_step == 1  # every replica sees the same mean and skips the same step


def test_outer_state_transfer_makes_a_joiner_equal():
    torch.manual_seed(0)
    donor_params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    donor = OuterOptimizer(donor_params, 0.7, 0.9)
    for _ in range(2):
        with torch.no_grad():
            for p in donor_params:
                p.add_(torch.randn_like(p) * 0.1)
        donor.apply(donor.pseudo_gradients())
    joiner_params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    joiner = OuterOptimizer(joiner_params, 0.7, 0.9)
    joiner.load(donor.anchor, donor.momentum_buffers(), donor.outer_step)
    step = [torch.full((4, 3), 0.01), torch.full((3,), -0.02)]
    for outer, params in ((donor, donor_params), (joiner, joiner_params)):
        with torch.no_grad():
            for p, s in zip(params, step, strict=True):
                p.sub_(s)
        outer.apply(outer.pseudo_gradients())
    assert all(torch.equal(a, b) for a, b in zip(donor.anchor, joiner.anchor, strict=True))
    with pytest.raises(ValueError):
        joiner.load(donor.anchor[:1], donor.momentum_buffers()[:1], 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_outer_state_loaded_from_any_device_lives_with_the_host_anchors(device):
    """A stage replica on `device` restoring a checkpoint passes momentum made like its parameters (zeros
    on the device); a peer's arrives in any dtype. The buffers live where the anchors do (the host), so
    the next outer step runs (on CUDA it raised: a host gradient with a device buffer)."""
    params = [
        torch.nn.Parameter(torch.randn(4, 3, device=device)),
        torch.nn.Parameter(torch.randn(3, device=device)),
    ]
    outer = OuterOptimizer(params, 0.7, 0.9)
    momentum = [torch.zeros_like(p, dtype=torch.float64) + 0.5 for p in params]
    outer.load([a.clone() for a in outer.anchor], momentum, 4)
    for anchor, buffer in zip(outer.anchor, outer.momentum_buffers(), strict=True):
        assert (
            (buffer.device, buffer.dtype)
            == (anchor.device, anchor.dtype)
            == (torch.device("cpu"), torch.float32)
        )
        assert torch.equal(buffer, torch.full_like(anchor, 0.5))
    with torch.no_grad():
        for p in params:
            p.sub_(0.01)
    outer.apply(outer.pseudo_gradients())
    assert outer.outer_step == 5 and all(p.device.type == device for p in params)


def test_adam_state_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    params = list(model.parameters())
    tensors = adam_state_tensors(opt, params)
    other = torch.nn.Linear(3, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    load_adam_state(other_opt, list(other.parameters()), tensors)
    for p, q in zip(params, other.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"])
        assert float(other_opt.state[q]["step"]) == 1.0
    with pytest.raises(ValueError):
        load_adam_state(other_opt, list(other.parameters()), tensors[:-1])


def test_round_rule_keeps_the_reference_and_resyncs_the_rest():
    same = next_lineage(2, ["a", "b"], INITIAL_LINEAGE)
    assert same == next_lineage(2, ["b", "a"], INITIAL_LINEAGE)  # every member computes the same
    # one group: fingerprints differ by codec rounding only, both apply
    states = {"a": RoundState(3, same, 100.0), "b": RoundState(3, same, 100.0 + 1e-3)}
    assert started_from_reference(states, "a") and started_from_reference(states, "b")
    # b averaged round 2 alone: another lineage, even with a fingerprint within rounding; the lowest
    # peer id at the top step is the reference, b downloads
    alone = next_lineage(2, ["b"], INITIAL_LINEAGE)
    states = {"a": RoundState(3, same, 100.0), "b": RoundState(3, alone, 100.0)}
    assert started_from_reference(states, "a") and not started_from_reference(states, "b")
    states = {"a2": RoundState(3, alone, 100.0), "b": RoundState(3, same, 100.0)}
    assert reference_member(states) == "a2" and not started_from_reference(states, "b")
    # same lineage but a silently partial all-reduce: the loose fingerprint check still catches it
    states = {"a": RoundState(3, same, 100.0), "b": RoundState(3, same, 100.5)}
    assert not started_from_reference(states, "b")
    # a member behind by a round never applies, whatever its id
    states = {
        "a": RoundState(2, same, 100.0),
        "b": RoundState(3, same, 101.0),
        "c": RoundState(3, same, 101.0),
    }
    assert not started_from_reference(states, "a")
    assert started_from_reference(states, "b") and started_from_reference(states, "c")


def test_a_client_mode_replica_is_the_reference_only_when_nobody_at_its_step_can_serve_a_download():
    """The member that differs downloads from the reference; a client-mode replica (behind a NAT)
    serves no download, so a replica on another lineage than its would wait for a state it can never
    get and leave the run on other weights (the NAT client-mode replica test, 1 of 20 runs)."""
    same = next_lineage(0, ["a", "b"], INITIAL_LINEAGE)
    alone = next_lineage(0, ["b"], INITIAL_LINEAGE)
    natted = RoundState(1, same, 100.0, serves_state=False)
    states = {"a": natted, "b": RoundState(1, alone, 101.0)}
    assert reference_member(states) == "b"  # not the lowest id: it cannot serve
    assert started_from_reference(states, "b") and not started_from_reference(states, "a")
    # the highest outer step still comes first, and among client-mode members only, the lowest id
    states = {"a": natted, "b": RoundState(0, alone, 101.0)}
    assert reference_member(states) == "a"
    states = {"z": natted, "a": RoundState(1, alone, 101.0, serves_state=False)}
    assert reference_member(states) == "a"


def test_replica_batch_must_split_into_micro_batches():
    cfg = get_preset("tiny")  # global 32, micro 8
    assert replica_batch_samples(cfg, 2) == 16
    assert replica_batch_samples(cfg, 4) == 8
    with pytest.raises(ConfigError, match="global_batch_size"):
        replica_batch_samples(cfg, 3)
    with pytest.raises(ConfigError):
        replica_batch_samples(cfg, 8)  # 4 samples: not a whole micro-batch


def test_one_replica_with_plain_outer_steps_is_local_training(tmp_path, small_text_dir):
    """The inner loop is train-local's step: one replica whose outer step copies its weights follows
    local training exactly (up to the rounding of anchor - (anchor - w))."""
    cfg = with_diloco(
        small_cfg(tmp_path, small_text_dir), inner_steps=4, outer_learning_rate=1.0, outer_momentum=0.0
    )
    reference = diloco_reference(cfg, replicas=1, total_samples=512)
    local = local_reference_val_loss(cfg, 512)
    assert reference.inner_steps == 16 and reference.outer_steps == 4
    assert reference.val_loss == pytest.approx(local, rel=1e-4)


def test_two_replicas_split_the_global_batch_and_the_schedule(tmp_path, small_text_dir):
    cfg = small_cfg(tmp_path, small_text_dir)
    a, b = InnerTrainer(cfg, 0, 2), InnerTrainer(cfg, 1, 2)
    assert a.batch_samples == 16
    a.seek(5)
    assert a.step == 5
    a.train_step()
    assert a.step == 6
    assert all(torch.equal(p, q) for p, q in zip(b.params(), InnerTrainer(cfg, 1, 2).params(), strict=True))
    result = diloco_reference(cfg, replicas=2, total_samples=512)
    assert result.samples == 512 and result.inner_steps == 16


def test_diloco_config_section_and_digest(tmp_path):
    base = get_preset("tiny")
    assert base.diloco == DilocoConfig()
    cfg = run_config_from_dict({"preset": "tiny", "diloco": {"inner_steps": 50, "compression": "8bit"}})
    assert cfg.diloco.inner_steps == 50
    assert cfg.digest() != base.digest()  # replicas must agree on H
    local_only = run_config_from_dict(
        {"preset": "tiny", "diloco": {"matchmaking_time_s": 2.0, "compression": "none"}}
    )
    assert local_only.digest() == base.digest()  # each replica's own waits and codec
    with pytest.raises(ConfigError, match="inner_steps"):
        run_config_from_dict({"preset": "tiny", "diloco": {"inner_steps": 0}})
    with pytest.raises(ConfigError, match="compression"):
        run_config_from_dict({"preset": "tiny", "diloco": {"compression": "4bit"}})
    with pytest.raises(ConfigError, match="unknown field diloco.h"):
        run_config_from_dict({"preset": "tiny", "diloco": {"h": 3}})


def test_a_round_alone_keeps_the_weights_and_moves_the_anchor():
    params = [torch.nn.Parameter(torch.zeros(2))]
    outer = OuterOptimizer(params, 0.9, 0.1)
    with torch.no_grad():
        params[0].add_(torch.tensor([1.0, -1.0]))
    outer.rebase()
    assert torch.equal(params[0].detach(), torch.tensor([1.0, -1.0]))
    assert torch.equal(outer.anchor[0], params[0].detach()) and outer.outer_step == 1
    assert torch.equal(outer.pseudo_gradients()[0], torch.zeros(2))


def test_a_replica_streaming_its_blocks_through_the_swapper_trains_like_a_resident_one(
    tmp_path, small_text_dir
):
    """A device budget of half what the whole model needs resident (parameters, gradients, activations):
    the swap plan has several groups, and three local steps give the same weights as the resident model
    (up to summation order)."""
    from swarmtrain.offload.whole_model import SwappedGPT

    cfg = small_cfg(tmp_path, small_text_dir)
    resident = InnerTrainer(cfg, 0, 2)
    unlimited = SwappedGPT(resident.model, float("inf"), micro_batch_size=cfg.training.micro_batch_size)
    budget_bytes = 0.5 * unlimited.predicted_peak.total_bytes
    swapped = InnerTrainer(
        cfg, 0, 2, datasets=(resident.train_set, resident.val_set), swap_budget_bytes=budget_bytes
    )
    assert isinstance(swapped.swapped, SwappedGPT) and swapped.swapped.plan.num_groups >= 2
    for _ in range(3):
        a, b = resident.train_step(), swapped.train_step()
        assert a == pytest.approx(b, rel=1e-5)
    for p, q in zip(resident.params(), swapped.params(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert swapped.swapped.swapper.bytes_copied > 0  # the blocks did stream


def test_the_swapper_refuses_a_model_with_boundary_layers_in_one_line(tmp_path, small_text_dir):
    """It would run the blocks without them: a different model from every resident replica's."""
    import dataclasses

    from swarmtrain.config.errors import ConfigError

    cfg = small_cfg(tmp_path, small_text_dir)
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, boundary="lowrank", boundary_dim=8))
    assert cfg.boundary_cuts()  # the whole model holds boundary layers
    with pytest.raises(ConfigError, match="does not run boundary layers"):
        InnerTrainer(cfg, 0, 2, swap_budget_bytes=1e9)
