"""Structured layouts: stage groups cut from the fleet's clusters, the layouts a person writes by hand.

A *clustering* names, per device, a cluster of well-connected devices. The candidates are: classes of
interchangeable devices (identical links: a machine, a place of one kind of device), the fleet's named
sites, and communities of cheap links (connected components of the graph of activation links below a
few quantiles of all links). Clusters are chained so that the best-linked clusters are neighbours and
devices are listed cluster by cluster in index order. The list is then dealt into stage groups:

- *pure* (band size 1): cut into consecutive groups of D_DP devices. A cluster whose size is a multiple
  of D_DP fills whole groups by itself (location-pure groups); the rest of a cluster shares a group
  with the start of the next cluster in the chain;
- *banded* (band size c, a divisor of S): cut into consecutive bands of c x D_DP devices, each dealt
  round-robin over c groups, so every group of a band holds a share of each of its clusters and
  consecutive groups can be matched pairwise inside clusters (fast pipeline edges). With c = S on a
  datacenter of machines this is the rank-mod layout; banded layouts hold the best known cost of
  every DT-FM scenario (c = 8, or c = 4 on spot), while pure layouts win where places are far apart.

The pipeline order is left to the cost model, which takes the best one, so every candidate is priced in
its best order. These are the search's first seeds (at scale, its population) and the yardstick of
`bench/plan_scale.py`: the search never returns a plan worse than the best of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

COMMUNITY_QUANTILES = (0.02, 0.1, 0.25, 0.5)  # link-cost thresholds for the community clusterings
QUANTILE_SAMPLE = 200_000  # links sampled to place the thresholds (a 4,096-device fleet has 16.8M)
MAX_CHAINED_CLUSTERS = 512  # above this a clustering is too fine to chain (and to call structure)


def community_labels(link_s: np.ndarray, device_class: Sequence[int], quantile: float) -> np.ndarray:
    """Connected components of the devices whose link costs at most the given quantile of all links.
    Computed over classes of interchangeable devices (a class is kept whole: its members link alike to
    everyone), so a fleet of a few places needs a graph of a few nodes, not of millions of links."""
    count = link_s.shape[0]
    upper = link_s[np.triu_indices(count, k=1)] if count <= 1024 else _sample_links(link_s)
    if len(upper) == 0:
        return np.zeros(count, dtype=np.int64)
    threshold = float(np.quantile(upper, quantile))
    classes = np.asarray(device_class, dtype=np.int64)
    _, first = np.unique(classes, return_index=True)
    close = link_s[np.ix_(first, first)] <= threshold
    np.fill_diagonal(close, True)
    _, labels = connected_components(csr_matrix(close), directed=False)
    return labels[classes].astype(np.int64)


def _sample_links(link_s: np.ndarray) -> np.ndarray:
    """A fixed, evenly spread sample of off-diagonal links (deterministic: no generator needed)."""
    count = link_s.shape[0]
    flat = np.linspace(0, count * count - 1, QUANTILE_SAMPLE).astype(np.int64)
    rows, cols = np.divmod(flat, count)
    keep = rows != cols
    return link_s[rows[keep], cols[keep]]


def chain_clusters(cluster: np.ndarray, link_s: np.ndarray) -> list[int]:
    """Cluster ids in chain order: start at the largest cluster, then always the cluster with the
    cheapest mean link to the last one (so leftovers share groups with their best-linked neighbours)."""
    ids, sizes = np.unique(cluster, return_counts=True)
    index = np.searchsorted(ids, cluster)
    one_hot = np.zeros((len(cluster), len(ids)))
    one_hot[np.arange(len(cluster)), index] = 1.0
    mean_link = one_hot.T @ link_s @ one_hot / np.outer(sizes, sizes)
    chain = [int(np.argmax(sizes))]
    left = set(range(len(ids))) - set(chain)
    while left:
        last = chain[-1]
        chain.append(min(left, key=lambda k: (mean_link[last, k], k)))
        left.discard(chain[-1])
    return [int(ids[k]) for k in chain]


def listed_by_cluster(cluster: np.ndarray, link_s: np.ndarray) -> np.ndarray:
    """Devices cluster by cluster (clusters in chain order), in index order inside a cluster."""
    position = {c: k for k, c in enumerate(chain_clusters(cluster, link_s))}
    return np.array(sorted(range(len(cluster)), key=lambda d: (position[int(cluster[d])], d)), dtype=np.int64)


def structured_labels(listed: np.ndarray, num_groups: int, band_size: int = 1) -> np.ndarray:
    """Group label per device of the listing: bands of `band_size` x D_DP consecutive devices, each
    dealt round-robin over its `band_size` groups (band size 1: consecutive groups)."""
    count = len(listed)
    rank = np.arange(count)
    labels = np.empty(count, dtype=np.int64)
    labels[listed] = rank // (band_size * (count // num_groups)) * band_size + rank % band_size
    return labels


def clusterings(
    link_s: np.ndarray, device_class: Sequence[int], sites: Sequence[str] = ()
) -> list[np.ndarray]:
    """The candidate clusterings (see the module doc), finest first, duplicates and the trivial ones
    (one cluster, or too many clusters to chain) left out."""
    candidates = [np.asarray(device_class, dtype=np.int64)]
    if sites:
        candidates.append(np.unique(np.asarray(sites), return_inverse=True)[1].reshape(-1))
    candidates += [community_labels(link_s, device_class, q) for q in COMMUNITY_QUANTILES]
    kept: list[np.ndarray] = []
    seen: set[bytes] = set()
    for labels in candidates:
        canonical = np.unique(labels, return_inverse=True)[1].reshape(-1).astype(np.int64)
        clusters = int(canonical.max()) + 1
        if clusters < 2 or clusters > MAX_CHAINED_CLUSTERS or canonical.tobytes() in seen:
            continue
        seen.add(canonical.tobytes())
        kept.append(canonical)
    return kept


def structured_layouts(
    link_s: np.ndarray, device_class: Sequence[int], num_groups: int, sites: Sequence[str] = ()
) -> list[np.ndarray]:
    """Distinct structured layouts (group label per device): the pure layout of every candidate
    clustering first, then the banded ones by band size. With no structure to use (one cluster), the
    consecutive-index layout. Layouts that differ only in group numbering count once."""
    band_sizes = [c for c in range(1, num_groups + 1) if num_groups % c == 0]
    listings = [listed_by_cluster(cluster, link_s) for cluster in clusterings(link_s, device_class, sites)]
    layouts: list[np.ndarray] = []
    seen: set[frozenset] = set()
    for band_size in band_sizes:
        for listed in listings:
            labels = structured_labels(listed, num_groups, band_size)
            partition = frozenset(tuple(np.flatnonzero(labels == k)) for k in range(num_groups))
            if partition not in seen:
                seen.add(partition)
                layouts.append(labels)
    if not layouts:
        layouts.append(np.arange(link_s.shape[0]) // (link_s.shape[0] // num_groups))
    return layouts
