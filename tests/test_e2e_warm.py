"""End to end, the warm ClientApp executor (federation/ops/warm_executor.py) in a simulated
federation: every message is served by a worker forked from a warm parent; parents SIGKILLed while
idle and a worker SIGKILLed while it handles a message leave the run going (the round without that
site, counted) and the parents replaced."""

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


def parents_of(superexec: int) -> list[int]:
    """The live warm parents the SuperExec process `superexec` started."""
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
    warm parents are SIGKILLed, site b's trainer is stopped; once b's round-2 message is handed to a
    worker, that worker is SIGKILLed mid-message. Round 2 aggregates a alone and counts b as failed
    (Flower reports the crashed ClientApp once its task's heartbeat expires); round 3 has both sites
    again, every message of rounds 2 and 3 served by a worker forked from a warm parent (site a's
    from the parents started in place of the killed ones)."""
    cfg = {"federation": {"name": "warm", "rounds": 3, "quorum": 1, "warm_clientapps": 2,
                          "deadlines": {"connect_s": 120, "round_s": 150, "evaluate_s": 60, "trainer_start_s": 240}},
           "workload": {"task": "digits", "options": {"hidden": 16}},
           "sites": [digits_site(0, "wa", 1), digits_site(1, "wb", 1)]}
    path = write_config(tmp_path / "warm.yaml", cfg)
    run, hook = tmp_path / "run", tmp_path / "stages.jsonl"
    proc = sovfl_popen("simulate", str(path), "--workdir", str(run),
                       env={"SOVFL_RUN_MARKER": marker, **stage_hook_env(hook, pause="2:train")})
    stopped = False
    try:
        wait_for_stage(hook, 2, "train", alive=lambda: proc.poll() is None)
        pids = json.loads((run / "pids.json").read_text())
        # the sites' SuperNodes ask for their next message soon after a reply (federation/ops/supernode_main.py)
        assert b"federation.ops.supernode_main" in Path(f"/proc/{pids['site-wa-supernode']}/cmdline").read_bytes()
        a_log, b_log = (run / "logs" / f"site-{s}-superexec.log" for s in ("wa", "wb"))
        idle_a = sorted(parents_of(pids["site-wa-superexec"]))
        assert idle_a, "site a's SuperExec has no warm parent"
        for pid in idle_a:
            os.kill(pid, signal.SIGKILL)
        signal_trainer(run, "wb", signal.SIGSTOP)
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
        signal_trainer(run, "wb", signal.SIGCONT)
        stopped = False
        out, _ = proc.communicate(timeout=600)
    finally:
        if stopped:
            signal_trainer(run, "wb", signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            out = output_of(proc)
    # the killed worker's hand-off file (its global model in /dev/shm) stays, as a crashed flwr-clientapp's does
    for left in Path("/dev/shm").glob(f"sovfl-wb-*-{busy}-*"):
        left.unlink()
    assert proc.returncode == 0, out
    r1, r2, r3 = (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    assert set(r1["sites"]) == {"wa", "wb"} and set(r3["sites"]) == {"wa", "wb"}, out
    assert r2["status"] == "aggregated" and set(r2["sites"]) == {"wa"} and "wb" in r2["failed"], r2.get("failed")
    for line in (r1, r2, r3):
        served = {site: cost.get("executors") for site, cost in line["timing"]["message_cost"].items()}
        assert all(set(s) == {"warm"} for s in served.values() if s), served
        assert set(served) >= ({"wa"} if line is r2 else {"wa", "wb"}), served
        packed = {site: cost.get("packed") for site, cost in line["timing"]["message_cost"].items()}
        assert all(share == 1.0 for share in packed.values()), packed  # every message and reply, as one object
    a_text, b_text = a_log.read_text(errors="replace"), b_log.read_text(errors="replace")
    for pid in idle_a:
        assert re.search(rf"parent \(pid {pid}\) exited with code -9( before it was ready)?.*; starting another", a_text)
    assert re.search(rf"worker \(pid {busy}\) serving task \d+ exited with code -9", b_text), b_text[-3000:]
    assert "cannot start" not in a_text + b_text
    assert "sleeps as Flower ships it" not in (run / "logs" / "site-wa-supernode.log").read_text(errors="replace")
    assert len(set(handed(a_log))) == len(handed(a_log))  # one task per worker
    assert not set(handed(a_log)) & set(idle_a)  # parents fork, never serve
    assert live_marked(marker) == []


def test_two_runs_back_to_back_on_one_site_share_no_worker(tmp_path, marker):
    """`sovfl site` for two sites, then two coordinators one after the other on the same port: two
    Flower runs of two federations (other names, hence other SecAgg+ contexts, pairwise keys and
    masks) served by the same SuperExecs and pools. Both runs aggregate every round with both sites,
    every message is served warm, and no worker serves more than one message (nothing of run one
    can reach run two: its keys lived in workers that are gone, forked from a parent that never
    runs a task)."""
    import subprocess
    import sys

    from conftest import ROOT, as_foreground
    from faults import wait_rounds
    from federation.ops.launcher import free_port

    def cfg(name: str) -> dict:
        return {"federation": {"name": name, "rounds": 2, "quorum": 3, "warm_clientapps": 2,
                               "secagg": {"enabled": True, "threshold": 2},
                               "deadlines": {"connect_s": 120, "round_s": 120, "evaluate_s": 60, "secagg_stage_s": 60}},
                "workload": {"task": "digits", "options": {"hidden": 8}},
                "sites": [digits_site(i, n, 1) for i, n in enumerate(("ra", "rb", "rc"))]}

    port, env = free_port(), {**os.environ, "SOVFL_RUN_MARKER": marker, "FLWR_TELEMETRY_ENABLED": "0"}
    paths = [write_config(tmp_path / f"{n}.yaml", cfg(n)) for n in ("one", "two")]
    pki = tmp_path / "pki"
    cli = [sys.executable, "-m", "federation.ops.cli"]
    prov = subprocess.run([*cli, "provision", str(pki), "--site", "ra", "--site", "rb", "--site", "rc"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert prov.returncode == 0, prov.stderr

    def popen(*args: str) -> subprocess.Popen:
        return subprocess.Popen([*cli, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env, preexec_fn=as_foreground)

    sites = [popen("site", str(paths[0]), "--site", s, "--superlink", f"127.0.0.1:{port}", "--workdir",
                   str(tmp_path / s), "--socket", str(tmp_path / f"{s}.sock"), "--bundle", str(pki / "sites" / s))
             for s in ("ra", "rb", "rc")]
    coords = []
    try:
        for i, path in enumerate(paths):
            coord = popen("coordinator", str(path), "--host", "127.0.0.1", "--port", str(port), "--workdir",
                          str(tmp_path / f"coord{i}"), "--bundle", str(pki / "coordinator"))
            coords.append(coord)
            wait_rounds(tmp_path / f"coord{i}", [1, 2], coord, timeout_s=600)
            out, _ = coord.communicate(timeout=120)
            assert coord.returncode == 0 and "RESULT rounds=2" in out, out
            time.sleep(5)  # the sites' link watch sees the SuperLink gone before the next one starts
        superexecs = {s: json.loads((tmp_path / s / "pids.json").read_text())[f"site-{s}-superexec"] for s in ("ra", "rb", "rc")}
        for s in sites:
            assert s.poll() is None
            s.send_signal(signal.SIGINT)
        for s in sites:
            s.communicate(timeout=60)
    finally:
        for p in (*coords, *sites):
            if p.poll() is None:
                p.kill()
    for i in range(2):
        lines = [json.loads(x) for x in (tmp_path / f"coord{i}" / "metrics.jsonl").read_text().splitlines()]
        assert [sorted(x["sites"]) for x in lines] == [["ra", "rb", "rc"]] * 2
        for line in lines:
            assert all(set(c.get("executors", {"warm": 1})) == {"warm"}
                       for c in line["timing"]["message_cost"].values()), line["timing"]["message_cost"]
    for s in ("ra", "rb", "rc"):
        log = (tmp_path / s / "logs" / f"site-{s}-superexec.log").read_text(errors="replace")
        pids = handed(tmp_path / s / "logs" / f"site-{s}-superexec.log")
        assert len(pids) >= 2 * 2 * 2 and len(set(pids)) == len(pids), pids  # two runs x two rounds x two messages
        assert log.count("warm ClientApp parent(s) (pid") == 1  # one pool, started once, served both runs
        assert superexecs[s] == json.loads((tmp_path / s / "pids.json").read_text())[f"site-{s}-superexec"]
    assert live_marked(marker) == []
