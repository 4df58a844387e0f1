"""Handwritten digits (sklearn's bundled 8x8 images): a fast classifier for checks and tests."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from site_trainer.config import WorkloadConfig


def make_model(cfg: WorkloadConfig) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(), torch.nn.Linear(cfg.hidden, 10))


def make_data(cfg: WorkloadConfig, partition: int, num_partitions: int, seed: int):
    from sklearn.datasets import load_digits  # here, not at import: sklearn costs seconds per rank

    from site_trainer.workloads import SiteData, dirichlet_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(y))
    if cfg.partition == "dirichlet":
        mine = order[dirichlet_split(y[order], num_partitions, cfg.dirichlet_alpha, seed)[partition]]
    else:
        mine = np.array_split(order, num_partitions)[partition]
    n_val = max(1, int(len(mine) * cfg.val_fraction))
    val, train = mine[:n_val], mine[n_val:]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return SiteData(t(x[train]), t(y[train]).long(), t(x[val]), t(y[val]).long())


def batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    logits = model(x)
    return F.cross_entropy(logits, y), int((logits.argmax(-1) == y).sum())
