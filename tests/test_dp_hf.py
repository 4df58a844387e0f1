"""DP-SGD (sites[].privacy) where a site's training runs: hf-causal-lm with LoRA and full
fine-tuning (Llama- and GPT-2-style models built on the spot), bf16 compute, gradient accumulation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import gpt2_dir, llama_dir, model_dir, write_corpus  # noqa: F401 - fixtures
from site_trainer import strategies
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.privacy.dp_sgd import NoisyReducer, PerSampleClipper

SEQ = 32
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "paris", files=4, bytes_per_file=5000, jsonl_docs=20)
    return root


def _workload(model_dir: Path, corpus: Path, lora) -> WorkloadConfig:  # noqa: F811
    return WorkloadConfig(task="hf-causal-lm", options={"model_dir": str(model_dir), "seq_len": SEQ,
                                                        "data": str(corpus / "{site}" / "*"), "val_fraction": 0.3,
                                                        "lora": lora})


def _explicit(model, loss_fn, batch: torch.Tensor, C: float) -> list[torch.Tensor]:
    """One sequence at a time through ordinary backward, each gradient clipped to C, summed."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(batch)):
        model.zero_grad()
        loss_fn(model, batch[i:i + 1]).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        f = min(1.0, C / (float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) + 1e-6))
        for t, g in zip(total, grads):
            t += g * f
    model.zero_grad()
    return total


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_per_sequence_clipping_on_causal_lms_equals_an_explicit_loop(model_dir, corpus, tmp_path, lora):  # noqa: F811
    from site_trainer.tasks.hf_causal_lm import CausalLM
    from site_trainer.workload import TaskContext
    from site_trainer.workload_loader import validate_options

    wl = _workload(model_dir, corpus, lora)
    task = CausalLM(validate_options(CausalLM, wl.options, "workload.options", "hf-causal-lm"),
                    TaskContext(role="site", site="paris", workdir=tmp_path, seed=0))
    torch.manual_seed(0)
    model, data = task.build_model(), task.build_data()
    model.eval()  # no dropout: the per-record gradients are deterministic, the comparison exact
    batch = torch.stack([data.train[i] for i in range(4)])
    C = 0.05
    ref = _explicit(model, task.loss, batch, C)
    clip = PerSampleClipper(model, task.loss, C)  # auto: vmap, or one at a time where vmap cannot run (GPT-2)
    got, _ = clip.clipped_sum(batch)
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref)) <= 1e-6
    assert clip.method == ("loop" if "gpt2" in str(model_dir) else "vmap")
    norms = [float(torch.sqrt(sum(g.pow(2).sum() for g in _explicit(model, task.loss, batch[i:i + 1], 1e9))))
             for i in range(4)]
    assert max(norms) > C  # the case clips

    # bf16 compute: the same clipped sum within bf16's precision
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = PerSampleClipper(model, task.loss, C).clipped_sum(batch)
    scale = max(float(r.abs().max()) for r in ref)
    assert max(float((a - b).abs().max()) for a, b in zip(low, ref)) <= 0.05 * scale
    assert all(g.dtype == torch.float32 for g in low)


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_hf_causal_lm_trains_with_dp_bf16_and_grad_accum(llama_dir, corpus, tmp_path, monkeypatch,  # noqa: F811
                                                        single_rank_group, lora):
    from site_trainer.local_trainer import LocalTrainer

    monkeypatch.setenv(strategies.FORCE_BF16_ENV, "1")
    site = SiteConfig(id="paris", partition=0, batch_size=2, grad_accum=2, local_steps=2, lr=1e-2,
                      mixed_precision="bf16", privacy={"enabled": True, "epsilon": 8.0, "noise_seed": 0})
    t = LocalTrainer(TrainerConfig(site=site, workload=_workload(llama_dir, corpus, lora), num_partitions=1,
                                   socket="/nonexistent", workdir=str(tmp_path), rounds=3))
    assert t.dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in t.module.named_parameters()}
    rep = t.train(2, round_no=1)
    assert np.isfinite(rep["loss"]) and rep["samples_seen"] > 0
    moved = [n for n, p in t.module.named_parameters() if not torch.equal(p, before[n])]
    trainable = [n for n, p in t.module.named_parameters() if p.requires_grad]
    assert sorted(moved) == sorted(trainable)  # LoRA: only the adapters move; full: every weight
    f = t.dp.figures()
    assert f["dp_steps"] == 2 and 0 < f["dp_epsilon"] < 8 and f["dp_noise_multiplier"] > 0


def test_grad_accum_clips_per_record_and_adds_noise_once_per_logical_batch(tmp_path, single_rank_group):
    """batch 16 x grad_accum 2 and batch 32 x 1 sample the same Poisson batch (same q, same stream)
    and draw the same noise: the same step, so the noise is per logical batch, not per micro-batch."""
    from site_trainer.local_trainer import LocalTrainer
    from site_trainer.workloads import initial_weights

    digits = WorkloadConfig(task="digits", options={"hidden": 16})
    weights = []
    for bs, accum in ((16, 2), (32, 1)):
        site = SiteConfig(id="a", partition=0, batch_size=bs, grad_accum=accum, local_steps=2,
                          privacy={"enabled": True, "noise_multiplier": 1.0, "noise_seed": 5})
        t = LocalTrainer(TrainerConfig(site=site, workload=digits, num_partitions=2, socket="/nonexistent",
                                       workdir=str(tmp_path / f"{bs}"), rounds=3))
        t.load_global(initial_weights(digits, 0))
        t.train(2, round_no=1)
        weights.append({n: p.detach().clone() for n, p in t.module.named_parameters()})
    for n in weights[0]:
        assert torch.allclose(weights[0][n], weights[1][n], atol=1e-6, rtol=0), n
    assert any(not torch.equal(weights[0][n], initial) for n, initial in
               ((n, torch.from_numpy(v)) for n, v in initial_weights(digits, 0).items()))


def test_noise_is_one_draw_whatever_the_micro_batches():
    r = NoisyReducer(2.0, 0.5, torch.device("cpu"), seed=11)
    x = r.reduce([torch.zeros(50_000)], 1.0)[0]
    assert float(x.std()) == pytest.approx(1.0, rel=0.02)
