"""End to end, faults of a simulated federation: a site whose trainer crashes, one that hangs, one
that sends NaN; and Ctrl-C, which must leave no process and no hand-off file behind."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import digits_site, live_marked, sovfl_popen, write_config
from faults import signal_trainer, wait_metrics_line
from federation.coordinator.checkpoint import load_checkpoint, read_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=200)]


def test_crash_hang_and_hostile_site(tmp_path, marker):
    """A site whose trainer crashes, one that hangs and one that sends NaN: each is reported by
    name; rounds go on while the quorum holds, are skipped (model unchanged) when it does not,
    and the run ends within its deadlines leaving no process behind. The `flwr run` log stream is
    killed after round 1: the launcher asks the SuperLink and waits for the run's result."""
    cfg = {
        "federation": {"name": "faults", "rounds": 3, "quorum": 2,
                       # the crashed trainer must stay down (restarts: tests/test_e2e_site_restart.py)
                       "site_restarts": {"enabled": False},
                       "deadlines": {"connect_s": 60, "round_s": 30, "evaluate_s": 15, "trainer_start_s": 120}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [digits_site(0, "a", 1), digits_site(1, "b", 1), digits_site(2, "c", 1),
                  digits_site(3, "hostile", 1, lr=1e30)],
    }
    path = write_config(tmp_path / "faults.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl_popen("simulate", str(path), "--workdir", str(run), env={"SOVFL_RUN_MARKER": marker})
    try:
        metrics = run / "metrics.jsonl"
        wait_metrics_line(metrics, 1, proc, 300)
        signal_trainer(run, "c", signal.SIGKILL)  # crash
        # the `flwr run --stream` log stream dies (as a SuperLink 500 on it ends it): the run goes on
        os.kill(json.loads((run / "pids.json").read_text())["flwr-run"], signal.SIGKILL)
        wait_metrics_line(metrics, 2, proc, 200)
        signal_trainer(run, "b", signal.SIGSTOP)  # hang
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    r1, r2, r3 = lines
    assert r1["status"] == "aggregated" and set(r1["sites"]) == {"a", "b", "c"}
    assert r1["failed"]["hostile"].startswith("rejected non_finite")
    assert r2["status"] == "aggregated" and set(r2["sites"]) == {"a", "b"}
    assert "c" in r2["failed"] and "unreachable" in r2["failed"]["c"]
    assert r3["status"] == "skipped" and set(r3["sites"]) == {"a"}
    assert "b" in r3["failed"] and any(w in r3["failed"]["b"] for w in ("did not answer", "deadline"))
    assert r3["rejections"]["non_finite"] == 3
    # the skipped round left the global model unchanged
    skipped = read_checkpoint(run / "checkpoints" / "round_0003")
    assert skipped.state["metrics"][-1]["status"] == "skipped"
    before = load_checkpoint(run / "checkpoints" / "round_0002")[1]
    assert all(np.array_equal(skipped.arrays["model"][k], before[k]) for k in before)
    assert "site c excluded" in out and "site hostile excluded" in out and "skipped" in out
    assert "RESULT rounds=2" in out
    assert "the Flower log stream ended but the run is running" in out
    assert live_marked(marker) == []


def test_ctrl_c_tears_everything_down(tmp_path, marker):
    cfg = {"federation": {"name": "intr", "rounds": 50, "quorum": 1},
           "workload": {"task": "digits", "options": {"hidden": 8}},
           "sites": [digits_site(0, "intra", 2), digits_site(1, "intrb", 1)]}  # names no other test's sites have
    path = write_config(tmp_path / "intr.yaml", cfg)
    run = tmp_path / "run"
    proc = sovfl_popen("simulate", str(path), "--workdir", str(run), env={"SOVFL_RUN_MARKER": marker})
    try:
        wait_metrics_line(run / "metrics.jsonl", 1, proc, 300)
        assert len(live_marked(marker)) >= 6  # superlink, 2 supernodes, a's torchrun, 3 ranks, ...
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted; all processes stopped" in out
    assert live_marked(marker) == []
    # /dev/shm is shared with the tests running beside this one: only this run's sites' files count
    left = [p for site in ("intra", "intrb") for p in Path("/dev/shm").glob(f"sovfl-{site}-*")]
    assert not left, f"hand-off files left behind: {left}"
