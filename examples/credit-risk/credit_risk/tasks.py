"""The credit-risk task: a small network predicting loan default from a bank's loan records.

Each site reads its own CSV file (`data`, set per site in `sites[].workload_options`): numeric
feature columns and a 0/1 `default` column. Without a file (a simulation), each site draws a
synthetic loan book of its own from a fixed generator, so that the banks' data differ.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from site_trainer.workload import Task, TaskData, TensorRows


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data: str | None = Field(None, description="this site's CSV (header row, a 0/1 `default` column)")
    features: int = Field(12, ge=1, description="feature columns (synthetic books: how many to draw)")
    hidden: int = Field(32, ge=1)
    loans: int = Field(2000, ge=100, description="synthetic books: loans per site")
    val_fraction: float = Field(0.2, gt=0, lt=1)


class CreditRisk(Task):
    Options = Options

    def build_model(self) -> nn.Module:
        o = self.options
        return nn.Sequential(nn.Linear(o.features, o.hidden), nn.ReLU(), nn.Linear(o.hidden, 1))

    def build_data(self) -> TaskData:
        x, y = self._book()
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)  # standardised with this site's own statistics
        order = np.random.default_rng(self.ctx.seed).permutation(len(y))
        n_val = int(len(y) * self.options.val_fraction)
        rows = lambda i: TensorRows(torch.from_numpy(x[i]).float(), torch.from_numpy(y[i]).float())  # noqa: E731
        return TaskData(train=rows(order[n_val:]), val=rows(order[:n_val]))

    def _book(self) -> tuple[np.ndarray, np.ndarray]:
        o = self.options
        if o.data:
            table = np.genfromtxt(o.data, delimiter=",", names=True)
            cols = [c for c in table.dtype.names if c != "default"]
            if len(cols) != o.features:
                raise ValueError(f"{o.data}: {len(cols)} feature columns, options.features says {o.features}")
            return np.stack([table[c] for c in cols], axis=1), table["default"]
        risk = np.random.default_rng(0).normal(size=o.features)  # how features drive default, at every bank
        rng = np.random.default_rng(1 + self.ctx.partition)  # each bank its own customers
        x = rng.normal(loc=0.3 * self.ctx.partition, size=(o.loans, o.features))
        y = (x @ risk + rng.normal(size=o.loans) > 0.5).astype(np.float64)
        return x, y

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)

    def evaluate(self, model: nn.Module, batch) -> dict:
        x, y = batch
        logits = model(x).squeeze(-1)
        return {"loss": F.binary_cross_entropy_with_logits(logits, y, reduction="sum"), "examples": len(y),
                "correct": ((logits > 0).float() == y).sum()}
