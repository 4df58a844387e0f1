"""The coordinator's view of a workload: the initial global model and the manifest sites must match.

`initial_weights` and `manifest` build the model as the coordinator does (role "coordinator", torch
seeded with the federation's seed): a task's `build_model`, or a script workload's `model`
factory. Only the exchanged tensors are returned (`Task.exchanged`; for a script, the trainable
parameters): for LoRA the adapters, initialised from the seed, never the frozen base.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from site_trainer import layout
from site_trainer.config import WorkloadConfig


def coordinator_model(cfg: WorkloadConfig, seed: int):
    """(model, exchanged names) built on the coordinator's CPU from the federation's seed."""
    import torch

    from site_trainer import workload_loader
    from site_trainer.workload import TaskContext

    torch.manual_seed(seed)
    if cfg.task is None:
        model = workload_loader.model_factory(cfg.model or "")(dict(cfg.options))
        return model, layout.default_exchanged(model)
    task = workload_loader.build_task(cfg, TaskContext(role="coordinator", seed=seed))
    model = task.build_model()
    return model, list(task.exchanged(model))


def initial_weights(cfg: WorkloadConfig, seed: int) -> dict[str, np.ndarray]:
    """The global model's starting point: the exchanged tensors as they travel (wire dtype, e.g.
    float32; bfloat16 as raw 2-byte words, see `layout.wire_dtype`), keyed by state-dict name."""
    return coordinator_start(cfg, seed)[0]


def manifest(cfg: WorkloadConfig, seed: int) -> dict:
    """What every site's trainer must report in its `Info` reply's `manifest` (see `layout.Layout.manifest`):
    the exchanged names, shapes and dtypes and the SHA-256 of the frozen (non-exchanged) tensors."""
    return coordinator_start(cfg, seed)[1]


def coordinator_start(cfg: WorkloadConfig, seed: int) -> tuple[dict[str, np.ndarray], dict]:
    """(`initial_weights`, `manifest`) from one build of the model: the ServerApp needs both, and a
    pretrained model is worth loading once."""
    model, names = coordinator_model(cfg, seed)
    lay = layout.Layout.of(model, names)
    entries = layout.named_tensors(model)
    digest = layout.FrozenDigest()
    for name in lay.frozen:
        digest.update(name, entries[name].detach().cpu())
    return _take_exchanged(entries, [s.name for s in lay.exchanged]), lay.manifest(digest)


def _take_exchanged(entries: dict, names: list[str]) -> dict[str, np.ndarray]:
    """Each exchanged tensor as an array of its own, its tensor's memory released as soon as no later
    name shares it (tied weights do), so the coordinator never holds the model twice (the start-up
    is otherwise its peak)."""
    left = Counter(entries[n].untyped_storage().data_ptr() for n in names)
    out = {}
    for name in names:
        t = entries[name].detach()
        out[name] = _own_copy(t.cpu())
        ptr = t.untyped_storage().data_ptr()
        left[ptr] -= 1
        if left[ptr] == 0 and t.device.type == "cpu":
            try:
                t.untyped_storage().resize_(0)
            except RuntimeError:  # a storage that cannot shrink (e.g. mapped from a file) goes with the model
                pass
    return out


def _own_copy(t) -> np.ndarray:
    """A numpy array of its own holding `t` as it travels (raw words for bf16/fp16). Copied through
    `torch.from_numpy` of the new array, never `t.numpy()`: exporting `t` to numpy would pin its
    storage, which could then not be released."""
    import torch

    arr = np.empty(tuple(t.shape), layout.to_wire(torch.empty(0, dtype=t.dtype)).dtype)
    dst = torch.from_numpy(arr)
    (dst if dst.dtype == t.dtype else dst.view(t.dtype)).copy_(t)
    return arr
