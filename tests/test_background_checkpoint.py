"""A round's checkpoint is written while the next round goes on (federation/coordinator/checkpoint_writer.py).

The real `Coordinator` with SecAgg+ over test_secagg_workflow's fake Grid, `background_checkpoints`
on as `Coordinator.run` sets it; the checkpoint store's real `save` is held back by an event, so
what happens while it writes is seen from recorded events, never from timings: the round returns
before its checkpoint is written, its metrics line appears only after it, the next round's
aggregation waits for it, and the checkpoint holds the model of its own round bit for bit.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from federation.coordinator.checkpoint import CheckpointError
from federation.protocol.downlink_steps import model_digest
from test_secagg_workflow import _task_identity, make  # noqa: F401 (autouse fixture)


def _lines(coord) -> list[dict]:
    path = coord.metrics_path
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_the_checkpoint_is_written_while_the_next_round_runs_and_before_it_aggregates(tmp_path):
    coord, _ = make(tmp_path, n=3, secagg={"threshold": 2})
    coord.background_checkpoints = True
    events: list[str] = []
    release, settling = threading.Event(), threading.Event()
    real_save, real_settle = coord.checkpoints.save, coord.wait_for_checkpoint
    real_aggregate = coord.protocol.aggregate_masked_input

    def save(rnd, arrays, state):
        release.wait(60)
        path = real_save(rnd, arrays, state)
        events.append(f"saved {rnd}")
        return path

    def settle():
        if coord.checkpoint_writer.busy:
            events.append("settle")
            settling.set()
        real_settle()

    def aggregate(st, result):
        events.append(f"aggregate {st.inp.round}")
        real_aggregate(st, result)

    coord.checkpoints.save, coord.wait_for_checkpoint = save, settle
    coord.protocol.aggregate_masked_input = aggregate

    line1 = coord.run_round(1)
    model1 = {k: v.copy() for k, v in coord.model.items()}
    # round 1 is over, its checkpoint and metrics line are not written yet
    assert line1["status"] == "aggregated" and coord.checkpoint_writer.busy
    assert not coord.checkpoints.rounds() and _lines(coord) == []
    assert events == ["aggregate 1"]

    second = threading.Thread(target=lambda: events.append(coord.run_round(2)["status"]))
    second.start()
    assert settling.wait(60), events
    assert events == ["aggregate 1", "settle"]  # round 2's replies are in; it waits before aggregating them
    release.set()
    second.join(60)
    assert events[:4] == ["aggregate 1", "settle", "saved 1", "aggregate 2"], events
    # round 2's own checkpoint goes on the writer's thread as run_round(2) returns: either comes first
    assert sorted(events[4:]) in (["aggregated"], ["aggregated", "saved 2"]), events
    coord.wait_for_checkpoint()
    assert events[4:].count("saved 2") == 1, events
    assert coord.checkpoints.rounds() == [2, 1]
    # the checkpoint of round 1 holds round 1's model (round 2 changed it in memory afterwards)
    ckpt = coord.checkpoints.load(1)
    assert ckpt.state["model_digest"] == model_digest(model1) and ckpt.state["round"] == 1
    assert all(np.array_equal(ckpt.arrays["model"][k], model1[k]) for k in model1)
    assert any(not np.array_equal(coord.model[k], model1[k]) for k in model1)
    assert [m["round"] for m in ckpt.state["metrics"]] == [1]
    # each metrics line was written after its checkpoint, with the write's own seconds
    lines = _lines(coord)
    assert [x["round"] for x in lines] == [1, 2] and all(x["timing"]["checkpoint_s"] >= 0 for x in lines)
    assert line1["timing"]["checkpoint_s"] == lines[0]["timing"]["checkpoint_s"]  # told to the history at the wait
    assert "checkpoint_wait_s" in lines[1]["timing"]


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path):
    coord, _ = make(tmp_path, n=3, secagg={"threshold": 2})
    coord.background_checkpoints = True

    def save(rnd, arrays, state):
        raise CheckpointError("disk full (test)")

    coord.checkpoints.save = save
    assert coord.run_round(1)["status"] == "aggregated"
    with pytest.raises(CheckpointError, match="disk full"):
        coord.wait_for_checkpoint()
    assert _lines(coord) == []  # no metrics line for a round without a checkpoint
    coord.wait_for_checkpoint()  # raised once
