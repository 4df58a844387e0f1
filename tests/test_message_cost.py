"""A message's seconds outside the link and the training (federation/protocol/message_cost.py):
the site's stamps, the coordinator's split, and the metrics line of a real in-process round."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
from flwr.app import RecordDict

from federation.ops.inprocess import FunctionTrainer, InProcessSite, task_identity
from federation.protocol import message_cost
from federation.protocol import message_keys as keys

from benchmarks._fedsim import RUN_ID, coordinator

PARTS = ("launch_s", "startup_s", "handler_s", "return_s")


def test_a_process_start_is_read_from_proc_between_its_spawn_and_its_exit():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from federation.protocol.message_cost import process_start_wall as p; "
                          "print(repr(p()))"], capture_output=True, text=True, check=True)
    after = time.time()
    started = float(out.stdout)
    assert before - 0.05 <= started <= after  # clock ticks are 10 ms
    assert message_cost.process_start_wall() < before  # this process is older


def test_the_split_adds_up_to_the_coordinators_wait():
    content = RecordDict()
    message_cost.stamp(content, handler_start=1000.0, handler_end=1002.5, app_import_s=0.3)
    rec = content.metric_records[keys.MSG_COST]
    rec["process_start"] = 999.0  # a known process start
    cost = message_cost.split(content, pushed=996.0, pulled=1003.0)
    assert cost == {"total_s": 7.0, "launch_s": 3.0, "startup_s": 1.0, "handler_s": 2.5, "return_s": 0.5,
                    "app_import_s": 0.3, "executor": "subprocess", "packed": 0.0}
    del rec["process_start"]  # no /proc on the site: launch and startup together
    assert message_cost.split(content, 996.0, 1003.0) == {"total_s": 7.0, "launch_s": 4.0, "handler_s": 2.5,
                                                           "return_s": 0.5, "executor": "subprocess", "packed": 0.0}
    assert message_cost.split(RecordDict(), 996.0, 1003.0) == {"total_s": 7.0}  # an unstamped reply


def test_a_warm_workers_message_starts_when_it_was_handed_the_task(monkeypatch):
    """A warm worker's process is older than its message: the split starts at the hand-off, its own
    imports (paid before) are not the message's, and the split names the executor."""
    monkeypatch.setenv(message_cost.TASK_START_ENV, "999.5")
    content = RecordDict()
    message_cost.stamp(content, handler_start=1000.0, handler_end=1002.5, app_import_s=0.3)
    cost = message_cost.split(content, pushed=996.0, pulled=1003.0)
    assert cost == {"total_s": 7.0, "launch_s": 3.5, "startup_s": 0.5, "handler_s": 2.5, "return_s": 0.5,
                    "app_import_s": 0.0, "executor": "warm", "packed": 0.0}
    content.metric_records[keys.MSG_COST]["packed"] = 1.0  # the site's pack mod: the message came packed
    packed = message_cost.split(content, pushed=996.0, pulled=1003.0)
    assert packed["packed"] == 1.0
    stages = [{"messages": {"a": cost, "b": {**cost, "executor": "subprocess"}}}, {"messages": {"a": packed}}]
    summary = message_cost.per_site(stages)
    assert summary["a"]["executors"] == {"warm": 2} and summary["a"]["messages"] == 2
    assert summary["a"]["packed"] == 0.5  # the share of a's messages that came packed
    assert summary["b"]["executors"] == {"subprocess": 1} and summary["b"]["startup_s"] == 0.5


def test_a_rounds_metrics_line_splits_each_sites_messages(tmp_path):
    shapes = {"w": (12, 8), "b": (8,)}
    model = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    trainers = [FunctionTrainer(lambda glob, cfg: ({k: np.ones_like(v) for k, v in glob.items()}, {"loss": 0.5}),
                                10, tmp_path / f"site{s}") for s in range(2)]
    sites = [InProcessSite(f"site{s}", s + 1, t, run_id=RUN_ID) for s, t in enumerate(trainers)]
    with task_identity(RUN_ID):
        coord = coordinator(tmp_path, model, sites, rounds=1)
        line = coord.run_round(1)
    assert line["status"] == "aggregated"
    train = [s for s in line["timing"]["stages"] if s.get("messages")]
    assert train and set(train[-1]["messages"]) == {"site0", "site1"}
    for cost in train[-1]["messages"].values():
        assert set(PARTS) <= set(cost) and "app_import_s" in cost
        assert abs(sum(cost[p] for p in PARTS) - cost["total_s"]) < 1e-3
        assert cost["handler_s"] >= 0 and cost["return_s"] >= 0
    summary = line["timing"]["message_cost"]
    assert set(summary) == {"site0", "site1"} and all(s["messages"] >= 1 for s in summary.values())
