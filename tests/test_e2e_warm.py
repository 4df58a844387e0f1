"""End to end, the warm ClientApp executor (federation/ops/warm_executor.py) in a simulated
federation: every message is served by a warm worker; workers SIGKILLed while idle and one
SIGKILLed while it handles a message leave the run going (the round without that site, counted)
and the pools refilled."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import digits_site, live_marked, sovfl_popen, write_config
from faults import output_of, release_stage, signal_trainer, stage_hook_env, wait_for_stage

pytestmark = [pytest.mark.e2e, pytest.mark.slow(seconds=240)]

HANDED = re.compile(r"task \d+ handed to worker pid (\d+)")


def handed(log: Path) -> list[int]:
    """The workers the site's SuperExec handed a task to, in order."""
    return [int(m.group(1)) for m in HANDED.finditer(log.read_text(errors="replace"))] if log.exists() else []


def workers_of(superexec: int) -> list[int]:
    """The live warm workers the SuperExec process `superexec` started."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == superexec and stat[0] != "Z" and b"warm_worker" in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def has_unix_socket(pid: int) -> bool:
    """Whether `pid` holds a Unix socket: a worker's connection to its trainer (an idle one has none)."""
    unix = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:] if len(line.split()) > 6}
    try:
        fds = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False
    return any(fd.startswith("socket:[") and fd[8:-1] in unix for fd in fds)


def test_warm_workers_serve_every_message_and_survive_kills(tmp_path, marker):
    """Round 1: every message served warm. Paused before round 2 (no message in flight): site a's
    idle workers are SIGKILLed, site b's trainer is stopped; once b's round-2 message is handed to a
    worker, that worker is SIGKILLed mid-message. Round 2 aggregates a alone and counts b as failed
    (Flower reports the crashed ClientApp once its task's heartbeat expires); round 3 has both sites
    again, every message of rounds 2 and 3 served by a warm worker from the refilled pools."""
    cfg = {"federation": {"name": "warm", "rounds": 3, "quorum": 1, "warm_clientapps": 2,
                          "deadlines": {"connect_s": 120, "round_s": 150, "evaluate_s": 60, "trainer_start_s": 240}},
           "workload": {"task": "digits", "options": {"hidden": 16}},
           "sites": [digits_site(0, "a", 1), digits_site(1, "b", 1)]}
    path = write_config(tmp_path / "warm.yaml", cfg)
    run, hook = tmp_path / "run", tmp_path / "stages.jsonl"
    proc = sovfl_popen("simulate", str(path), "--workdir", str(run),
                       env={"SOVFL_RUN_MARKER": marker, **stage_hook_env(hook, pause="2:train")})
    stopped = False
    try:
        wait_for_stage(hook, 2, "train", alive=lambda: proc.poll() is None)
        pids = json.loads((run / "pids.json").read_text())
        a_log, b_log = (run / "logs" / f"site-{s}-superexec.log" for s in ("a", "b"))
        idle_a = sorted(set(workers_of(pids["site-a-superexec"])) - set(handed(a_log)))
        assert idle_a, "site a's SuperExec has no idle warm worker"
        for pid in idle_a:
            os.kill(pid, signal.SIGKILL)
        signal_trainer(run, "b", signal.SIGSTOP)
        stopped = True
        seen_b = len(handed(b_log))
        release_stage(hook)
        end = time.monotonic() + 120
        while len(handed(b_log)) == seen_b:
            assert time.monotonic() < end and proc.poll() is None, "site b's round-2 message reached no worker"
            time.sleep(0.05)
        busy = handed(b_log)[seen_b]
        while not has_unix_socket(busy):  # in its trainer call (a task killed before it ran is run again)
            assert time.monotonic() < end and proc.poll() is None, "site b's worker never called its trainer"
            time.sleep(0.05)
        os.kill(busy, signal.SIGKILL)
        signal_trainer(run, "b", signal.SIGCONT)
        stopped = False
        out, _ = proc.communicate(timeout=600)
    finally:
        if stopped:
            signal_trainer(run, "b", signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            out = output_of(proc)
    assert proc.returncode == 0, out
    r1, r2, r3 = (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    assert set(r1["sites"]) == {"a", "b"} and set(r3["sites"]) == {"a", "b"}, out
    assert r2["status"] == "aggregated" and set(r2["sites"]) == {"a"} and "b" in r2["failed"], r2.get("failed")
    for line in (r1, r2, r3):
        served = {site: cost.get("executors") for site, cost in line["timing"]["message_cost"].items()}
        assert all(set(s) == {"warm"} for s in served.values() if s), served
        assert set(served) >= ({"a"} if line is r2 else {"a", "b"}), served
    a_text, b_text = a_log.read_text(errors="replace"), b_log.read_text(errors="replace")
    for pid in idle_a:
        assert re.search(rf"worker \(pid {pid}\) exited with code -9( before it was ready)?.*; starting another", a_text)
    assert re.search(rf"worker \(pid {busy}\) serving task \d+ exited with code -9", b_text), b_text[-3000:]
    assert "cannot start" not in a_text + b_text
    assert len(set(handed(a_log))) == len(handed(a_log))  # one task per worker
    assert live_marked(marker) == []
