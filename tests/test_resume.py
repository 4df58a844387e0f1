"""Coordinator checkpoints (atomic, checked, no pickle) and resume (federation/coordinator/resume.py).

The resume tests run the real Coordinator over the in-process grid (federation/ops/inprocess.py):
the run is interrupted by an exception in the middle of round 2, after the sites trained, and a
new Coordinator (a new Flower run) continues it with `run(resume=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from federation.config.schema import ExperimentConfig
from federation.coordinator.checkpoint import (
    CheckpointError,
    CheckpointStore,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from federation.coordinator.driver import Coordinator
from federation.coordinator.resume import ResumeRefused, changed_fields, check_config
from federation.ops.inprocess import FunctionTrainer, InProcessGrid, InProcessSite, task_identity
from federation.protocol.downlink_steps import model_digest


def _arrays(scale: float) -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * scale, "b": np.full(4, scale, np.float32)}


def _store(tmp_path, keep=3):
    lines: list[str] = []
    return CheckpointStore(tmp_path / "ckpt", keep, lines.append), lines


# ---- the store ---------------------------------------------------------------------------------
def test_checkpoint_files_are_listed_with_sha256_and_hold_no_pickle(tmp_path, monkeypatch):
    store, _ = _store(tmp_path)
    path = store.save(1, {"model": _arrays(1.0), "optimizer": {"m/w": np.ones(3, np.float32)}}, {"note": "x"})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["round"] == 1 and set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors",
                                                                  "state.json"}
    import hashlib

    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        assert not data.startswith(b"\x80")  # no pickle stream (protocol 2+ starts with PROTO 0x80)
    assert sorted(p.name for p in store.directory.iterdir()) == ["round_0001"]  # no temporary left

    def no_pickle(*a, **k):
        raise AssertionError("a checkpoint load used pickle")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    ckpt = store.latest()
    assert ckpt.round == 1 and ckpt.state == {"note": "x"}
    assert list(ckpt.arrays["model"]) == ["w", "b"]  # the model's own order, not safetensors' sorted one
    np.testing.assert_array_equal(ckpt.arrays["model"]["w"], _arrays(1.0)["w"])


def test_object_arrays_are_refused(tmp_path):
    store, _ = _store(tmp_path)
    with pytest.raises(CheckpointError, match="numeric arrays only"):
        store.save(1, {"model": {"w": np.array([{"a": 1}], dtype=object)}}, {})
    assert store.rounds() == [] and not any(store.directory.iterdir())


def test_keeps_the_newest_checkpoints(tmp_path):
    store, _ = _store(tmp_path, keep=2)
    for rnd in range(1, 6):
        store.save(rnd, {"model": _arrays(rnd)}, {})
    assert store.rounds() == [5, 4]
    assert load_checkpoint(store.directory)[0] == 5


def _corrupt_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda p: _corrupt_byte(p / "model.safetensors"), "model.safetensors: SHA-256 does not match"),
    (lambda p: os.truncate(p / "model.safetensors", 40), "model.safetensors has 40 bytes"),
    (lambda p: os.truncate(p / "state.json", 3), "state.json has 3 bytes"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    (lambda p: (p / "manifest.json").write_text('{"format": 1, "fil'), "manifest.json is not valid JSON"),
    (lambda p: (p / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_with_a_message(tmp_path, damage, reason):
    store, lines = _store(tmp_path)
    for rnd in (1, 2, 3):
        store.save(rnd, {"model": _arrays(rnd), "optimizer": {"m/w": np.full(3, rnd, np.float32)}}, {"r": rnd})
    damage(store.path(3))
    ckpt = store.latest()
    assert ckpt.round == 2 and ckpt.state == {"r": 2}
    np.testing.assert_array_equal(ckpt.arrays["model"]["w"], _arrays(2)["w"])
    assert len(ckpt.skipped) == 1 and reason in ckpt.skipped[0]
    assert any("round_0003 is unusable" in line and reason in line for line in lines), lines
    assert any("using checkpoint round_0002 instead" in line for line in lines), lines
    # the round is run again: its new checkpoint replaces the damaged one
    store.save(3, {"model": _arrays(30)}, {"r": 3})
    assert store.latest().round == 3 and store.latest().skipped == []


def test_every_checkpoint_damaged_is_an_error_naming_each(tmp_path):
    store, _ = _store(tmp_path)
    store.save(1, {"model": _arrays(1)}, {})
    store.save(2, {"model": _arrays(2)}, {})
    _corrupt_byte(store.path(1) / "model.safetensors")
    os.truncate(store.path(2) / "state.json", 1)
    with pytest.raises(CheckpointError, match=r"round_0002: state.json has 1 bytes.*round_0001: model.safetensors: SHA"):
        store.latest()


def test_no_checkpoint_is_none(tmp_path):
    assert _store(tmp_path)[0].latest() is None


def test_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    store, _ = _store(tmp_path)
    store.save(1, {"model": _arrays(1)}, {"r": 1})
    calls = {"n": 0}
    real = os.fsync

    def failing_fsync(fd):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        store.save(2, {"model": _arrays(2), "optimizer": {"m/w": np.ones(2, np.float32)}}, {"r": 2})
    monkeypatch.undo()
    assert store.rounds() == [1] and store.latest().state == {"r": 1}
    assert [p.name for p in store.directory.iterdir()] == ["round_0001"]


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from federation.coordinator.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1], keep=2)
    rnd = (store.rounds() or [0])[0]
    rng = np.random.default_rng(rnd)
    print("ready", flush=True)
    while True:
        rnd += 1
        store.save(rnd, {"model": {"w": rng.standard_normal(200_000).astype(np.float32)}}, {"r": rnd})
""")


