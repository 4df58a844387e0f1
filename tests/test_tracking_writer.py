"""The trackers' writer (tracking/writer.py): bounded, never blocking the caller, every lost record
counted and said once; the configuration and the flattening the trackers receive."""

from __future__ import annotations

import json
import threading

import pytest
from pydantic import ValidationError

from tracking.config import TrackingConfig
from tracking.flatten import flat_metrics, flat_params
from tracking.tracker import RunInfo, Tracker
from tracking.writer import BoundedWriter, TrackingSession

GATE = threading.Event()


class GatedTracker(Tracker):
    """Opens only when GATE is set: a backend that is slow to answer; keeps what it is sent."""

    def open(self) -> None:
        GATE.wait()
        self.seen: list[tuple] = []

    def log_metrics(self, metrics, step, axis):
        if metrics.get("fail"):
            raise RuntimeError("refused this one")
        self.seen.append((step, axis, metrics))

    def where(self) -> str:
        return "memory"


class DownTracker(Tracker):
    """A backend that cannot be reached."""

    def open(self) -> None:
        raise ConnectionRefusedError("nothing listens")


def _kind(cls: type) -> str:
    return f"{cls.__module__}:{cls.__name__}"


def _session(tmp_path, *kinds: str, capacity: int = 3, close_timeout_s: float = 30.0) -> tuple[TrackingSession, list]:
    said: list[str] = []
    cfg = TrackingConfig(backends=[{"kind": k} for k in kinds], queue_records=capacity, process=False,
                         close_timeout_s=close_timeout_s)
    return TrackingSession(cfg, RunInfo("coordinator", tmp_path, "t"), said.append), said


def test_a_slow_tracker_drops_what_its_queue_cannot_hold_and_says_the_count_once(tmp_path):
    GATE.clear()
    session, said = _session(tmp_path, _kind(GatedTracker))
    for step in range(10):  # the tracker is stuck opening: every call still returns
        session.metrics({"loss": float(step)}, step)
    writer = session.writers[0]
    assert writer.dropped == 7  # 3 queued, 7 refused
    GATE.set()
    assert session.close() == {writer.name: 7}
    assert [step for step, _, _ in writer.tracker.seen] == [0, 1, 2]
    assert len([line for line in said if "record(s) dropped" in line]) == 1
    assert "7 record(s) dropped" in said[-1] and "3 written" in said[-1]
    index = json.loads((tmp_path / "tracking.json").read_text())
    assert index["trackers"] == [{"tracker": writer.name, "where": "memory", "written": 3, "dropped": 7}]


def test_a_failing_call_loses_only_its_record(tmp_path):
    GATE.set()
    session, said = _session(tmp_path, _kind(GatedTracker), capacity=100)
    for step in range(5):
        session.metrics({"loss": 1.0, "fail": float(step == 2)}, step)
    assert session.close() == {session.writers[0].name: 1}
    assert [step for step, _, _ in session.writers[0].tracker.seen] == [0, 1, 3, 4]
    assert any("refused this one" in line for line in said)


def test_a_tracker_that_is_down_loses_everything_and_the_others_keep_writing(tmp_path):
    GATE.set()
    session, said = _session(tmp_path, _kind(DownTracker), _kind(GatedTracker), capacity=100)
    session.params({"a": "1"})
    for step in range(4):
        session.metrics({"loss": 1.0}, step, "step")
    dropped = session.close()
    down, up = session.writers
    assert dropped == {down.name: 5, up.name: 0}
    assert [(step, axis) for step, axis, _ in up.tracker.seen] == [(0, "step"), (1, "step"), (2, "step"), (3, "step")]
    counts = [line for line in said if "record(s) dropped" in line]
    assert len(counts) == 1 and "5 record(s) dropped" in counts[0] and "nothing listens" in counts[0]


def test_close_does_not_wait_past_its_timeout_for_a_stuck_tracker(tmp_path):
    GATE.clear()
    session, said = _session(tmp_path, _kind(GatedTracker), close_timeout_s=0.0)
    for step in range(2):
        session.metrics({"loss": 1.0}, step)
    assert session.close() == {session.writers[0].name: 2}  # both still queued: lost
    queued = session.writers[0].queue.qsize()
    session.metrics({"loss": 1.0}, 9)  # after close: ignored, not queued
    assert session.writers[0].queue.qsize() == queued
    assert len([line for line in said if "record(s) dropped" in line]) == 1
    GATE.set()


def test_put_never_blocks_on_a_full_queue():
    GATE.clear()
    writer = BoundedWriter(GatedTracker(None, RunInfo("x", None, "t")), "gated", 1, lambda line: None)
    for _ in range(1000):
        writer.put("log_metrics", {"loss": 1.0}, 0, "round")
    assert writer.dropped == 999
    GATE.set()
    writer.close(30.0)


