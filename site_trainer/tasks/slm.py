"""The `slm` workload: a small byte-level GPT trained on the Python standard library's own sources.

The corpus ships with Python, so nothing is downloaded; modules are dealt to sites by name,
which makes the split naturally non-IID (each site reads different code).
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from site_trainer.workload import Task, TaskData, TensorRows

VOCAB = 256


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.block_size = block_size
        # each part made in `dtype` as it is built: a bf16 model never exists in float32 whole
        self.tok = nn.Embedding(VOCAB, n_embd, dtype=dtype)
        self.pos = nn.Embedding(block_size, n_embd, dtype=dtype)
        self.blocks = nn.ModuleList(Block(n_embd, n_head).to(dtype) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd, dtype=dtype)
        self.head = nn.Linear(n_embd, VOCAB, bias=False, dtype=dtype)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):  # GPT-2's scaled residual init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@functools.lru_cache(maxsize=1)
def stdlib_modules() -> tuple[Path, ...]:
    """The standard library's .py files, sorted, tests and site-packages left out.

    Skipped directories are pruned from the walk (site-packages can be far larger than the
    stdlib), and the list is cached: every rank and every test builds data from it.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found.extend(Path(folder) / f for f in files if f.endswith(".py"))
    return tuple(sorted(found))


def site_corpus(partition: int, num_partitions: int, max_bytes: int) -> bytes:
    """This site's bytes: the modules whose name hashes to its partition, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in stdlib_modules():
        top = path.relative_to(root).parts[0]
        if zlib.crc32(top.encode()) % num_partitions != partition:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"partition {partition}/{num_partitions} has only {len(corpus)} bytes of stdlib source")
    return corpus

class SLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    n_layer: int = Field(2, ge=1, description="transformer blocks")
    n_head: int = Field(2, ge=1, description="attention heads per block")
    n_embd: int = Field(64, ge=8, description="width (divisible by n_head)")
    block_size: int = Field(64, ge=8, description="context length in bytes")
    corpus_bytes_per_site: int = Field(400_000, ge=10_000, description="stdlib source bytes each site trains on")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="tail of a site's corpus held out for evaluation")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the weights as built, trained and exchanged: bfloat16 halves the weights, "
                               "the gradients and the bytes on the wire (no float32 master copy: pure bf16 "
                               "training, for models that only fit so; the coordinator still averages in float32)")

    @model_validator(mode="after")
    def _heads_divide(self) -> "SLMOptions":
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class ByteGPT(Task):
    """A byte-level GPT on the Python standard library's sources, modules dealt to sites by name."""

    Options = SLMOptions

    def build_model(self) -> nn.Module:
        o = self.options
        return GPT(o.n_layer, o.n_head, o.n_embd, o.block_size,
                   torch.bfloat16 if o.dtype == "bfloat16" else torch.float32)

    def build_data(self) -> TaskData:
        """Windows of `block_size + 1` bytes; the tail of the site's corpus is held out for evaluation."""
        o, ctx = self.options, self.ctx
        data = np.frombuffer(site_corpus(ctx.partition, ctx.num_partitions, o.corpus_bytes_per_site), dtype=np.uint8)
        split = int(len(data) * (1 - o.val_fraction))
        t = o.block_size

        def windows(arr: np.ndarray, stride: int) -> TensorRows:
            starts = np.arange(0, len(arr) - t - 1, stride)
            idx = starts[:, None] + np.arange(t + 1)[None, :]
            w = torch.from_numpy(arr[idx].astype(np.int64))
            return TensorRows(w[:, :-1].contiguous(), w[:, 1:].contiguous())

        return TaskData(windows(data[:split], max(1, t // 2)), windows(data[split:], t))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))

    def evaluate(self, model: nn.Module, batch) -> dict[str, torch.Tensor | float]:
        return {"loss": self.loss(model, batch).double() * len(batch[0]), "examples": len(batch[0])}
