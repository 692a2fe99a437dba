"""Structured layouts: stage groups cut from the fleet's clusters, the layouts a person writes by hand.

A *clustering* names, per device, a cluster of well-connected devices. The candidates are: classes of
interchangeable devices (identical links: a machine, a place of one kind of device), the fleet's named
sites, and communities of cheap links (connected components of the graph of activation links below a
few quantiles of all links). Each clustering becomes one layout: clusters are chained so that the
best-linked clusters are neighbours, devices are listed cluster by cluster in index order, and the list
is cut into consecutive stage groups of D_DP devices. A cluster whose size is a multiple of D_DP so
fills whole groups by itself (location-pure groups); the rest of a cluster shares a group with the
start of the next cluster in the chain. The pipeline order is left to the cost model, which takes the
best one, so every candidate is priced in its best order.

These are the search's first seeds at scale and the yardstick of `bench/plan_scale.py`: the search
never returns a plan worse than the best of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

COMMUNITY_QUANTILES = (0.02, 0.1, 0.25, 0.5)  # link-cost thresholds for the community clusterings
QUANTILE_SAMPLE = 200_000  # links sampled to place the thresholds (a 4,096-device fleet has 16.8M)
MAX_CHAINED_CLUSTERS = 512  # above this a clustering is too fine to chain (and to call structure)


def community_labels(link_s: np.ndarray, quantile: float) -> np.ndarray:
    """Connected components of the devices whose link costs at most the given quantile of all links."""
    count = link_s.shape[0]
    upper = link_s[np.triu_indices(count, k=1)] if count <= 1024 else _sample_links(link_s)
    if len(upper) == 0:
        return np.zeros(count, dtype=np.int64)
    threshold = float(np.quantile(upper, quantile))
    close = link_s <= threshold
    np.fill_diagonal(close, True)
    _, labels = connected_components(csr_matrix(close), directed=False)
    return labels.astype(np.int64)


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


def structured_labels(cluster: np.ndarray, link_s: np.ndarray, num_groups: int) -> np.ndarray:
    """Group label per device: clusters in chain order, devices in index order, cut into equal groups."""
    count = len(cluster)
    position = {c: k for k, c in enumerate(chain_clusters(cluster, link_s))}
    listed = sorted(range(count), key=lambda d: (position[int(cluster[d])], d))
    labels = np.empty(count, dtype=np.int64)
    labels[listed] = np.arange(count) // (count // num_groups)
    return labels


def clusterings(
    link_s: np.ndarray, device_class: Sequence[int], sites: Sequence[str] = ()
) -> list[np.ndarray]:
    """The candidate clusterings (see the module doc), finest first, duplicates and the trivial ones
    (one cluster, or too many clusters to chain) left out."""
    candidates = [np.asarray(device_class, dtype=np.int64)]
    if sites:
        candidates.append(np.unique(np.asarray(sites), return_inverse=True)[1].reshape(-1))
    candidates += [community_labels(link_s, q) for q in COMMUNITY_QUANTILES]
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
    """Distinct structured layouts (group label per device), one per candidate clustering; with no
    structure to use (one cluster), the consecutive-index layout."""
    layouts: list[np.ndarray] = []
    seen: set[bytes] = set()
    for cluster in clusterings(link_s, device_class, sites):
        labels = structured_labels(cluster, link_s, num_groups)
        if labels.tobytes() not in seen:
            seen.add(labels.tobytes())
            layouts.append(labels)
    if not layouts:
        layouts.append(np.arange(link_s.shape[0]) // (link_s.shape[0] // num_groups))
    return layouts
