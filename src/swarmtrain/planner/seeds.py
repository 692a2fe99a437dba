"""Starting placements: the baselines (random, the two rank conventions) and the search's constructive seeds.

All return one group label per device. The constructive seeds look only at link costs, never at device
numbers, so they behave the same on a relabelled fleet:

- `packed`: grow each group around a random device by adding the devices with the cheapest links to
  the group so far (good gradient all-reduce, the rank-div layout on a datacenter);
- `striped`: first pack the devices into D_DP tight *clusters* of S devices, then give every group one
  device of every cluster, so any two groups can be matched pairwise inside clusters (fast pipeline
  edges, the rank-mod layout on a datacenter). With a band size c < S the same is done per band of c
  groups, over clusters of c devices.
"""

from __future__ import annotations

import numpy as np


def random_labels(rng: np.random.Generator, num_devices: int, num_groups: int) -> np.ndarray:
    """A uniformly random balanced partition."""
    return rng.permutation(np.arange(num_devices) % num_groups)


def rank_mod_labels(num_devices: int, num_groups: int) -> np.ndarray:
    """The rank convention stage = rank mod S (consecutive ranks in different stages)."""
    return np.arange(num_devices) % num_groups


def rank_div_labels(num_devices: int, num_groups: int) -> np.ndarray:
    """The rank convention stage = rank div D_DP (consecutive ranks in the same stage)."""
    return np.arange(num_devices) // (num_devices // num_groups)


def packed_labels(rng: np.random.Generator, link_s: np.ndarray, num_groups: int) -> np.ndarray:
    """Equal groups grown greedily: start where the tightest group can form, add the cheapest device."""
    num_devices = link_s.shape[0]
    size = num_devices // num_groups
    labels = np.full(num_devices, -1, dtype=np.int64)
    # Small noise breaks the many exact ties of structured fleets differently for each seed.
    noisy = link_s * (1.0 + 1e-6 * rng.random(link_s.shape))
    np.fill_diagonal(noisy, np.inf)
    for group in range(num_groups):
        free = np.flatnonzero(labels < 0)
        # Start at the free device whose size-1 nearest free devices are nearest: tight sites fill first.
        near = np.sort(noisy[np.ix_(free, free)], axis=1)[:, : size - 1].sum(axis=1)
        first = int(free[np.argmin(near)])
        labels[first] = group
        total = noisy[first].copy()
        for _ in range(size - 1):
            free = np.flatnonzero(labels < 0)
            nearest = int(free[np.argmin(total[free])])
            labels[nearest] = group
            total += noisy[nearest]
    return labels


def striped_labels(
    rng: np.random.Generator, link_s: np.ndarray, num_groups: int, band_size: int | None = None
) -> np.ndarray:
    """Bands of `band_size` groups; each band takes D_DP tight clusters of `band_size` devices and gives
    every group of the band one device per cluster. Tightest clusters share a band, so a fleet that is
    half machines, half loners gets striped machine groups and loner groups."""
    num_devices = link_s.shape[0]
    band_size = band_size or num_groups
    group_size = num_devices // num_groups
    clusters = packed_labels(rng, link_s, num_devices // band_size)
    # Cluster ids come out tightest first, so consecutive clusters make a band.
    labels = np.empty(num_devices, dtype=np.int64)
    for cluster in range(num_devices // band_size):
        band = cluster // group_size
        members = np.flatnonzero(clusters == cluster)
        labels[members] = band * band_size + rng.permutation(band_size)
    return labels
