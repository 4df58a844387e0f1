"""Record-level DP-SGD on a site (site_trainer/privacy): per-record clipping against an explicit
loop (one process and 2 gloo ranks), the noise's calibration, the accountant against Opacus's,
the refusals of bad configurations, and the budget: enforced, in the ledger, kept across resume.

The 2-rank cases run once, in one torchrun (tests/dp_worker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from pydantic import ValidationError

from conftest import ROOT
from dp_cases import NOISE, clip_case, explicit_clipped_mean
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.privacy import accountant
from site_trainer.privacy.config import PrivacyConfig
from site_trainer.privacy.dp_sgd import NoisyReducer, PerSampleClipper, poisson_sample
from site_trainer.privacy.site_privacy import LEDGER, PrivacyRefused, SitePrivacy

DIGITS = WorkloadConfig(task="digits", options={"hidden": 16})


# ---- per-record clipping ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_per_sample_clipping_equals_an_explicit_per_record_loop(method):
    model, loss_fn, batch, C = clip_case()
    ref = explicit_clipped_mean(model, loss_fn, batch, C, 12)
    sums, losses = PerSampleClipper(model, loss_fn, C, method).clipped_sum(batch)
    got = NoisyReducer(0.0, C, torch.device("cpu")).reduce(sums, 12)
    for (name, _), g in zip(model.named_parameters(), got):
        assert torch.allclose(g, ref[name], atol=1e-6, rtol=0), (name, (g - ref[name]).abs().max())
    per_record = [float(loss_fn(model, (batch[0][i:i + 1], batch[1][i:i + 1])).detach()) for i in range(12)]
    assert float(losses) == pytest.approx(sum(per_record), rel=1e-5)


def test_the_clipping_case_clips_some_records_and_not_others():
    model, loss_fn, (x, y), C = clip_case()
    norms = []
    for i in range(12):
        model.zero_grad()
        loss_fn(model, (x[i:i + 1], y[i:i + 1])).backward()
        norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
    assert min(norms) < C < max(norms)


def test_an_empty_micro_batch_adds_nothing():
    model, loss_fn, (x, y), C = clip_case()
    sums, loss = PerSampleClipper(model, loss_fn, C).clipped_sum((x[:0], y[:0]))
    assert all(float(s.abs().sum()) == 0 for s in sums) and float(loss) == 0


def test_poisson_sampling_keeps_each_record_at_rate_q():
    gen = torch.Generator().manual_seed(0)
    idx = torch.arange(10_000)
    sizes = [len(poisson_sample(idx, 0.03, gen)) for _ in range(50)]
    assert np.mean(sizes) == pytest.approx(300, rel=0.03)
    assert np.std(sizes) == pytest.approx(np.sqrt(10_000 * 0.03 * 0.97), rel=0.3)  # binomial, not fixed


# ---- the 2-rank cases ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    out = tmp / "out.npz"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(ROOT / "tests" / "dp_worker.py"), str(out), str(tmp)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)

    proc = run()
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # An occasional native abort inside torch's gloo ranks (no Python error before it); the
        # stacks faulthandler printed say where. Once more, and the first run's output is kept in
        # the warning.
        warnings.warn(f"the 2-rank DP run aborted natively once; run again. Its stderr:\n{proc.stderr[-5000:]}")
        proc = run()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = {}
    for r in (0, 1):
        with np.load(tmp / f"out-{r}.npz") as z:
            data.update({k: z[k] for k in z.files})
    data["workdir"] = tmp
    return data


def _case(data: dict, case: str, rank: int) -> dict[str, np.ndarray]:
    prefix = f"{case}/rank{rank}/"
    return {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_clipping_under_ddp_with_two_ranks_equals_the_explicit_loop(two_ranks, method):
    model, loss_fn, batch, C = clip_case()
    ref = explicit_clipped_mean(model, loss_fn, batch, C, 12)
    for rank in (0, 1):
        got = _case(two_ranks, f"clip-{method}", rank)
        assert set(got) == set(ref)
        for name, g in got.items():
            assert np.abs(g - ref[name].numpy()).max() <= 1e-6, (rank, name)


def test_noise_std_matches_the_calibration_and_is_the_same_with_one_and_two_ranks(two_ranks):
    sigma, C, seed, n = NOISE
    one = NoisyReducer(sigma, C, torch.device("cpu"), seed).reduce([torch.zeros(n)], 1.0)[0].numpy()
    assert one.std() == pytest.approx(sigma * C, rel=0.01)  # 200k draws: std's own error is 0.16%
    assert abs(one.mean()) < 5 * sigma * C / np.sqrt(n)
    for rank in (0, 1):  # drawn once, by rank 0, for the whole logical batch: the very same noise
        assert np.array_equal(_case(two_ranks, "noise", rank)["x"], one)


def test_dp_trainer_on_two_ranks_keeps_the_replicas_equal(two_ranks):
    r0, r1 = _case(two_ranks, "trainer", 0), _case(two_ranks, "trainer", 1)
    for name in r0:
        assert np.array_equal(r0[name], r1[name]), name
    eps, sigma, steps, seen = r0["figures"]
    assert steps == 3 and 0 < eps < 8 and sigma > 0.3 and seen > 0
    ledger = json.loads((two_ranks["workdir"] / LEDGER).read_text())
    assert ledger["rounds"] == [[1, 3]]


# ---- the accountant ----------------------------------------------------------------------------------
@pytest.mark.parametrize("q,sigma,steps,delta", [(0.01, 1.1, 1000, 1e-5), (0.05, 0.8, 300, 1e-5),
                                                 (0.2, 3.0, 50, 1e-6), (1.0, 2.0, 10, 1e-5),
                                                 (0.004, 0.7, 20_000, 1e-5)])
def test_rdp_epsilon_equals_opacus(q, sigma, steps, delta):
    from opacus.accountants.analysis import rdp as opacus_rdp

    orders = list(accountant.ORDERS)
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    theirs, their_order = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    ours, our_order = accountant.rdp_epsilon([(q, sigma, steps)], delta)
    assert ours == pytest.approx(float(theirs), rel=1e-9) and our_order == int(their_order)


def test_composition_of_a_history_adds_rdp():
    split = accountant.rdp_epsilon([(0.02, 1.0, 100), (0.02, 1.0, 150)], 1e-5)[0]
    assert split == pytest.approx(accountant.rdp_epsilon([(0.02, 1.0, 250)], 1e-5)[0], rel=1e-12)


def test_prv_is_opacus_prv_and_tighter_than_rdp():
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(1.1, 0.01, 1000)]
    assert accountant.epsilon([(0.01, 1.1, 1000)], 1e-5, "prv") == pytest.approx(acc.get_epsilon(delta=1e-5, eps_error=0.01))
    assert accountant.epsilon([(0.01, 1.1, 1000)], 1e-5, "prv") < accountant.epsilon([(0.01, 1.1, 1000)], 1e-5)


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_calibration_spends_the_target_over_the_planned_steps(kind):
    sigma = accountant.calibrate(3.0, 1e-5, 0.05, 200, kind)
    assert accountant.epsilon([(0.05, sigma, 200)], 1e-5, kind) <= 3.0
    assert accountant.epsilon([(0.05, sigma * 0.99, 200)], 1e-5, kind) > 3.0  # not more noise than needed
    assert accountant.calibrate(0.001, 1e-5, 0.5, 5000, kind, sigma_max=50) is None


# ---- refusals ----------------------------------------------------------------------------------------
def _site(**privacy) -> dict:
    return {"id": "a", "partition": 0, "privacy": {"enabled": True, "epsilon": 8.0, **privacy}}


def test_bad_privacy_configs_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValidationError, match="max_grad_norm is 0.0: it must be > 0"):
        SiteConfig(**_site(max_grad_norm=0))
    with pytest.raises(ValidationError, match="needs privacy.epsilon .* or privacy.noise_multiplier"):
        SiteConfig(id="a", partition=0, privacy={"enabled": True})
    for par in ("zero2", "zero3"):
        with pytest.raises(ValidationError, match=f"parallelism '{par}'.*set parallelism: ddp"):
            SiteConfig(**_site(), parallelism=par)
    with pytest.raises(ValidationError, match="per_sample: loop"):
        SiteConfig(**_site(), activation_checkpointing=True)
    assert not SiteConfig(id="a", partition=0).privacy.enabled  # off by default


def test_a_script_workload_with_privacy_is_refused(tmp_path):
    from federation.config.schema import ExperimentConfig

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValidationError, match=r"privacy.enabled with a script \(workload.script\).*declarative tasks only"):
        ExperimentConfig(workload={"script": str(script), "model": "user_tasks:make_model"},
                         sites=[_site()])


def _site_privacy(module: nn.Module, tmp_path: Path, **kw) -> SitePrivacy:
    cfg = PrivacyConfig(**{"enabled": True, "epsilon": 8.0, **kw})
    return SitePrivacy(cfg, site="a", module=module, loss_fn=lambda m, b: m(b).sum(), records=1000, batch_size=10,
                       grad_accum=1, world=1, rounds=5, local_steps=10, workdir=tmp_path, device=torch.device("cpu"))


def test_unreachable_budget_and_batch_norm_are_refused_before_training(tmp_path):
    with pytest.raises(PrivacyRefused, match=r"privacy.epsilon 0.001 .* cannot be met .*max_noise_multiplier 5"):
        _site_privacy(nn.Linear(3, 1), tmp_path, epsilon=0.001, max_noise_multiplier=5)
    with pytest.raises(PrivacyRefused, match=r"batch normalisation.*GroupNorm or LayerNorm"):
        _site_privacy(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), tmp_path)


# ---- the budget: enforced by the site, kept across resume ------------------------------------------
def _trainer(tmp_path: Path, **privacy):
    from site_trainer.local_trainer import LocalTrainer
    from site_trainer.workloads import initial_weights

    site = SiteConfig(id="a", partition=0, batch_size=16, local_steps=4, checkpoint_every=1,
                      privacy={"enabled": True, "max_grad_norm": 1.0, "noise_seed": 1, **privacy})
    cfg = TrainerConfig(site=site, workload=DIGITS, num_partitions=2, socket="/nonexistent", workdir=str(tmp_path),
                        rounds=10)
    t = LocalTrainer(cfg)
    t.load_global(initial_weights(DIGITS, 0))
    return t


def _train_request(t, rnd: int) -> dict:
    from site_trainer import handoff
    from site_trainer.workloads import initial_weights

    h = handoff.write_arrays(initial_weights(DIGITS, 0), f"dp-{rnd}")
    try:
        reply = t.run_request("Train", {"round": rnd, "config": {}, "global": h.to_json()})
        if reply.get("ok"):
            handoff.release(reply["update"]["path"])
        return reply
    finally:
        handoff.release(h.path)


def test_the_budget_stops_the_site_and_a_resume_keeps_what_was_spent(tmp_path, single_rank_group):
    # sigma 1.0 fixed, epsilon a cap: find how many 4-step rounds fit under it
    q = 16 / 720  # digits partition 0 of 2: 899 images, 720 of them for training
    cap = accountant.epsilon([(q, 1.0, 4 * 2)], 1e-5) + 1e-3  # exactly two rounds fit
    t = _trainer(tmp_path, noise_multiplier=1.0, epsilon=cap)
    assert t.dp.q == pytest.approx(q)
    r1 = _train_request(t, 1)
    assert r1["ok"] and r1["metrics"]["dp_steps"] == 4 and r1["metrics"]["dp_noise_multiplier"] == 1.0
    r2 = _train_request(t, 2)
    assert r2["ok"] and r2["metrics"]["dp_epsilon"] > r1["metrics"]["dp_epsilon"]
    assert r2["metrics"]["dp_epsilon"] <= cap
    r3 = _train_request(t, 3)
    assert not r3["ok"] and "privacy budget: round 3" in r3["error"] and f"budget {cap:g}" in r3["error"]
    t.save_checkpoint(2)
    spent = t.dp.spent

    # a round run again after a coordinator resume counts again: rewinding never lowers the ledger
    t.session.rewind(2)
    assert t.dp.ledger.steps == 8
    # a new trainer on the same workdir (a restart): the spent budget is what the ledger holds
    t2 = _trainer(tmp_path, noise_multiplier=1.0, epsilon=cap)
    assert t2.dp.ledger.steps == 8 and t2.dp.spent == pytest.approx(spent)
    assert "privacy budget: round 3" in _train_request(t2, 3)["error"]


def test_steps_are_spent_before_they_run(tmp_path, single_rank_group):
    t = _trainer(tmp_path, epsilon=8.0)
    t.dp.spend(1, 4)
    assert json.loads((tmp_path / LEDGER).read_text())["rounds"] == [[1, 4]]
    t2 = _trainer(tmp_path, epsilon=8.0)  # a crash after spend(), before any checkpoint: still spent
    assert t2.dp.ledger.steps == 4


# ---- reporting ----------------------------------------------------------------------------------------
def _lines() -> list[dict]:
    site = lambda eps, budget=None: {"loss": 1.0, "samples": 10, "dp_epsilon": eps, "dp_delta": 1e-5,  # noqa: E731
                                     "dp_noise_multiplier": 1.1, "dp_steps": 3.0,
                                     **({"dp_epsilon_budget": budget} if budget else {})}
    return [{"round": 1, "sites": {"a": site(1.0), "c": site(2.0, 3.0)}, "failed": {}},
            {"round": 2, "sites": {"a": site(1.5), "c": site(2.9, 3.0)}, "failed": {}},
            {"round": 3, "sites": {"a": site(2.0)}, "failed": {"c": "site_error: site c: privacy budget: round 3 ..."}}]


def test_result_json_privacy_figures_are_each_sites_last(tmp_path):
    from federation.coordinator.privacy_summary import privacy_by_site

    out = privacy_by_site(_lines())
    assert out["a"] == {"epsilon": 2.0, "delta": 1e-5, "noise_multiplier": 1.1, "steps": 3.0, "last_round": 3}
    assert out["c"]["epsilon"] == 2.9 and out["c"]["budget"] == 3.0 and out["c"]["stopped_round"] == 3
    assert privacy_by_site([{"round": 1, "sites": {"a": {"loss": 1.0}}}]) == {}


def test_report_plots_epsilon_against_rounds_only_for_dp_runs(tmp_path):
    from federation.ops.report_cmd import build_report, privacy_series

    series = dict((label, pts) for label, pts, _ in privacy_series(_lines()))
    assert series["a epsilon"] == [(1, 1.0), (2, 1.5), (3, 2.0)] and series["c budget"] == [(1, 3.0), (2, 3.0)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in _lines()))
    page = build_report(tmp_path).read_text()
    assert '<h2>Privacy: epsilon spent per site</h2><img alt="Privacy: epsilon spent per site" src="data:image/png' \
        in page
    assert privacy_series([{"round": 1, "sites": {"a": {"loss": 1.0}}}]) == []


def test_auto_takes_one_record_at_a_time_where_vmap_would_hold_too_much(monkeypatch):
    from site_trainer.privacy import dp_sgd

    model, loss_fn, batch, C = clip_case()
    clip = PerSampleClipper(model, loss_fn, C)
    monkeypatch.setattr(dp_sgd, "VMAP_MAX_VALUES", 12 * clip.numel - 1)
    calls = []
    monkeypatch.setattr(clip, "_vmap", lambda b: calls.append("vmap"))
    real_loop = clip._loop
    monkeypatch.setattr(clip, "_loop", lambda b, n: calls.append("loop") or real_loop(b, n))
    clip.clipped_sum(batch)  # 12 records x P values > the limit: the loop
    clip.clipped_sum((batch[0][:6], batch[1][:6]))  # under it: vmap
    assert calls == ["loop", "vmap"]


def test_the_coordinator_cannot_raise_the_budget(tmp_path, single_rank_group):
    """What a round request carries (its config) cannot change the site's budget: a request asking
    for more local steps than the budget allows is refused, and nothing in it is read as privacy."""
    from site_trainer import handoff
    from site_trainer.workloads import initial_weights

    cap = accountant.epsilon([(16 / 720, 1.0, 8)], 1e-5) + 1e-3  # two rounds of 4 steps
    t = _trainer(tmp_path, noise_multiplier=1.0, epsilon=cap)
    h = handoff.write_arrays(initial_weights(DIGITS, 0), "dp-greedy")
    try:
        reply = t.run_request("Train", {"round": 1, "global": h.to_json(), "config": {
            "local_steps": 40, "privacy": {"epsilon": 1000.0}, "epsilon": 1000.0, "noise_multiplier": 0.01}})
    finally:
        handoff.release(h.path)
    assert not reply["ok"] and "round 1 (40 DP-SGD steps) would spend" in reply["error"]
    assert t.dp.ledger.steps == 0 and t.dp.sigma == 1.0 and t.dp.cfg.epsilon == cap
