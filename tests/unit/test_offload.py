import itertools

import pytest
import torch

from swarmtrain.config import get_preset
from swarmtrain.model import build_model
from swarmtrain.offload import LayerSwapper, SwapPlanError, plan_swap_groups

pytestmark = pytest.mark.unit


def _feasible(groups, layer_bytes, free):
    sizes = [sum(layer_bytes[a:b]) for a, b in groups]
    return all(x + y <= free for x, y in itertools.pairwise(sizes)) and all(s <= free for s in sizes)


def _brute_force_min_groups(layer_bytes, free):
    n = len(layer_bytes)
    for count in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), count - 1):
            bounds = [0, *cuts, n]
            groups = list(itertools.pairwise(bounds))
            if _feasible(groups, layer_bytes, free):
                return count
    return None


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_minimal_and_feasible(seed):
    gen = torch.Generator().manual_seed(seed)
    layer_bytes = (torch.randint(1, 10, (7,), generator=gen)).tolist()
    budget = int(torch.randint(8, 40, (1,), generator=gen))
    expected = _brute_force_min_groups(layer_bytes, budget - 2)
    if expected is None:
        with pytest.raises(SwapPlanError):
            plan_swap_groups(layer_bytes, budget, working_bytes=2)
        return
    plan = plan_swap_groups(layer_bytes, budget, working_bytes=2)
    assert plan.num_groups == expected
    assert [a for a, _ in plan.groups][0] == 0 and plan.groups[-1][1] == 7
    assert _feasible(plan.groups, layer_bytes, budget - 2)
    assert plan.peak_bytes <= budget


def test_plan_without_swapping_and_errors():
    assert plan_swap_groups([1, 1, 1], 10).groups == ((0, 3),)
    with pytest.raises(SwapPlanError, match="leaves nothing"):
        plan_swap_groups([1], 5, working_bytes=5)
    with pytest.raises(SwapPlanError, match="neighbouring layers"):
        plan_swap_groups([5, 5], 9)


def test_swapped_blocks_match_resident_model():
    cfg = get_preset("tiny").model
    model = build_model(cfg, seed=1)
    reference = build_model(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    ref_loss = reference(tokens, tokens)
    ref_loss.backward()

    blocks = list(model.layers.values())
    layer_bytes = [sum(p.numel() * 4 for p in b.parameters()) for b in blocks]
    plan = plan_swap_groups(layer_bytes, budget_bytes=2.5 * layer_bytes[0])  # one layer per group
    assert plan.num_groups == len(blocks)
    swapper = LayerSwapper(blocks, plan)
    hidden = model.embed(tokens).detach().requires_grad_(True)
    out = swapper.forward(hidden)
    out.requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model.lm_head(model.ln_f(out)).flatten(0, 1), tokens.flatten())
    loss.backward()
    model.embed(tokens).backward(swapper.backward(out.grad))

    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, ref[name].grad, rtol=1e-4, atol=1e-6), name
    assert swapper.max_resident_groups <= 2
    # forward copies every group once, backward all but the resident last group
    assert swapper.bytes_copied == sum(layer_bytes) * 2 - layer_bytes[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swapper_on_gpu_matches_cpu():
    cfg = get_preset("small").model
    model = build_model(cfg, seed=2)
    blocks = list(model.layers.values())
    layer_bytes = [sum(p.numel() * 4 for p in b.parameters()) for b in blocks]
    plan = plan_swap_groups(layer_bytes, budget_bytes=2.5 * layer_bytes[0])
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    cpu_out = LayerSwapper(blocks, plan, "cpu").forward(x)
    gpu_out = LayerSwapper(blocks, plan, "cuda").forward(x.cuda())
    assert torch.allclose(cpu_out, gpu_out.cpu(), atol=1e-4)
