"""federation.overlap in the site trainer (site_trainer/overlap.py): the fold-in of the next global
model is exactly θ_start = w_{r+1} + (θ_now − θ_r), the update is still the delta from the model
the round names, stale progress is discarded, overlap without background steps changes nothing,
and the served loop takes its background steps between requests and says how idle its ranks were.

Every distributed case runs in one 2-rank torchrun (tests/overlap_worker.py, gloo on CPU), under
ddp and zero3 (each rank then folds its own shard).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from site_trainer.config import WorkloadConfig
from site_trainer.workloads import initial_weights

pytestmark = pytest.mark.slow(seconds=40)

STRATEGIES = ["ddp", "zero3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap")
    out = tmp / "out.npz"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "overlap_worker.py"), str(out), str(tmp)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with np.load(out) as z:
        data = {k: z[k] for k in z.files}

    def get(key: str):
        if key in data:
            return json.loads(str(data[key]))
        arrays = {k[len(key) + 1:]: v for k, v in data.items() if k.startswith(key + "/")}
        assert arrays, f"no result {key}"
        return arrays

    return get


def _w(k: int) -> dict[str, np.ndarray]:
    """The worker's global model of round k (tests/overlap_worker.py `shifted`), recomputed here."""
    w1 = initial_weights(WorkloadConfig(task="digits", options={"hidden": 16}), 0)
    if k == 1:
        return w1
    return {n: (a + np.float32(0.01 * k) * np.sin(np.arange(a.size, dtype=np.float32)).reshape(a.shape)).astype(
        np.float32) for n, a in w1.items()}


