"""Shared fixtures of the DP tests (tests/test_dp.py and its torchrun worker tests/dp_worker.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NOISE = (1.3, 0.7, 7, 200_000)  # sigma, C, seed, coordinates


def clip_case():
    """(model, loss_fn, (x, y) of 12 records, C): a small MLP with a LayerNorm whose records'
    gradient norms straddle C, so some are clipped and some are not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(12, 5) * torch.linspace(0.1, 3.0, 12)[:, None]
    y = torch.arange(12) % 3

    def loss_fn(m, batch):
        xb, yb = batch
        return F.cross_entropy(m(xb), yb)

    return model, loss_fn, (x, y), 2.0


def explicit_clipped_mean(model, loss_fn, batch, C: float, expected: float) -> dict[str, torch.Tensor]:
    """The reference: one record at a time through ordinary autograd, each gradient clipped to C."""
    x, y = batch
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        loss_fn(model, (x[i:i + 1], y[i:i + 1])).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        f = min(1.0, C / (float(norm) + 1e-6))
        for n, p in model.named_parameters():
            total[n] += p.grad * f
    model.zero_grad()
    return {n: t / expected for n, t in total.items()}
