"""ddp, zero2 and zero3 inside a site: the same weights from the same steps, gradient accumulation,
bf16 with fp32 master weights, and the errors and fall-backs an operator sees.

The distributed cases run once, in one 2-rank torchrun (tests/test_zero_worker.py, gloo on CPU).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from conftest import ROOT
from site_trainer import strategies
from site_trainer.config import SiteConfig, WorkloadConfig
from site_trainer.launch import torchrun_argv, trainer_argv
from site_trainer.workloads import initial_weights

SLM = WorkloadConfig(task="slm", options={"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
                                          "corpus_bytes_per_site": 20_000})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    out = tmp / "out.npz"
    env = {**os.environ, "OMP_NUM_THREADS": "1", strategies.FORCE_BF16_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "test_zero_worker.py"), str(out), str(tmp)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with np.load(out) as z:
        data = {k: z[k] for k in z.files}

    def case(name: str) -> dict[str, np.ndarray]:
        got = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(name + "/")}
        assert got, f"no case {name}"
        return got

    case.raw = data
    return case


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.parametrize("workload", ["slm", "digits"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_zero_matches_ddp_after_the_same_steps(results, workload, strategy):
    ddp = results(f"{workload}-ddp")
    assert _max_diff(ddp, results(f"{workload}-{strategy}")) <= 1e-5
    init = initial_weights(SLM if workload == "slm" else WorkloadConfig(task="digits", options={"hidden": 16}), 0)
    assert _max_diff(ddp, init) > 1e-3  # the steps really trained


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_activation_checkpointing_changes_memory_not_weights(results, strategy):
    assert _max_diff(results("slm-ddp"), results(f"slm-{strategy}-ac")) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_grad_accumulation_of_k_micro_batches_equals_one_k_times_larger(results, strategy):
    assert _max_diff(results(f"accum4-{strategy}"), results(f"accum1-{strategy}")) <= 1e-6
    assert _max_diff(results(f"accum4-{strategy}"), results("accum4-ddp")) <= 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_bf16_trains_with_fp32_master_weights(results, strategy):
    bf16, fp32 = results(f"slm-{strategy}-bf16"), results("slm-ddp")
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in bf16.values())
    diff = _max_diff(bf16, fp32)
    assert 0 < diff <= 2 * 3 * 1e-2 + 1e-6  # bf16 really used; AdamW moves at most lr per step


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_rank_digests_agree_and_match_across_strategies(results, strategy):
    digests = results.raw[f"digests-{strategy}"]
    assert len(digests) == 2 and digests[0] == digests[1]
    # zero2 and zero3 compute bf16 the same way (FSDP casts parameters): the same full model
    assert results.raw["digests-zero2"][0] == results.raw["digests-zero3"][0]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_resume_from_local_checkpoint_continues_bit_identically(results, strategy):
    """Model, AdamW moments, sampling generator and site state restored (in-process restart; the
    kill -9 of real processes is in tests/test_zero_service.py)."""
    ref, resumed = results(f"uninterrupted-{strategy}"), results(f"resumed-{strategy}")
    for k in ref:
        np.testing.assert_array_equal(ref[k], resumed[k])


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_a_round_trained_again_starts_from_the_local_state_before_it(results, strategy):
    """The coordinator resumed and sends round 2 again: the site rewinds its AdamW moments and step
    count, RNG and sampling state to its local checkpoint of round 1 (Session.rewind), so the rerun
    trains to the very weights of the first attempt (without the rewind AdamW takes steps 5-6 with
    the moments of steps 1-4 and the weights differ)."""
    first, again = results(f"rerun-first-{strategy}"), results(f"rerun-again-{strategy}")
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_lr_schedule_and_weight_decay_survive_a_local_checkpoint(results, strategy):
    ref, resumed = results(f"sched-uninterrupted-{strategy}"), results(f"sched-resumed-{strategy}")
    for k in ref:
        np.testing.assert_array_equal(ref[k], resumed[k])
    lrs = results.raw[f"sched-lr-{strategy}"]
    # step 3 of 6: past the 2 warm-up steps, a quarter into the cosine, where the resumed trainer is too
    assert lrs[0] == lrs[1] == strategies.lr_at(3, 1e-2, 2, "cosine", 6, 0.0) < 1e-2


def test_lr_schedule_values():
    lr = lambda step: strategies.lr_at(step, 1.0, 2, "cosine", 10, 0.1)  # noqa: E731
    assert [lr(0), lr(1), lr(2)] == [0.5, 1.0, 1.0]  # linear warm-up, then the cosine starts at lr
    assert lr(6) == pytest.approx(0.55) and lr(10) == pytest.approx(0.1) and lr(50) == pytest.approx(0.1)
    assert strategies.lr_at(7, 1.0, 0, "constant", 10, 0.0) == 1.0


def test_zero_on_a_backend_without_sharded_collectives_is_a_clear_error(single_rank_group, monkeypatch):
    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    monkeypatch.setattr(dist, "reduce_scatter_single", unsupported, raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", unsupported)
    strategies.check_supported("ddp", "gloo", torch.device("cpu"))  # ddp needs none of it
    with pytest.raises(strategies.StrategyUnavailable,
                       match=r"parallelism 'zero3' needs reduce-scatter.*use parallelism 'ddp'"):
        strategies.check_supported("zero3", "gloo", torch.device("cpu"))


def test_nccl_without_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(strategies.StrategyUnavailable, match="needs CUDA GPUs; use backend 'gloo'"):
        strategies.device_for("nccl")


def test_bf16_without_native_support_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv(strategies.FORCE_BF16_ENV, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with caplog.at_level(logging.WARNING, logger="sovfl.trainer"):
        assert strategies.compute_dtype("bf16", torch.device("cpu")) is None
    assert "falling back to fp32" in caplog.text
    assert strategies.compute_dtype("fp32", torch.device("cpu")) is None
    monkeypatch.setenv(strategies.FORCE_BF16_ENV, "1")
    assert strategies.compute_dtype("bf16", torch.device("cpu")) is torch.bfloat16


def test_site_config_defaults_and_multi_node_fields():
    s = SiteConfig(id="a", partition=0)
    assert (s.parallelism, s.mixed_precision, s.activation_checkpointing, s.checkpoint_every, s.nnodes) == \
        ("ddp", "fp32", False, 0, 1)
    assert torchrun_argv(s, "t.json")[2:5] == ["torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    # a one-rank, one-node site runs its rank without torchrun's agent; more ranks or nodes use torchrun
    assert trainer_argv(s, "t.json")[1:] == ["-m", "site_trainer", "--config", "t.json"]
    two = SiteConfig(id="a", partition=0, ranks=2)
    assert trainer_argv(two, "t.json") == torchrun_argv(two, "t.json")
    with pytest.raises(ValueError, match="single-node site"):
        trainer_argv(s, "t.json", node_rank=1)
    with pytest.raises(ValidationError, match="rdzv_endpoint"):
        SiteConfig(id="a", partition=0, nnodes=2)
    with pytest.raises(ValidationError, match="parallelism"):
        SiteConfig(id="a", partition=0, parallelism="zero1")
    m = SiteConfig(id="a", partition=0, ranks=4, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    argv = torchrun_argv(m, "t.json", node_rank=1)
    assert "--nnodes=2" in argv and "--rdzv-backend=c10d" in argv and "--rdzv-endpoint=10.0.0.1:29400" in argv
    assert argv[-2:] == ["--node-rank", "1"] and m.world_size == 8
    assert "--rdzv-conf=join_timeout=30" in torchrun_argv(m, "t.json", node_rank=1, join_timeout_s=30)
    with pytest.raises(ValueError, match="node_rank 2"):
        torchrun_argv(m, "t.json", node_rank=2)
    one_per_node = SiteConfig(id="a", partition=0, ranks=1, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert trainer_argv(one_per_node, "t.json", node_rank=1) == torchrun_argv(one_per_node, "t.json", node_rank=1)


def test_adamw_state_made_up_front_is_the_state_its_first_step_makes():
    """make_optimizer creates AdamW's moments before training (not at the first step, when every
    gradient is alive); two steps later weights and state equal those of torch's own lazy start."""
    torch.manual_seed(0)
    shapes = [(8, 4), (4,), (3, 5)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = strategies.make_optimizer(ours, "adamw", 1e-2)
    assert all(opt.state[p]["exp_avg"].abs().sum() == 0 for p in ours)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, fused=True)
    for _ in range(2):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            got, want = opt.state[a][key], ref_opt.state[b][key]
            assert got.dtype == want.dtype and got.device == want.device and torch.equal(got, want), key
