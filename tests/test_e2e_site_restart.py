"""End to end: in one `sovfl simulate` run, site paris' trainer rank and site berlin's SuperNode are
SIGKILLed after round 1; the site supervisor (federation/ops/site_supervisor.py) restarts both by
itself, paris' ranks from its local checkpoint, and both sites contribute again: every round is in
metrics.jsonl once, the run ends ok with both sites in the last rounds, and nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, as_foreground, sovfl_popen, write_config
from faults import (kill_coordinator, kill_site_rank, kill_supernode, release_stage, site_rank_pids, stage_hook_env,
                    supernode_pids, supernode_starts, wait_for_stage, wait_gone, wait_rounds, wait_site_back,
                    wait_supernode_back)

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=180)]

ROUNDS = 4  # the last round is held until both sites are back (their restart time varies with load)


def _config(directory: Path, rounds: int = ROUNDS, round_s: float = 60) -> Path:
    site = {"ranks": 1, "local_steps": 3, "batch_size": 16, "lr": 0.1, "checkpoint_every": 1}
    return write_config(directory / "site_restart.yaml", {
        "federation": {"name": "siterestart", "rounds": rounds, "quorum": 1, "evaluate": False,
                       "deadlines": {"connect_s": 90, "round_s": round_s, "trainer_start_s": 120},
                       "site_restarts": {"max_restarts": 2, "backoff_s": 0.5}},
        "workload": {"task": "digits", "options": {"hidden": 16}},
        "sites": [{"id": name, "partition": i, **site} for i, name in enumerate(("paris", "berlin"))],
    })


def _cli(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "federation.ops.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, preexec_fn=as_foreground)


def _held_run(tmp_path: Path, marker: str, config: Path, pause: str, meanwhile, *args: str) -> tuple[Path, str]:
    """`sovfl simulate config` whose coordinator is held on entering `pause` ("<round>:<stage>",
    protocol/testing_hooks.py) until `meanwhile(run, hook, proc)`, called once round 1 is done, returns; the
    run directory and the output of the run, which must end with status 0."""
    run, hook = tmp_path / "run", tmp_path / "stages.jsonl"
    proc = sovfl_popen("simulate", str(config), *args, "--workdir", str(run),
                       env={"SOVFL_RUN_MARKER": marker, **stage_hook_env(hook, pause=pause)})
    try:
        wait_rounds(run, [1], proc)
        meanwhile(run, hook, proc)
        release_stage(hook)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    return run, out


def test_killed_site_rank_and_supernode_rejoin_by_themselves(tmp_path, marker):
    killed = {}

    def kill_and_wait(run: Path, hook: Path, proc: subprocess.Popen) -> None:
        starts = supernode_starts(run, "berlin")
        killed.update(rank=kill_site_rank(marker, "paris"), node=kill_supernode(marker, "berlin"))
        at = time.time()
        socket = json.loads((run / "sites" / "paris" / "trainer.json").read_text())["socket"]
        wait_site_back(marker, "paris", Path(socket), at)
        wait_supernode_back(run, "berlin", starts)

    run, out = _held_run(tmp_path, marker, _config(tmp_path), f"{ROUNDS}:train", kill_and_wait)
    rank, node = killed["rank"], killed["node"]
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
    assert wait_gone(marker) == []


def test_insecure_supernode_back_under_a_new_node_id(tmp_path, marker):
    """Under --insecure a restarted SuperNode has a new random key, hence a new node id. The
    coordinator asks that node who it is before the next round, keeps its claim on berlin while the
    old node is still online at the SuperLink (up to NODE_HOLD_S after its last heartbeat) and gives
    it berlin once the old node is offline: berlin trains in the last round. Round 3 is held until
    then, so the rounds do not run out first."""
    from federation.ops.site_supervisor import NODE_HOLD_S

    killed = {}

    def kill_and_wait(run: Path, hook: Path, proc: subprocess.Popen) -> None:
        killed["node"], at = kill_supernode(marker, "berlin"), time.monotonic()
        wait_for_stage(hook, 3, "train", lambda: proc.poll() is None)
        time.sleep(max(0.0, at + NODE_HOLD_S + 2 - time.monotonic()))  # the old node's heartbeat has expired

    run, out = _held_run(tmp_path, marker, _config(tmp_path, rounds=4, round_s=20), "3:train", kill_and_wait,
                         "--insecure")
    assert "site berlin: SuperNode restarted" in out and killed["node"] not in supernode_pids(marker, "berlin"), out
    back = re.search(r"site berlin is back as node (\d+) \(its node (\d+) is offline\)", out)
    assert back is not None and back[1] != back[2], out
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3, 4]
    assert set(lines[0]["sites"]) == set(lines[-1]["sites"]) == {"paris", "berlin"}, [x["failed"] for x in lines]
    assert any("berlin" not in x["sites"] for x in lines[1:3])  # rounds after the kill went on without it
    assert wait_gone(marker) == []


@pytest.mark.skipif(not os.environ.get("SOVFL_E2E_DEPLOY"), reason="about 4 more minutes of processes; "
                    "set SOVFL_E2E_DEPLOY=1")
def test_deployed_sites_follow_a_resumed_coordinator_without_a_manual_step(tmp_path, marker):
    """`sovfl coordinator` SIGKILLed after round 1 and restarted with --resume on the same port; the
    sites' `sovfl site` are left running: their supervisors see the SuperLink come back and restart
    their SuperNodes (flwr 1.41 SuperNodes kept across a SuperLink restart run no ClientApp)."""
    from federation.ops.launcher import free_port

    env = {**os.environ, "SOVFL_RUN_MARKER": marker, "FLWR_TELEMETRY_ENABLED": "0"}
    path, pki, port, coord_dir = _config(tmp_path, rounds=4), tmp_path / "pki", free_port(), tmp_path / "coord"
    prov = subprocess.run([sys.executable, "-m", "federation.ops.cli", "provision", str(pki), "--site", "paris",
                           "--site", "berlin"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert prov.returncode == 0, prov.stderr
    coordinator = ["coordinator", str(path), "--host", "127.0.0.1", "--port", str(port), "--workdir", str(coord_dir),
                   "--bundle", str(pki / "coordinator")]
    sites = [_cli("site", str(path), "--site", name, "--superlink", f"127.0.0.1:{port}", "--workdir",
                  str(tmp_path / name), "--bundle", str(pki / "sites" / name), env=env) for name in ("paris", "berlin")]
    coord = _cli(*coordinator, env=env)
    try:
        wait_rounds(coord_dir, [1], coord)
        assert kill_coordinator(coord_dir, marker)
        out, _ = coord.communicate(timeout=120)
        assert coord.returncode == 1, out
        time.sleep(3)  # the sites' probes see the SuperLink gone
        coord = _cli(*coordinator, "--resume", env=env)
        out, _ = coord.communicate(timeout=500)
        assert coord.returncode == 0 and "RESULT rounds=4" in out, out
        lines = [json.loads(x) for x in (coord_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["round"] for x in lines] == [1, 2, 3, 4]
        assert all(set(x["sites"]) == {"paris", "berlin"} for x in lines), [x.get("failed") for x in lines]
        for s in sites:
            s.send_signal(signal.SIGINT)
        outs = [s.communicate(timeout=60)[0] for s in sites]
        for o in outs:
            assert "is back after being unreachable; restarting the SuperNode" in o, o
    finally:
        for p in (coord, *sites):
            if p.poll() is None:
                p.kill()
    assert wait_gone(marker) == []