def test_config_names_the_installed_trackers_and_checks_their_options():
    with pytest.raises(ValidationError, match=r"no tracker 'aim'.*\['mlflow', 'tensorboard', 'wandb'\]"):
        TrackingConfig(backends=[{"kind": "aim"}])
    with pytest.raises(ValidationError, match="logdir"):
        TrackingConfig(backends=[{"kind": "tensorboard", "options": {"logdir": "x"}}])
    with pytest.raises(ValidationError, match="mode"):
        TrackingConfig(backends=[{"kind": "wandb", "options": {"mode": "cloud"}}])
    assert not TrackingConfig().enabled
    assert TrackingConfig(backends=[{"kind": "mlflow", "options": {"experiment": "e"}}]).enabled


def test_flat_metrics_keeps_numbers_under_safe_paths():
    line = {"round": 2, "status": "aggregated", "sites": {"paris": {"loss": 0.5, "ok": True}},
            "rejections": {"attestation:nonce": 1}, "timing": {"stages": [{"x": 1}]}, "nan": float("nan"), "n": None}
    assert flat_metrics(line) == {"round": 2.0, "sites/paris/loss": 0.5, "sites/paris/ok": 1.0,
                                  "rejections/attestation_nonce": 1.0}


def test_flat_params_leaves_secrets_out():
    cfg = {"federation": {"name": "f", "rounds": 3, "api_key": "k", "wandb": {"token": "t"}},
           "sites": [{"id": "a"}], "private_key_path": "/x"}
    assert flat_params(cfg) == {"federation.name": "f", "federation.rounds": "3", "sites": "[{'id': 'a'}]"}


def test_rows_of_a_flush_travel_as_one_record_and_arrive_step_by_step(tmp_path):
    GATE.set()
    session, _ = _session(tmp_path, _kind(GatedTracker), capacity=1)
    session.rows([(1, {"step/loss": 2.0}), (2, {"step/loss": 1.5}), (2, {"step/samples_per_s": 90.0})])
    assert session.close() == {session.writers[0].name: 0}
    assert session.writers[0].tracker.seen == [(1, "step", {"step/loss": 2.0}), (2, "step", {"step/loss": 1.5}),
                                                (2, "step", {"step/samples_per_s": 90.0})]


def test_the_coordinator_and_each_site_have_their_own_tracking_section():
    from federation.config.schema import ExperimentConfig

    cfg = ExperimentConfig.model_validate({
        "federation": {"tracking": {"backends": [{"kind": "tensorboard"}]}},
        "sites": [{"id": "a", "partition": 0, "tracking": {"backends": [{"kind": "wandb"}]}},
                  {"id": "b", "partition": 1}]})
    assert [b.kind for b in cfg.federation.tracking.backends] == ["tensorboard"]
    assert [b.kind for b in cfg.sites[0].tracking.backends] == ["wandb"] and not cfg.sites[1].tracking.enabled
    with pytest.raises(ValidationError, match=r"sites\.0\.tracking\.backends\.0"):
        ExperimentConfig.model_validate({"sites": [{"id": "a", "partition": 0,
                                                    "tracking": {"backends": [{"kind": "nope"}]}}]})


def test_trackers_in_their_own_processes_write_and_account_for_what_they_lose(tmp_path):
    """The default: each tracker in a helper process (real TensorBoard; an MLflow server that is
    not there). What the child could not write comes back into the count said once."""
    from federation.ops.supervisor import free_port
    from tracking_readers import tensorboard_scalars

    said: list[str] = []
    cfg = TrackingConfig(backends=[{"kind": "tensorboard"}, {"kind": "mlflow", "options": {
        "tracking_uri": f"http://127.0.0.1:{free_port()}", "http_retries": 0}}], close_timeout_s=120)
    session = TrackingSession(cfg, RunInfo("site-x", tmp_path, "t"), said.append)
    session.params({"a": "1"})
    session.rows([(step, {"step/loss": 1.0 / step}) for step in range(1, 6)])
    session.metrics({"round/loss": 0.5}, 1)
    assert session.close() == {"tensorboard": 0, "mlflow": 3}
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "site-x")
    assert scalars["step/loss"] == {step: pytest.approx(1.0 / step) for step in range(1, 6)}
    assert scalars["round/loss"] == {1: 0.5}
    counts = [line for line in said if "record(s) dropped" in line]
    assert len(counts) == 1 and "3 record(s) dropped for tracker mlflow" in counts[0], said
    index = {t["tracker"]: t for t in json.loads((tmp_path / "tracking.json").read_text())["trackers"]}
    assert index["tensorboard"]["where"] == str(tmp_path / "tensorboard" / "site-x")
    assert index["tensorboard"]["written"] == 3 and index["mlflow"]["written"] == 0
