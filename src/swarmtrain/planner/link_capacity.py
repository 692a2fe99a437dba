"""How many samples per second a server's links let it serve, and which resource limits it: pure
functions of what the server measured (runtime/server/link_meter.py) or what the simulator assumes
(sim/costs.RateTable), so both decide the same way.

A direction of a link (uplink, downlink) is measured by its transfers: bytes, and the seconds during
which at least one transfer in that direction was under way (the union of their intervals, not the
sum). Any such measurement is a lower bound on the link's rate: while busy, the link carried at least
those bytes. Two lower bounds are taken and the larger is kept:
- all transfers together, bytes / busy seconds: the link's rate once it is saturated (transfers
  overlap and the union is the whole window);
- each partner's transfers alone, the fastest partner's bytes / busy seconds: the link's rate when the
  slow end of the other transfers is the partner's link (a receiver fed by one slow sender and one fast
  one reads the fast one's rate, not the mix).
What neither can tell: a link whose every partner is slower than it reads as fast as its fastest
partner. Its figure then understates it, which costs a plan a move it did not need, never an
overloaded stage. Each transfer starts cold after an idle spell (TCP's slow start), so on long paths
a lightly loaded server's figure understates its link too (docs/LOG.md).

The link's samples per second are its rate over the bytes each sample costs in that direction, and a
server serves min(compute, uplink, downlink): its compute and its two directions work at once on
different micro-batches, so the slowest of the three paces it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

COMPUTE, UPLINK, DOWNLINK = "compute", "uplink", "downlink"


@dataclass(frozen=True)
class Transfers:
    """What one direction of a link carried over some windows: bytes, and busy seconds (the union of
    the transfers' intervals)."""

    bytes: float
    busy_s: float

    def rate_bytes_per_s(self) -> float | None:
        return self.bytes / self.busy_s if self.busy_s > 0 and self.bytes > 0 else None


def link_rate_bytes_per_s(total: Transfers, per_partner: Iterable[Transfers] = ()) -> float | None:
    """The larger lower bound on a direction's rate (module docstring); None when it carried nothing."""
    rates = [r for r in (t.rate_bytes_per_s() for t in (total, *per_partner)) if r is not None]
    return max(rates) if rates else None


def link_samples_per_s(rate_bytes_per_s, bytes_per_sample):
    """Samples per second a direction carries at `rate_bytes_per_s` (floats or numpy arrays); infinite
    where a sample costs it no byte."""
    rate, need = np.asarray(rate_bytes_per_s, dtype=float), np.asarray(bytes_per_sample, dtype=float)
    # divides only where a sample needs bytes (the simulator calls this thousands of times on 10,000 x S
    # arrays: a division of every element and two selects took 0.4 ms a call)
    out = np.full(np.broadcast_shapes(rate.shape, need.shape), np.inf)
    samples = np.divide(rate, need, out=out, where=need > 0)
    return float(samples) if samples.ndim == 0 else samples


def limited_rates(compute_samples_per_s, uplink_samples_per_s, downlink_samples_per_s):
    """Element-wise min of the three (floats or numpy arrays): what each server serves."""
    return np.minimum(compute_samples_per_s, np.minimum(uplink_samples_per_s, downlink_samples_per_s))


def limited_capacity(
    compute_samples_per_s: float,
    uplink_samples_per_s: float | None = None,
    downlink_samples_per_s: float | None = None,
) -> tuple[float, str]:
    """(samples per second a server serves, the resource that limits it); a direction not measured
    (None) limits nothing. Ties go to compute, then the uplink: a link is named only when it is the
    strictly slower resource."""
    candidates = [(compute_samples_per_s, COMPUTE)]
    for figure, name in ((uplink_samples_per_s, UPLINK), (downlink_samples_per_s, DOWNLINK)):
        if figure is not None:
            candidates.append((figure, name))
    best = candidates[0]
    for candidate in candidates[1:]:
        if candidate[0] < best[0]:
            best = candidate
    return float(best[0]), best[1]
