"""Handwritten digits (sklearn's bundled 8x8 images): a fast classifier for checks and tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from site_trainer.tasks.splits import dirichlet_split
from site_trainer.workload import Task, TaskData, TensorRows


def bundled_digits_csv() -> Path | None:
    """sklearn's own copy of the images (`sklearn/datasets/data/digits.csv.gz`: 64 pixel columns,
    then the label), located without importing sklearn; None where that file is not there."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images as 1797 x 64 float pixels 0..16, labels): what `sklearn.datasets.load_digits(return_X_y=True)`
    returns, read with numpy from the file that function reads. Importing sklearn (with scipy) costs
    about a second of CPU in every trainer rank, more than the rest of this task's start."""
    path = bundled_digits_csv()
    if path is None:  # another sklearn layout: its own loader
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


class DigitsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: int = Field(64, ge=1, description="width of the hidden layer")
    partition: Literal["iid", "dirichlet"] = Field("iid", description="how the images are dealt to sites")
    dirichlet_alpha: float = Field(0.5, gt=0, description="label skew of the dirichlet partition (smaller: more)")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="share of a site's images held out for evaluation")


class Digits(Task):
    """A 2-layer MLP on 8x8 digit images; each site holds one partition of sklearn's 1797 images."""

    Options = DigitsOptions

    def build_model(self) -> nn.Module:
        h = self.options.hidden
        return nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))

    def build_data(self) -> TaskData:
        o, ctx = self.options, self.ctx
        x, y = load_digits_arrays()
        x = (x / 16.0).astype(np.float32)
        order = np.random.default_rng(ctx.seed).permutation(len(y))
        if o.partition == "dirichlet":
            mine = order[dirichlet_split(y[order], ctx.num_partitions, o.dirichlet_alpha, ctx.seed)[ctx.partition]]
        else:
            mine = np.array_split(order, ctx.num_partitions)[ctx.partition]
        n_val = max(1, int(len(mine) * o.val_fraction))
        val, train = mine[:n_val], mine[n_val:]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return TaskData(TensorRows(t(x[train]), t(y[train]).long()), TensorRows(t(x[val]), t(y[val]).long()))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, batch) -> dict[str, torch.Tensor | float]:
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y).double() * len(y), "examples": len(y),
                "correct": (logits.argmax(-1) == y).sum()}
