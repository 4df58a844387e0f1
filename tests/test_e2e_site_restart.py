"""End to end: in one `sovfl simulate` run, site paris' trainer rank and site berlin's SuperNode are
SIGKILLed after round 1; the site supervisor (federation/ops/site_supervisor.py) restarts both by
itself, paris' ranks from its local checkpoint, and both sites contribute again: every round is in
metrics.jsonl once, the run ends ok with both sites in the last rounds, and nothing is left behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import live_marked, sovfl_popen, write_config
from faults import kill_site_rank, kill_supernode, rounds_done, site_rank_pids, supernode_pids

pytestmark = pytest.mark.e2e

ROUNDS = 7  # room for a restarted trainer (torch import, checkpoint load) to come back on a loaded machine


def _config(directory: Path) -> Path:
    site = {"ranks": 1, "local_steps": 3, "batch_size": 16, "lr": 0.1, "checkpoint_every": 1}
    return write_config(directory / "site_restart.yaml", {
        "federation": {"name": "siterestart", "rounds": ROUNDS, "quorum": 1, "evaluate": False,
                       "deadlines": {"connect_s": 90, "round_s": 60, "trainer_start_s": 120},
                       "site_restarts": {"max_restarts": 2, "backoff_s": 0.5}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": name, "partition": i, **site} for i, name in enumerate(("paris", "berlin"))],
    })


def test_killed_site_rank_and_supernode_rejoin_by_themselves(tmp_path, marker):
    run = tmp_path / "run"
    proc = sovfl_popen("simulate", str(_config(tmp_path)), "--workdir", str(run), env={"SOVFL_RUN_MARKER": marker})
    try:
        t0 = time.monotonic()
        while rounds_done(run) != [1]:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < 400, "round 1 did not finish"
            time.sleep(0.05)
        rank, node = kill_site_rank(marker, "paris"), kill_supernode(marker, "berlin")
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "site paris: trainer restarted" in out and "site berlin: SuperNode restarted" in out, out
    assert "deactivated at the SuperLink with the site's key" in out, out  # no 60 s wait for its heartbeat
    assert rank not in site_rank_pids(marker, "paris") and node not in supernode_pids(marker, "berlin")
    # paris' new ranks resumed from the local checkpoint of a round it trained
    log = (run / "logs" / "site-paris-trainer.log").read_text()
    assert "site paris: resumed from local checkpoint" in log, log[-3000:]

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(1, ROUNDS + 1))
    assert set(lines[0]["sites"]) == {"paris", "berlin"}
    after = lines[1:]  # the rounds after the kills
    for site in ("paris", "berlin"):
        back = [x["round"] for x in after if site in x["sites"] and x["status"] == "aggregated"]
        assert back, f"{site} never contributed again after its restart: {[(x['round'], x['failed']) for x in after]}"
        # once back, it stays back: every later round aggregates it
        assert all(site in x["sites"] for x in after if x["round"] >= back[0]), [x["sites"].keys() for x in after]
    assert set(lines[-1]["sites"]) == {"paris", "berlin"} and lines[-1]["status"] == "aggregated"
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["rounds"] == ROUNDS
    deadline = time.monotonic() + 30
    while live_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live_marked(marker) == []
