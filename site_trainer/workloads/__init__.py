"""Workloads: a model, a site's train/val data, and a loss. Built identically on every rank.

`build(workload, partition, num_partitions, seed)` is the one entry point; each workload module
provides `make_model`, `make_data` and `batch_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from site_trainer.config import WorkloadConfig


@dataclass
class SiteData:
    """A site's local data: tensors stay on this site."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


@dataclass
class Workload:
    model: torch.nn.Module
    data: SiteData
    # (model, x, y) -> (mean loss, number of correct predictions or -1 when not a classifier)
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


def _module(cfg: WorkloadConfig):
    from site_trainer.workloads import digits, slm

    return digits if cfg.name == "digits" else slm


def make_model(cfg: WorkloadConfig, seed: int, device: str | torch.device | None = None) -> torch.nn.Module:
    """The same initial model on every rank, site and the coordinator (seeded).

    `device="meta"` gives the structure without storage (ZeRO ranks shard it before allocating).
    """
    torch.manual_seed(seed)
    if device is None:
        return _module(cfg).make_model(cfg)
    with torch.device(device):
        return _module(cfg).make_model(cfg)


def build_data(cfg: WorkloadConfig, partition: int, num_partitions: int, seed: int) -> SiteData:
    return _module(cfg).make_data(cfg, partition, num_partitions, seed)


def loss_fn(cfg: WorkloadConfig) -> Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]:
    return _module(cfg).batch_loss


def build(cfg: WorkloadConfig, partition: int, num_partitions: int, seed: int) -> Workload:
    return Workload(make_model(cfg, seed), build_data(cfg, partition, num_partitions, seed), loss_fn(cfg))


def initial_weights(cfg: WorkloadConfig, seed: int) -> dict[str, np.ndarray]:
    """The global model's starting point, as float32 numpy arrays keyed by parameter name."""
    model = make_model(cfg, seed)
    return {k: v.detach().cpu().float().numpy().copy() for k, v in model.state_dict().items()}


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
