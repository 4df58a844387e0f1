"""End to end: a two-site digits federation with the coordinator and one site writing to
TensorBoard, MLflow (a local SQLite store) and W&B (offline), and to an MLflow server that is not
there. What each tracker holds is read back with the library's own reader and compared with
metrics.jsonl round by round; the site's tracker holds its loss per step and its epsilon, none of
which reaches the coordinator's; the run's model is the one a run without tracking ends with."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import digits_site, live_marked, sovfl, write_config
from federation.coordinator.checkpoint import load_checkpoint
from federation.ops.supervisor import free_port
from federation.protocol.downlink_steps import model_digest
from tracking.flatten import flat_metrics
from tracking_readers import mlflow_run, tensorboard_scalars, wandb_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=170)]

ROUNDS = 2
SITE_ONLY = ("step/", "memory/", "round/")  # what the site's own trackers hold under these keys


def _backends(down_port: int) -> list[dict]:
    return [{"kind": "tensorboard"}, {"kind": "mlflow"}, {"kind": "wandb"},
            {"kind": "mlflow", "options": {"tracking_uri": f"http://127.0.0.1:{down_port}", "http_retries": 0}}]


def _config(path: Path, tracking: bool) -> Path:
    down = free_port()  # nothing listens there
    paris = digits_site(0, "paris", 1, privacy={"enabled": True, "epsilon": 8.0, "noise_seed": 3})
    if tracking:
        paris["tracking"] = {"backends": _backends(down), "flush_every_steps": 2, "close_timeout_s": 600}
    fed = {"name": "tracked", "rounds": ROUNDS, "quorum": 2,
           "deadlines": {"connect_s": 120, "round_s": 120, "trainer_start_s": 240}}
    if tracking:
        fed["tracking"] = {"backends": _backends(down), "close_timeout_s": 600}  # a loaded machine: all of it
    return write_config(path, {"federation": fed, "workload": {"task": "digits", "options": {"hidden": 8}},
                               "sites": [paris, digits_site(1, "frankfurt", 1)]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The federation with tracking on, and the same without it."""
    root, mark = tmp_path_factory.mktemp("tracking"), uuid.uuid4().hex
    out = {}
    try:
        for name, tracking in (("on", True), ("off", False)):
            proc = sovfl("simulate", str(_config(root / f"{name}.yaml", tracking)), "--workdir", str(root / name),
                         env={"SOVFL_RUN_MARKER": mark}, timeout=500)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            out[name] = root / name
        assert live_marked(mark) == []
    finally:
        for pid in live_marked(mark):
            os.kill(pid, signal.SIGKILL)
    return out


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _final_digest(run: Path) -> str:
    _, model, _ = load_checkpoint(run / "checkpoints" / f"round_{ROUNDS:04d}")
    return model_digest(model)


def _coordinator(run: Path) -> tuple[dict, tuple, tuple]:
    (wandb_dir,) = (run / "wandb").glob("offline-run-*")
    return (tensorboard_scalars(run / "tensorboard" / "coordinator"), mlflow_run(run / "mlflow.db"),
            wandb_run(wandb_dir))


def test_each_coordinator_tracker_holds_metrics_jsonl_round_by_round(runs):
    run = runs["on"]
    lines = _lines(run)
    assert [x["round"] for x in lines] == [1, 2] and all(x["status"] == "aggregated" for x in lines)
    tb, (ml, params, tags), (rows, config, summary) = _coordinator(run)
    wb = {}
    for row in rows:
        for k, v in row.items():
            if not k.startswith("_"):  # `round`: the axis, and a key of the line too
                wb.setdefault(k, {})[int(row["round"])] = v
    for line in lines:
        rnd, want = line["round"], flat_metrics(line)
        # the figures the issue names, read straight from the line (not through flat_metrics)
        for key, value in [("eval_loss", line["eval_loss"]), ("eval_accuracy", line["eval_accuracy"]),
                           ("bytes_up", line["bytes_up"]), ("bytes_down", line["bytes_down"]),
                           ("compression_ratio", line["compression_ratio"]),
                           ("timing/round_s", line["timing"]["round_s"]),
                           ("sites/paris/loss", line["sites"]["paris"]["loss"]),
                           ("sites/paris/dp_epsilon", line["sites"]["paris"]["dp_epsilon"]),
                           ("sites/frankfurt/loss", line["sites"]["frankfurt"]["loss"])]:
            assert want[key] == value, key
        assert len(want) > 40, sorted(want)
        assert {k: ml[k][rnd] for k in want} == want  # MLflow keeps float64
        assert {k: wb[k][rnd] for k in want} == want  # W&B keeps the JSON numbers
        assert {k: tb[k][rnd] for k in want} == {k: float(np.float32(v)) for k, v in want.items()}  # float32 events
        for source in (ml, wb, tb):  # every key at this round is one of the line's
            assert {k for k, steps in source.items() if rnd in steps} == set(want)
    assert params["federation.name"] == "tracked" and params["federation.rounds"] == str(ROUNDS)
    assert config["federation.name"] == "tracked"
    digest = _final_digest(run)
    assert tags["model_digest"] == summary["tag/model_digest"] == digest
    assert Path(tags["checkpoint"]) == run / "checkpoints" / f"round_{ROUNDS:04d}"
    assert "final_eval_loss" in tb and set(tb["final_eval_loss"]) == {ROUNDS}


