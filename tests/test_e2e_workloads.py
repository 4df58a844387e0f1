"""End to end with the user's own code: a task defined in a test module (`module:attr`), a plain
torchrun script through the session, and the example project installed with pip, each run by
`sovfl simulate` (real SuperLink, SuperNodes and torchrun pools)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, assert_weighted_mean_rounds, live_marked, sovfl, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=275)]

TESTS = str(ROOT / "tests")
FED = {"rounds": 2, "quorum": 2, "update_kind": "weights",
       "deadlines": {"connect_s": 120, "round_s": 180, "evaluate_s": 120, "trainer_start_s": 300}}  # none waited out


def _env(marker: str, *paths: str) -> dict:
    return {"SOVFL_RUN_MARKER": marker,
            "PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_user_task_by_import_path(tmp_path, marker):
    """`workload.task: user_tasks:Blobs` (a Task subclass in a test module, on PYTHONPATH), with a
    per-site option merged over the workload's: every round is the exact weighted mean."""
    sites = [{"id": "a", "partition": 0, "local_steps": 5, "batch_size": 16, "lr": 0.1, "dump_updates": True,
              "workload_options": {"shift": 0.5}},
             {"id": "b", "partition": 1, "local_steps": 5, "batch_size": 16, "lr": 0.1, "dump_updates": True}]
    cfg = {"federation": {"name": "usertask", **FED},
           "workload": {"task": "user_tasks:Blobs", "options": {"features": 8, "hidden": 16}}, "sites": sites}
    path = write_config(tmp_path / "task.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl("simulate", str(path), "--workdir", str(run), env=_env(marker, TESTS), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT rounds=2" in proc.stdout
    lines = assert_weighted_mean_rounds(run, {"a", "b"}, ranks=1, rounds=2)
    assert all(0 <= line["eval_accuracy"] <= 1 for line in lines)
    log = (run / "logs" / "site-a-trainer.log").read_text()
    assert "task user_tasks:Blobs, parallelism ddp" in log
    assert live_marked(marker) == []


def test_plain_torchrun_script_through_the_session(tmp_path, marker):
    """tests/session_script.py: the script's own DDP loop on 2 ranks per site; the session loads the
    global weights into every rank, gathers the update and answers evaluations; on teardown
    (SIGTERM) every rank leaves its loop and the script ends normally."""
    sites = [{"id": n, "ranks": 2, "partition": i, "local_steps": 4, "dump_updates": True}
             for i, n in enumerate(["a", "b"])]
    cfg = {"federation": {"name": "script", **FED},
           "workload": {"script": str(ROOT / "tests" / "session_script.py"), "args": ["--lr", "0.2"],
                        "model": "user_tasks:make_model", "options": {"features": 8, "classes": 3}},
           "sites": sites}
    path = write_config(tmp_path / "script.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl("simulate", str(path), "--workdir", str(run), env=_env(marker, TESTS), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT rounds=2" in proc.stdout and "last_loss=nan" not in proc.stdout
    lines = assert_weighted_mean_rounds(run, {"a", "b"}, ranks=2, rounds=2)
    assert all(line["sites"][s]["samples"] == 240 for line in lines for s in ("a", "b"))  # both ranks' shares
    for site in ("a", "b"):
        log = (run / "logs" / f"site-{site}-trainer.log").read_text()
        assert "trainer ready with 2 rank(s)" in log
        for rank in (0, 1):
            assert f"rank {rank}: session ended cleanly after 2 training round(s)" in log, log[-3000:]
    assert live_marked(marker) == []


def test_example_project_installs_and_runs(tmp_path, marker):
    """examples/credit-risk: `pip install` (offline: no build isolation, no dependencies) into a
    target directory, then `sovfl simulate` of its config, which names the task by its entry point."""
    src = tmp_path / "credit-risk"
    shutil.copytree(ROOT / "examples" / "credit-risk", src, ignore=shutil.ignore_patterns("*.egg-info", "build"))
    site = tmp_path / "site-packages"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert list(site.glob("credit_risk*.dist-info/entry_points.txt"))
    run = tmp_path / "run"
    proc = sovfl("simulate", str(src / "config.yaml"), "--workdir", str(run), env=_env(marker, str(site)), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT rounds=2" in proc.stdout
    assert "task credit-risk" in (run / "logs" / "site-zurich-trainer.log").read_text()
    assert live_marked(marker) == []
