"""Robust combination of replicas' gradient sums: one scaled replica cannot turn or blow up the step;
honest replicas add exactly as before."""

import pytest
import torch

from swarmtrain.net.robust import norm_of, robust_mean

pytestmark = pytest.mark.unit


def _sums(seed: int, samples: int, scale: float = 1.0) -> tuple[int, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    per_sample = [torch.randn(64, 8, generator=g) * 1e-2, torch.randn(8, generator=g) * 1e-2]
    return samples, [t * samples * scale for t in per_sample]


def _plain_mean(contributions):
    samples = sum(n for n, _ in contributions.values())
    return [sum(s[i] for _, s in contributions.values()) / samples for i in range(2)]


def test_honest_replicas_are_added_unchanged():
    honest = {"a": _sums(1, 16), "b": _sums(2, 16), "c": _sums(3, 8)}
    mean, clipped = robust_mean(honest)
    assert clipped == []
    for got, want in zip(mean, _plain_mean(honest), strict=True):
        assert torch.allclose(got, want, atol=1e-7)


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_scaled_replica_is_clipped_to_the_honest_scale(replicas):
    honest = {f"h{i}": _sums(i, 16) for i in range(replicas - 1)}
    byzantine = {"z": _sums(7, 16, scale=1e6)}
    mean, clipped = robust_mean({**honest, **byzantine})
    assert clipped == ["z"]
    honest_mean = _plain_mean(honest)
    norm = lambda ts: float(torch.sqrt(sum((t**2).sum() for t in ts)))  # noqa: E731
    # bounded: at most clip_factor x the honest per-sample scale, not 1e6 x
    assert norm(mean) <= 2.5 * norm(honest_mean)
    assert all(torch.isfinite(t).all() for t in mean)


def test_nothing_to_combine():
    assert robust_mean({}) == (None, [])
    assert robust_mean({"a": (0, [torch.zeros(2)])}) == (None, [])


def test_all_reduce_parts_are_combined_robustly():
    import asyncio

    from swarmtrain.net.outer_averaging import RobustTensorPartReducer

    async def reduce(parts):
        reducer = RobustTensorPartReducer((torch.Size([4]),), num_senders=len(parts))
        results = await asyncio.gather(
            *(reducer.accumulate_part(i, 0, t, w) for i, (t, w) in enumerate(parts))
        )
        return results[0]

    honest = torch.tensor([0.1, -0.2, 0.3, 0.0])
    other = torch.tensor([0.12, -0.18, 0.25, 0.01])
    plain = asyncio.run(reduce([(honest, 16.0), (other, 16.0)]))
    assert torch.allclose(plain, (honest + other) / 2)
    scaled = asyncio.run(reduce([(honest, 16.0), (other * 1e6, 16.0)]))
    assert torch.isfinite(scaled).all() and scaled.norm() <= 1.6 * honest.norm()
    nan = asyncio.run(reduce([(honest, 16.0), (torch.full((4,), float("nan")), 16.0)]))
    assert torch.equal(nan, honest)


def test_the_norm_of_several_tensors_is_their_concatenations_in_float64():
    torch.manual_seed(0)
    tensors = [torch.randn(50, 30) * 1e3, torch.randn(7), torch.zeros(0), torch.randn(3, 3, 3) * 1e-3]
    whole = torch.cat([t.flatten().double() for t in tensors])
    assert norm_of(tensors) == pytest.approx(float(torch.linalg.vector_norm(whole)), rel=1e-15)
    assert norm_of([]) == 0.0
