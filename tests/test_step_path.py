"""The built-in loop's step pays only for the features a site has on: a one-rank site without
DP-SGD and without overlap trains the bare model (no DDP wrapper: no gradient hooks, no buffer
broadcast before each forward, no all-reduce) and its steps call nothing that DDP, DP-SGD or the
overlap bookkeeping own. Counted (hooks, wrappers, calls), never timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hf_models import llama_dir, write_corpus  # noqa: F401 - fixtures
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig

SEQ = 32
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}
# source files whose functions belong to features this site has off
DISABLED = ("torch/nn/parallel/distributed.py", "site_trainer/privacy/", "site_trainer/overlap.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "paris", files=4, bytes_per_file=5000, jsonl_docs=20)
    return root


def _trainer(model_dir: Path, corpus: Path, workdir: Path, lora):
    from site_trainer.local_trainer import LocalTrainer

    wl = WorkloadConfig(task="hf-causal-lm", options={"model_dir": str(model_dir), "seq_len": SEQ,
                                                      "data": str(corpus / "{site}" / "*"), "val_fraction": 0.0,
                                                      "lora": lora})
    site = SiteConfig(id="paris", partition=0, batch_size=2, local_steps=3, lr=1e-3, optimizer="adamw",
                      pii={"enabled": False})
    return LocalTrainer(TrainerConfig(site=site, workload=wl, num_partitions=1, socket="/nonexistent",
                                      workdir=str(workdir), rounds=2))


def _hooks(model: nn.Module) -> dict[str, int]:
    """Hooks registered on the model's modules and parameters, by kind."""
    counts = {"module": 0, "parameter": 0}
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            counts["module"] += len(getattr(m, attr, {}))
    for p in model.parameters():
        counts["parameter"] += len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None)
                                                                   or {})
    return counts


def _calls_into(paths: tuple[str, ...], run) -> dict[str, int]:
    """Python calls made by `run()` into functions defined in files under `paths`, by function."""
    seen: dict[str, int] = {}

    def profile(frame, event, arg):
        if event == "call":
            file = frame.f_code.co_filename.replace("\\", "/")
            if any(p in file for p in paths):
                key = f"{'/'.join(file.rsplit('/', 2)[-2:])}:{frame.f_code.co_name}"
                seen[key] = seen.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_a_one_rank_site_without_dp_or_overlap_steps_the_bare_model(llama_dir, corpus, tmp_path,  # noqa: F811
                                                                  single_rank_group, lora):
    t = _trainer(llama_dir, corpus, tmp_path, lora)
    assert t.dp is None
    assert t.model is t.module  # no DDP wrapper around a single rank
    assert not isinstance(t.model, nn.parallel.DistributedDataParallel)
    before = {n: p.detach().clone() for n, p in t.module.named_parameters() if p.requires_grad}
    calls = _calls_into(DISABLED, lambda: t.train(3, round_no=1))
    assert calls == {}, f"the step path called into disabled features: {calls}"
    assert _hooks(t.model) == {"module": 0, "parameter": 0}
    assert not t.session.overlap.pending and t.session.overlap._saved is None  # no overlap state kept
    moved = [n for n, p in t.module.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert sorted(moved) == sorted(before)  # the steps trained every trainable tensor


def test_the_probe_sees_a_disabled_feature_when_it_runs(llama_dir, corpus, tmp_path, single_rank_group):  # noqa: F811
    """The call probe itself: a round asking for overlap makes the step path call into overlap.py."""
    t = _trainer(llama_dir, corpus, tmp_path, LORA)
    t.session.overlap.sent(t.session._entries(), 1, budget=1)
    calls = _calls_into(DISABLED, lambda: t.session.run_background(1))
    assert calls.get("site_trainer/overlap.py:run") == 1
