"""Combining replicas' gradient (or pseudo-gradient) sums so that one bad replica cannot wreck the
step: each contribution's per-sample norm is clipped to `clip_factor` times the lower median of all
contributions' per-sample norms, then the clipped sums are added and divided by the samples.

Every replica of a stage must compute the same combination from the same contributions (they stay
identical only then), so the threshold comes from the contributions alone, never from "my own" sums:
- a replica whose sums are scaled by 1e6 (a broken device, a hostile peer) is cut to `clip_factor`
  times the honest scale; its direction still counts;
- with 2 replicas the lower median is the smaller norm: a replica sending tiny sums can slow the
  step down (everything clipped to its scale) but cannot turn it; with 3 or more, the median is an
  honest replica's as long as a minority is bad;
- honest replicas of the same step have per-sample norms within a small factor of each other (same
  model, samples of one global batch), so at `clip_factor` 2 the clip does not fire on them and
  an all-honest swarm adds exactly what it did before.
Non-finite sums never get here: the protocol refuses them at the boundary (net/protocol.py).
"""

from __future__ import annotations

import math

import torch

CLIP_FACTOR = 2.0


def robust_mean(
    contributions: dict[str, tuple[int, list[torch.Tensor]]], clip_factor: float = CLIP_FACTOR
) -> tuple[list[torch.Tensor] | None, list[str]]:
    """(mean per sample of the clipped sums, peers whose sums were clipped), adding in dict order."""
    samples = sum(n for n, _ in contributions.values())
    if not samples:
        return None, []
    norms = {p: _norm(sums) / n for p, (n, sums) in contributions.items() if n > 0}
    ordered = sorted(norms.values())
    limit = clip_factor * ordered[(len(ordered) - 1) // 2]
    totals: list[torch.Tensor] | None = None
    clipped = []
    for peer, (n, sums) in contributions.items():
        scale = 1.0
        if n > 0 and len(ordered) > 1 and norms[peer] > limit:
            scale = limit / norms[peer]
            clipped.append(peer)
        scaled = [t * scale for t in sums] if scale != 1.0 else [t.clone() for t in sums]
        totals = scaled if totals is None else [a.add_(b) for a, b in zip(totals, scaled, strict=True)]
    assert totals is not None
    return [t / samples for t in totals], clipped


def _norm(tensors: list[torch.Tensor]) -> float:
    total = math.fsum(float(t.double().pow(2).sum()) for t in tensors)
    return math.sqrt(total)