def test_the_site_tracker_holds_its_steps_and_epsilon_and_the_coordinators_none_of_it(runs):
    run = runs["on"]
    lines = _lines(run)
    site = run / "sites" / "paris"
    tb = tensorboard_scalars(site / "tensorboard" / "site-paris")
    ml, params, _ = mlflow_run(site / "mlflow.db")
    (wandb_dir,) = (site / "wandb").glob("offline-run-*")
    rows, _, _ = wandb_run(wandb_dir)
    steps = ROUNDS * 5  # local_steps 5 a round
    for source in (tb, ml):
        assert set(source["step/loss"]) == set(range(1, steps + 1))
        assert set(source["step/lr"]) == set(range(1, steps + 1))
        assert source["step/samples_per_s"] and source["memory/host_peak_bytes"]
        for line in lines:  # each round: the reply's figures as the coordinator received them
            sent = line["sites"]["paris"]
            assert source["round/dp_epsilon"][line["round"]] == pytest.approx(sent["dp_epsilon"], rel=1e-6)
            assert source["round/loss"][line["round"]] == pytest.approx(sent["loss"], rel=1e-6)
    assert ml["round/dp_epsilon"][1] < ml["round/dp_epsilon"][2] <= 8.0
    assert len([r for r in rows if "step/loss" in r]) == steps
    assert params["site.id"] == "paris" and params["site.privacy.epsilon"] == "8.0"
    # none of the site-only keys reached the coordinator: not its trackers, not its metrics lines
    tb_coordinator, (ml_coordinator, _, _), (wb_rows, _, _) = _coordinator(run)
    coordinator_keys = set(tb_coordinator) | set(ml_coordinator) | {k for row in wb_rows for k in row}
    assert not {k for k in coordinator_keys if k.startswith(SITE_ONLY)}
    text = (run / "metrics.jsonl").read_text()
    assert "step/" not in text and "host_peak_bytes" not in text and "samples_per_s" not in text


def test_a_tracker_that_is_down_changes_nothing_and_its_loss_is_said_once(runs):
    assert json.loads((runs["on"] / "result.json").read_text())["status"] == "ok"
    assert _final_digest(runs["on"]) == _final_digest(runs["off"])  # tracking never touches the model
    progress = (runs["on"] / "progress.log").read_text().splitlines()
    said = [x for x in progress if "record(s) dropped" in x]
    assert len(said) == 1 and "mlflow[3] (coordinator)" in said[0] and "0 written" in said[0], said
    site_log = (runs["on"] / "logs" / "site-paris-trainer.log").read_text().splitlines()
    said = [x for x in site_log if "record(s) dropped" in x]
    assert len(said) == 1 and "mlflow[3] (site-paris)" in said[0], said
    for party in (runs["on"], runs["on"] / "sites" / "paris"):
        index = {t["tracker"]: t for t in json.loads((party / "tracking.json").read_text())["trackers"]}
        assert index["mlflow[3]"]["written"] == 0 and index["mlflow[3]"]["dropped"] > 0
        assert all(index[k]["dropped"] == 0 and index[k]["written"] > 0 for k in ("tensorboard", "mlflow[1]", "wandb"))
    assert not (runs["off"] / "tracking.json").exists() and not (runs["off"] / "mlflow.db").exists()


def test_the_report_names_the_tracking_runs(runs):
    page = (runs["on"] / "report.html").read_text()
    assert "Experiment tracking runs" in page
    for where in (runs["on"] / "mlflow.db", runs["on"] / "tensorboard" / "coordinator",
                  runs["on"] / "sites" / "paris" / "mlflow.db"):
        assert str(where) in page, where
    assert "Experiment tracking runs" not in (runs["off"] / "report.html").read_text()
