"""Workloads written as a user would, outside the framework, named by import path in tests
(`user_tasks:Blobs`; e2e runs put tests/ on PYTHONPATH)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from site_trainer.workload import Task, TaskData, TensorRows


class BlobsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    features: int = Field(8, ge=1)
    classes: int = Field(3, ge=2)
    hidden: int = Field(16, ge=1)
    examples: int = Field(300, ge=10, description="examples at this site")
    shift: float = Field(0.0, description="this site's feature shift (per-site option in the tests)")


class Blobs(Task):
    """Gaussian blobs, one centre per class; each site draws its own examples (its partition)."""

    Options = BlobsOptions

    def build_model(self) -> nn.Module:
        o = self.options
        return nn.Sequential(nn.Linear(o.features, o.hidden), nn.Tanh(), nn.Linear(o.hidden, o.classes))

    def build_data(self) -> TaskData:
        o = self.options
        centres = np.random.default_rng(0).normal(size=(o.classes, o.features)) * 2
        rng = np.random.default_rng(1000 + self.ctx.partition)
        y = rng.integers(0, o.classes, size=o.examples)
        x = (centres[y] + rng.normal(size=(o.examples, o.features)) + o.shift).astype(np.float32)
        cut = o.examples // 5
        rows = lambda a, b: TensorRows(torch.from_numpy(a), torch.from_numpy(b).long())  # noqa: E731
        return TaskData(rows(x[cut:], y[cut:]), rows(x[:cut], y[:cut]))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module, batch) -> dict:
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="sum"), "examples": len(y),
                "correct": (logits.argmax(-1) == y).sum()}


class NoLoss(Task):
    """Forgets to implement `loss`."""

    def build_model(self) -> nn.Module:
        return nn.Linear(2, 2)

    def build_data(self) -> TaskData:
        raise NotImplementedError


class NotATask:
    """A class that is no Task at all."""


# ---- a LoRA-like model: what travels and what does not ------------------------------------------

class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora: bool = True  # False: everything trains (full fine-tuning; the tied embedding travels once)
    dtype: Literal["float32", "bfloat16"] = "float32"
    d: int = 8
    vocab: int = 16
    layers: int = 3
    base_seed: int = Field(7, description="the 'pretrained' base weights: the same on every site unless changed")
    seq: int = 6


class ToyBlock(nn.Module):
    def __init__(self, d: int, r: int = 2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.lora_a = nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(d, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.lora_a.t() @ self.lora_b.t())


class ToyLM(nn.Module):
    """Embedding tied to the output head, repeated blocks with frozen bases and trainable adapters,
    a 0-dim gain, an integer buffer, a float buffer and a non-persistent (constructor-made) buffer."""

    def __init__(self, o: ToyOptions):
        super().__init__()
        self.emb = nn.Embedding(o.vocab, o.d)
        self.blocks = nn.ModuleList(ToyBlock(o.d) for _ in range(o.layers))
        self.head = nn.Linear(o.d, o.vocab, bias=False)
        self.head.weight = self.emb.weight
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("centre", torch.linspace(-1, 1, o.d))
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(o.d) / o.d)), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * self.inv_freq.to(self.emb.weight.dtype) - self.centre.to(self.emb.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gain)


class Toy(Task):
    Options = ToyOptions

    def build_model(self) -> nn.Module:
        o = self.options
        model = ToyLM(o)
        base = torch.Generator().manual_seed(o.base_seed)  # "pretrained": independent of the run's seed
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith(("lora_a", "lora_b", "gain")) and p.device.type != "meta":
                    p.copy_(torch.randn(p.shape, generator=base) * 0.3)
        if o.lora:
            for name, p in model.named_parameters():
                p.requires_grad_(name.endswith(("lora_a", "lora_b", "gain")))
        return model.to(getattr(torch, o.dtype))

    def build_data(self) -> TaskData:
        o = self.options
        g = torch.Generator().manual_seed(100 + self.ctx.partition)
        seqs = torch.randint(0, o.vocab, (64, o.seq + 1), generator=g)
        return TaskData(TensorRows(seqs[:48, :-1], seqs[:48, 1:]), TensorRows(seqs[48:, :-1], seqs[48:, 1:]))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float().reshape(-1, self.options.vocab), y.reshape(-1))


def make_model(options: dict) -> nn.Module:
    """A script workload's model factory (workload.model): the coordinator's initial model."""
    return nn.Sequential(nn.Linear(options.get("features", 8), 16), nn.Tanh(), nn.Linear(16, options.get("classes", 3)))
