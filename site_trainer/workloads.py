"""The coordinator's view of a workload: the initial global model and the manifest sites must match.

`initial_weights` and `manifest` build the model as the coordinator does (role "coordinator", torch
seeded with the federation's seed): a task's `build_model`, or a script workload's `model`
factory. Only the exchanged tensors are returned (`Task.exchanged`; for a script, the trainable
parameters): for LoRA the adapters, initialised from the seed, never the frozen base.
"""

from __future__ import annotations

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
    model, names = coordinator_model(cfg, seed)
    lay = layout.Layout.of(model, names)
    entries = layout.named_tensors(model)
    return {s.name: layout.to_wire(entries[s.name].detach().cpu().contiguous()).copy() for s in lay.exchanged}


def manifest(cfg: WorkloadConfig, seed: int) -> dict:
    """What every site's trainer must report in its `Info` reply's `manifest` (see `layout.Layout.manifest`):
    the exchanged names, shapes and dtypes and the SHA-256 of the frozen (non-exchanged) tensors."""
    model, names = coordinator_model(cfg, seed)
    lay = layout.Layout.of(model, names)
    entries = layout.named_tensors(model)
    digest = layout.FrozenDigest()
    for name in lay.frozen:
        digest.update(name, entries[name].detach().cpu())
    return lay.manifest(digest)
