"""Partitions of a training set over M clients: IID, or label-skewed with a Dirichlet(α) prior (Hsu et al., 2019)."""

from __future__ import annotations

import numpy as np

from hosfl_dist.errors import DataError


def iid_partition(n: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A random permutation cut into M nearly equal shards."""
    if n < num_clients:
        raise DataError(f"{n} training samples cannot be spread over clients.total={num_clients} clients")
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(s) for s in np.array_split(perm, num_clients)]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """For every class, split its samples over clients with proportions q ~ Dir(α·1_M).

    Draws again (up to 100 times) until every client holds at least ``min_size`` samples.
    """
    labels = np.asarray(labels)
    if len(labels) < num_clients * min_size:
        raise DataError(
            f"{len(labels)} training samples cannot give clients.total={num_clients} clients {min_size} each"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(100):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            q = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(int)
            for m, part in enumerate(np.split(idx, cuts)):
                shards[m].extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    raise DataError(f"Dirichlet(α={alpha}) left a client with fewer than {min_size} samples after 100 draws")