def _exact(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for n in a:
        assert a[n].dtype == b[n].dtype == np.float32, n
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_fold_is_the_new_global_plus_the_background_progress(results, strategy):
    theta1, now = results(f"{strategy}/fold/theta1"), results(f"{strategy}/fold/theta_now")
    assert results(f"{strategy}/fold/taken") == [3, 1]  # the budget is the sent round's local_steps (4)
    # round 1's update was the delta from round 1's model, as without overlap
    _exact(results(f"{strategy}/fold/r1_delta"), {n: theta1[n] - _w(1)[n] for n in theta1})
    assert max(np.abs(now[n] - theta1[n]).max() for n in now) > 1e-4  # the background steps trained
    # all 4 steps of round 2 ran in the background: what it sends is the fold itself, to the bit
    w2 = _w(2)
    _exact(results(f"{strategy}/fold/r2_weights"), {n: w2[n] + (now[n] - theta1[n]) for n in w2})
    m = results(f"{strategy}/fold/r2_metrics")
    assert m["background_steps"] == 4 and m["steps"] == 4 and "overlap_discarded_steps" not in m
    assert results(f"{strategy}/fold/eval")["eval_loss"] > 0  # an evaluation in between kept the progress


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_update_after_a_fold_is_the_delta_from_the_rounds_global_model(results, strategy):
    assert results(f"{strategy}/cont/taken") == [2]
    m = results(f"{strategy}/cont/r3_metrics")
    assert m["background_steps"] == 2 and m["steps"] == 6  # 2 in the background, 4 after the fold
    theta3, w3 = results(f"{strategy}/cont/theta3"), _w(3)
    _exact(results(f"{strategy}/cont/r3_delta"), {n: theta3[n] - w3[n] for n in w3})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_progress_taken_for_another_round_or_a_rerun_is_discarded(results, strategy):
    assert results(f"{strategy}/stale/taken") == [3]
    _exact(results(f"{strategy}/stale/r6_weights"), _w(6))  # round 6 starts from its global model alone
    m = results(f"{strategy}/stale/r6_metrics")
    assert m["background_steps"] == 0 and m["overlap_discarded_steps"] == 3
    # the same round asked again (a resumed coordinator reruns it): the progress made after it goes too
    assert results(f"{strategy}/rerun/taken") == [1]
    _exact(results(f"{strategy}/rerun/r7_weights"), _w(7))
    assert results(f"{strategy}/rerun/r7_metrics")["overlap_discarded_steps"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overlap_without_background_steps_changes_nothing(results, strategy):
    on, off = results(f"{strategy}/plain-on/r2_weights"), results(f"{strategy}/plain-off/r2_weights")
    _exact(on, off)
    assert max(np.abs(on[n] - _w(2)[n]).max() for n in on) > 1e-4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_step_timed_at_start_up_changes_nothing_a_round_sees(results, strategy):
    # LocalTrainer._time_step: the round planner's seconds per step for round 1, in the trainer's Info
    assert results(f"{strategy}/plain-off/info")["step_s_estimate"] > 0
    assert results(f"{strategy}/untimed/info")["step_s_estimate"] is None
    _exact(results(f"{strategy}/untimed/r2_weights"), results(f"{strategy}/plain-off/r2_weights"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_with_a_steps_factor_background_steps_go_past_local_steps_up_to_the_cap(results, strategy):
    from site_trainer.strategies import lr_at

    # local_steps 4, overlap_max_steps_factor 2.5: 10 background steps, then none
    assert results(f"{strategy}/long/taken") == [1] * 10 + [0, 0]
    # the schedule (cosine) of round 2 starts at position 4; steps after the 4th keep the 4th's rate
    assert results(f"{strategy}/long/positions") == [5, 6, 7, 8, 8, 8, 8, 8, 8, 8, 8]
    expected = [lr_at(min(4 + i, 7), 1e-2, 2, "cosine", 5 * 4, 1e-4) for i in range(11)]
    assert results(f"{strategy}/long/lrs") == pytest.approx(expected, rel=1e-12)
    assert expected[0] > expected[3] > lr_at(8, 1e-2, 2, "cosine", 20, 1e-4)  # the clamp held the decay back
    # round 2 (4 steps) trains none after the fold and sends the fold itself, to the bit: 10 steps of progress
    theta1, now, w2 = results(f"{strategy}/long/theta1"), results(f"{strategy}/long/theta_now"), _w(2)
    assert max(np.abs(now[n] - theta1[n]).max() for n in now) > 1e-4
    _exact(results(f"{strategy}/long/r2_weights"), {n: w2[n] + (now[n] - theta1[n]) for n in w2})
    m = results(f"{strategy}/long/r2_metrics")
    assert m["background_steps"] == 10 and m["steps"] == 10 and m["local_steps"] == 4
    assert "overlap_discarded_steps" not in m
    # round 3 (3 steps) after 7 background steps: trains none, answers the delta from w3, which holds all 7
    assert results(f"{strategy}/long/more") == [7]
    theta2, now3, w3 = results(f"{strategy}/long/r2_weights"), results(f"{strategy}/long/theta_now3"), _w(3)
    theta3 = results(f"{strategy}/long/theta3")
    _exact(theta3, {n: w3[n] + (now3[n] - theta2[n]) for n in w3})
    _exact(results(f"{strategy}/long/r3_delta"), {n: theta3[n] - w3[n] for n in w3})
    m = results(f"{strategy}/long/r3_metrics")
    assert m["background_steps"] == 7 and m["steps"] == 7 and m["local_steps"] == 3
    # the cap follows the answered round (3 x 2.5 -> 7); progress for another round is still discarded
    assert results(f"{strategy}/long/stale") == [7]
    m = results(f"{strategy}/long/r5_metrics")
    assert m["background_steps"] == 0 and m["overlap_discarded_steps"] == 7 and m["steps"] == 1


def test_the_served_loop_trains_between_requests_and_reports_idle_time(results):
    first, second = results("served/r1_metrics"), results("served/r2_metrics")
    assert first["background_steps"] == 0 and "idle_fraction" not in first  # no previous reply to measure from
    # the client waited (Info) until the ranks had taken their whole budget before asking round 2
    assert second["background_steps"] == 4 and second["steps"] == 4 and second["background_s"] > 0
    assert 0 < second["idle_fraction"] < 1 and second["idle_s"] > 0
    # round 2 was answered with overlap_max_steps_factor 2: 8 background steps between requests, then the ranks
    # waited (the cap held); round 3 (4 steps) trained none after the fold
    third = results("served/r3_metrics")
    assert third["background_steps"] == 8 and third["steps"] == 8 and third["background_s"] > 0
    assert 0 < third["idle_fraction"] < 1 and third["idle_s"] > 0


def test_overlap_is_off_by_default_travels_in_the_round_config_and_refuses_what_it_cannot_run(tmp_path):
    from pydantic import ValidationError

    from federation.config.schema import ExperimentConfig
    from federation.protocol.round_config import RoundConfig

    site = {"id": "a", "partition": 0}
    assert not ExperimentConfig(sites=[site]).federation.overlap and not RoundConfig().overlap
    assert RoundConfig.from_record(RoundConfig(overlap=True).to_record()).overlap
    assert ExperimentConfig(federation={"overlap": True}, sites=[site]).federation.overlap
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValidationError, match=r"federation.overlap needs the built-in training loop \(workload.task\)"):
        ExperimentConfig(federation={"overlap": True}, workload={"script": str(script), "model": "user_tasks:make_model"},
                         sites=[site])
    with pytest.raises(ValidationError, match=r"site\(s\) \['a'\] run their own script"):
        ExperimentConfig(federation={"overlap": True}, sites=[{**site, "script": str(script)}])
    # federation.overlap_max_steps_factor: 1 by default (background steps stop at local_steps, as before),
    # travels in the round config, caps the budget, and is refused without overlap or below 1
    assert ExperimentConfig(sites=[site]).federation.overlap_max_steps_factor == 1.0
    assert RoundConfig().overlap_max_steps_factor == 1.0
    fed = ExperimentConfig(federation={"overlap": True, "overlap_max_steps_factor": 3}, sites=[site]).federation
    assert fed.overlap_max_steps_factor == 3.0
    rec = RoundConfig(overlap=True, overlap_max_steps_factor=2.5).to_record()
    assert RoundConfig.from_record(rec).overlap_max_steps_factor == 2.5
    with pytest.raises(ValidationError, match=r"federation.overlap_max_steps_factor is 2 but federation.overlap is off"):
        ExperimentConfig(federation={"overlap_max_steps_factor": 2}, sites=[site])
    for bad in (0.5, float("nan"), float("inf"), 1001):
        with pytest.raises(ValidationError, match="overlap_max_steps_factor"):
            ExperimentConfig(federation={"overlap": True, "overlap_max_steps_factor": bad}, sites=[site])
    from federation.protocol.round_config import RoundConfigError

    with pytest.raises(RoundConfigError, match="overlap_max_steps_factor"):
        RoundConfig.from_record({"overlap": True, "overlap_max_steps_factor": 0.5})
    from site_trainer.overlap import background_budget

    assert [background_budget(4, f) for f in (1, 1.0, 2.5, 2.49, 3)] == [4, 4, 10, 9, 12]
    assert background_budget(3, 2.5) == 7 and background_budget(0, 5) == 0
    assert [background_budget(4, f) for f in (None, "x", float("nan"), 0.2)] == [4] * 4  # unusable: as before
    with pytest.raises(ValidationError, match=r"federation.overlap with sites\[\].privacy on site\(s\) \['a'\]"):
        ExperimentConfig(federation={"overlap": True}, sites=[{**site, "privacy": {"enabled": True, "epsilon": 8.0}}])
