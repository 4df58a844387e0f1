"""The digest of a site's data snapshot, for the site's own audit log.

A data-protection officer asks after a run which examples its updates were trained on. The
examples never leave the site, and neither does this digest: the ClientApp writes it into the
site's audit log (at discovery, and at the first round a trainer answers after it started), never
into a message. Two runs, or two rounds, with the same digest trained on the same bytes.

What is digested is what the trainer reads, by the cheapest faithful route: a text task's raw
files (name, role, size and SHA-256 of each, before any PII scrubbing or tokenization), else the
tensors of in-memory `TensorRows` (dtype, shape and bytes). A task whose data is neither says
so by overriding `Task.data_digest`; a torchrun script passes `data_digest=` to `connect`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from site_trainer.text_data import file_digest
from site_trainer.workload import Task, TaskData, TensorRows

FORMAT = "sovfl-data-1"


def files_digest(files: Sequence[tuple[Path, str | None]]) -> str:
    """The digest of a text task's files: each one's name, role ("train", "val" or none), size and
    SHA-256, in name order. Where the files live does not count: a copy elsewhere is the same data."""
    h = hashlib.sha256(f"{FORMAT}|files".encode())
    for path, split in sorted(files, key=lambda f: (f[0].name, str(f[0]), f[1] or "")):
        h.update(f"\n{path.name}|{split or ''}|{path.stat().st_size}|{file_digest(path)}".encode())
    return h.hexdigest()


def tensors_digest(splits: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> str:
    """The digest of in-memory examples: each split's name, then every tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{FORMAT}|tensors".encode())
    for name, tensors in splits:
        h.update(f"\n{name}".encode())
        for t in tensors:
            c = t.detach().cpu().contiguous()
            h.update(f"|{c.dtype}|{tuple(c.shape)}|".encode())
            h.update(memoryview(c.view(torch.uint8).numpy() if c.numel() else np.empty(0, np.uint8)))
    return h.hexdigest()


def task_digest(task: Task, data: TaskData) -> tuple[str | None, str]:
    """(digest, how it was taken) of a task's data: the task's own `data_digest` when it gives one,
    else its text files when it reads text, else its `TensorRows` tensors; (None, "undeclared")
    for other datasets."""
    own = task.data_digest(data)
    if own:
        return str(own), "task"
    if task.reads_text:
        return files_digest(type(task).text_files(task.options, task.ctx)), "text files"
    splits = [("train", data.train), *([("val", data.val)] if data.val is not None else [])]
    if all(isinstance(d, TensorRows) for _, d in splits):
        return tensors_digest([(name, d.tensors) for name, d in splits]), "tensors"
    return None, "undeclared"


def snapshot(digest: str | None, method: str, examples: int, val_examples: int) -> dict[str, Any]:
    """The audit log's `data_snapshot` fields: an absent digest is recorded as undeclared, not hidden."""
    out: dict[str, Any] = {"digest": digest or "", "method": method if digest else "undeclared",
                           "examples": int(examples), "val_examples": int(val_examples)}
    if not digest:
        out["why"] = ("the workload does not say what its data is: override Task.data_digest, or pass "
                      "data_digest= to session.connect")
    return out


def task_snapshot(task: Task, data: TaskData) -> dict[str, Any]:
    """The `data_snapshot` fields of a declarative task's site (rank 0, once at start-up)."""
    digest, method = task_digest(task, data)
    return snapshot(digest, method, len(data.train), len(data.val) if data.val is not None else 0)
