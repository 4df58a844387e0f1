"""How the built-in tasks deal one dataset out to sites (simulations of site-local data)."""

from __future__ import annotations

import numpy as np


def dirichlet_split(labels: np.ndarray, num_partitions: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Label-skewed (non-IID) split: each class is divided among partitions by Dirichlet(alpha)."""
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions)) * len(idx)).astype(int)[:-1]
        for p, chunk in enumerate(np.split(idx, cuts)):
            parts[p].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