def test_sigkill_during_writes_never_leaves_a_damaged_latest_checkpoint(tmp_path):
    """A writer SIGKILLed at random moments, again and again: the newest checkpoint always verifies."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    directory = tmp_path / "ckpt"
    rng = np.random.default_rng(7)
    seen = []
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.05, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        ckpt = CheckpointStore(directory, keep=2).latest()  # raises if damaged
        assert ckpt is not None and ckpt.state == {"r": ckpt.round}
        seen.append(ckpt.round)
    assert seen == sorted(seen) and seen[-1] > seen[0]  # writes went on across the kills


def test_save_and_load_checkpoint_of_a_model(tmp_path):
    save_checkpoint(tmp_path, 1, _arrays(1), {"m/w": np.ones(4, np.float32)})
    path = save_checkpoint(tmp_path, 2, _arrays(2), {})
    rnd, model, opt = load_checkpoint(path)
    assert rnd == 2 and path.name == "round_0002" and opt == {}
    np.testing.assert_array_equal(model["w"], _arrays(2)["w"])
    assert load_checkpoint(tmp_path)[0] == 2 and read_checkpoint(tmp_path / "round_0001").round == 1


# ---- configuration changes -----------------------------------------------------------------------
def _cfg(**federation) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "federation": {"name": "resume", "rounds": 4, "quorum": 1, "evaluate": True, "strategy": "fedadam",
                       "downlink_codec": "int8", "seed": 3, **federation},
        "sites": [{"id": f"s{i}", "partition": i} for i in range(3)],
    })


def test_changed_fields_are_named_with_old_and_new_values():
    old = json.loads(_cfg().model_dump_json())
    new = json.loads(_cfg(rounds=5, server_lr=0.1).model_dump_json())
    new["sites"][1]["lr"] = 0.5
    assert changed_fields(old, new) == ["federation.rounds", "federation.server_lr", "sites[1].lr"]
    with pytest.raises(ResumeRefused) as err:
        check_config(old, new)
    msg = str(err.value)
    assert "3 field(s)" in msg and "federation.rounds: 4 -> 5" in msg and "federation.server_lr: null -> 0.1" in msg
    assert "sites[1].lr" in msg and "-> 0.5" in msg
    # deadlines do not enter the computation: a resume may change them
    later = json.loads(_cfg(deadlines={"round_s": 999}).model_dump_json())
    assert check_config(old, later) == ["federation.deadlines.round_s"]


# ---- resume of a whole run (in process) ----------------------------------------------------------
class Interrupted(BaseException):
    """Stands for the coordinator process dying (nothing in the driver catches it)."""


class CrashingGrid(InProcessGrid):
    """Dies after delivering the `crash_at`-th train message batch (the sites trained)."""

    def __init__(self, sites, run_id, crash_at):
        super().__init__(sites, run_id)
        self.crash_at, self.trains = crash_at, 0

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        if messages and messages[0].metadata.message_type == "train":
            self.trains += 1
            if self.trains == self.crash_at:
                raise Interrupted
        return ids


def _sites(tmp_path):
    def trainer(i):
        target = {k: v * (i + 2) for k, v in _arrays(0.1).items()}

        def train(model, cfg):
            rng = np.random.default_rng([i, cfg.round])  # the round's data, as the site trainer samples it
            delta = {k: (0.3 * (target[k] - model[k]) + 0.01 * rng.standard_normal(model[k].shape)).astype(np.float32)
                     for k in model}
            return delta, {"loss": float(sum(np.abs(d).sum() for d in delta.values()))}

        def evaluate(model, cfg):
            return {"eval_loss": float(sum(np.abs(model[k] - target[k]).sum() for k in model)), "eval_accuracy": 0.5,
                    "num_val_examples": 5}
        return FunctionTrainer(train, 10 * (i + 1), tmp_path / f"s{i}", evaluate)
    return [InProcessSite(f"s{i}", i + 1, trainer(i), {"codec-site-seed": str(i + 1)}, 1) for i in range(3)]


def _run(tmp_path, cfg, run_id=1, crash_at=None, resume=False, sites=None):
    sites = sites or _sites(tmp_path)
    grid = CrashingGrid(sites, run_id, crash_at) if crash_at else InProcessGrid(sites, run_id)
    coord = Coordinator(grid, cfg, tmp_path / "coord", run_id, _arrays(0.0), lambda line: None)
    lines: list[str] = []
    coord._progress = lines.append
    with task_identity(run_id):
        result = coord.run(resume=resume)
    return coord, result, lines


def _metrics(coord):
    return [json.loads(x) for x in coord.metrics_path.read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["fedadam", "fedavg", "diloco"])
def test_a_run_interrupted_in_round_2_resumes_to_the_same_model_bit_for_bit(tmp_path, strategy):
    cfg = _cfg(strategy=strategy)
    ref, ref_result, _ = _run(tmp_path / "ref", cfg)
    assert [m["round"] for m in _metrics(ref)] == [1, 2, 3, 4]

    sites = _sites(tmp_path / "run")
    with pytest.raises(Interrupted):
        _run(tmp_path / "run", cfg, crash_at=2, sites=sites)
    run_dir = tmp_path / "run" / "coord"
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert CheckpointStore(run_dir / "checkpoints").rounds() == [1]
    # a new Flower run continues it: same sites (they kept their stores), new run id
    coord, result, lines = _run(tmp_path / "run", cfg, run_id=2, resume=True, sites=sites)
    assert any("resume: continuing from round_0001 (round 1 of 4 done" in line for line in lines), lines
    assert model_digest(coord.model) == model_digest(ref.model) and list(coord.model) == list(ref.model)
    for k in ref.model:
        assert np.array_equal(coord.model[k], ref.model[k])
    assert coord.opt.state().keys() == ref.opt.state().keys()
    for k, v in ref.opt.state().items():
        assert np.array_equal(coord.opt.state()[k], v)
    metrics = _metrics(coord)
    assert [m["round"] for m in metrics] == [1, 2, 3, 4]
    assert [m["eval_loss"] for m in metrics] == [m["eval_loss"] for m in _metrics(ref)]
    assert result["rounds"] == 4 and result["aggregated_rounds"] == 4 and result["first_loss"] == ref_result["first_loss"]
    # what sites held is not carried over: each says at discovery that its store still holds the restored
    # downlink reference (it got round 2's message before the crash), so the first resumed round sends none
    assert metrics[1]["downlink"]["modes"] == {"hold": 3}


def test_metrics_line_lost_after_the_checkpoint_is_restored_and_extra_lines_dropped(tmp_path):
    cfg = _cfg()
    sites = _sites(tmp_path)
    with pytest.raises(Interrupted):
        _run(tmp_path, cfg, crash_at=3, sites=sites)
    metrics = tmp_path / "coord" / "metrics.jsonl"
    rounds = [json.loads(x)["round"] for x in metrics.read_text().splitlines()]
    assert rounds == [1, 2]
    metrics.write_text(metrics.read_text().splitlines()[0] + "\n{\"round\": 2, \"trunc")  # killed mid-append
    coord, _, _ = _run(tmp_path, cfg, run_id=2, resume=True, sites=sites)
    assert [m["round"] for m in _metrics(coord)] == [1, 2, 3, 4]
    # a damaged round 4 checkpoint: round 4 runs again and its metrics line is replaced, not duplicated
    _corrupt_byte(coord.checkpoints.path(4) / "model.safetensors")
    coord2, _, lines = _run(tmp_path, cfg, run_id=3, resume=True, sites=sites)
    assert any("round_0004 is unusable" in line and "SHA-256" in line for line in lines), lines
    assert any("dropped 1 metrics line(s)" in line for line in lines), lines
    assert [m["round"] for m in _metrics(coord2)] == [1, 2, 3, 4]
    assert model_digest(coord2.model) == model_digest(coord.model)


def test_resume_with_another_configuration_is_refused_before_any_round(tmp_path):
    sites = _sites(tmp_path)
    with pytest.raises(Interrupted):
        _run(tmp_path, _cfg(), crash_at=2, sites=sites)
    with pytest.raises(ResumeRefused, match=r"federation.strategy: \"fedadam\" -> \"fedyogi\""):
        _run(tmp_path, _cfg(strategy="fedyogi"), run_id=2, resume=True, sites=sites)
    assert [json.loads(x)["round"] for x in (tmp_path / "coord" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_without_checkpoint_starts_at_round_1(tmp_path):
    coord, result, lines = _run(tmp_path, _cfg(rounds=2), resume=True)
    assert any("no checkpoint" in line and "starting at round 1" in line for line in lines)
    assert [m["round"] for m in _metrics(coord)] == [1, 2] and result["aggregated_rounds"] == 2


def test_resume_releases_what_a_killed_run_left_in_the_superlink_database(tmp_path):
    import sqlite3

    from federation.ops.run_dir import release_stale_state

    db = tmp_path / "superlink.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE message_ins (message_id VARCHAR, delivered_at VARCHAR, ttl FLOAT)")
    con.executemany("INSERT INTO message_ins VALUES (?, ?, ?)", [("a", "", 70.0), ("b", "2026-01-01", 70.0),
                                                                ("c", "", 100.0)])
    con.execute("CREATE TABLE node (node_id BIGINT, status VARCHAR, online_until FLOAT)")
    con.executemany("INSERT INTO node VALUES (?, ?, ?)", [(1, "online", time.time() + 600), (2, "offline", 5.0)])
    con.commit()
    con.close()
    assert release_stale_state(db) == (2, 1)
    con = sqlite3.connect(db)
    assert dict(con.execute("SELECT message_id, ttl FROM message_ins")) == {"a": 0.0, "b": 70.0, "c": 0.0}
    online = dict(con.execute("SELECT node_id, online_until FROM node"))
    assert online[2] == 5.0 and online[1] <= time.time()
    con.close()
    assert release_stale_state(tmp_path / "absent.db") == (0, 0)
