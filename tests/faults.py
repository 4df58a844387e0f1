"""Fault injection against a running federation: find and SIGKILL the coordinator's processes.

Used by tests/test_e2e_resume.py and tests/fault_soak.py (`make soak`). Processes are found by the
run marker every child of `sovfl` carries (SOVFL_RUN_MARKER) and the pids.json of the workdir.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from federation.ops.launcher import marked_pids


def rounds_done(run: Path) -> list[int]:
    """The rounds in the run's metrics.jsonl, in order."""
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["round"] for x in path.read_text().splitlines() if x.strip().endswith("}")]


def coordinator_processes(run: Path, marker: str) -> list[tuple[int, bytes]]:
    """(pid, cmdline) of the SuperLink's process group (SuperLink, SuperExec) and every ServerApp."""
    leader = json.loads((Path(run) / "pids.json").read_text())["superlink"]
    out = []
    for pid in marked_pids(marker):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if os.getpgid(pid) == leader or b"flwr-serverapp" in cmd or b"superexec" in cmd:
                out.append((pid, cmd))
        except (OSError, ProcessLookupError):
            continue
    return out


def kill_coordinator(run: Path, marker: str) -> list[tuple[int, bytes]]:
    """SIGKILL the ServerApp and the SuperLink (with its SuperExec); what was killed."""
    victims = coordinator_processes(run, marker)
    for pid, _ in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


# ---- site side: a site's trainer rank and its SuperNode ---------------------------------

def signal_trainer(run: Path, site: str, sig: int) -> None:
    """Signal every process of a site's trainer pool (torchrun puts its ranks in their own sessions;
    a one-rank site is its one rank)."""
    needle = str(Path(run) / "sites" / site / "trainer.json").encode()
    hit = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), sig)
                    hit += 1
            except (OSError, ProcessLookupError):
                pass
    assert hit >= 1, f"found no trainer process for site {site}"


def _args(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")


def _marked_where(marker: str, match) -> list[int]:
    """Live processes of the run `marker` whose argument list satisfies `match`."""
    out = []
    for pid in marked_pids(marker):
        try:
            args = _args(pid)
        except OSError:
            continue
        if match(args):
            out.append(pid)
    return sorted(out)


def site_rank_pids(marker: str, site: str, node: int = 0) -> list[int]:
    """The trainer ranks of `site` on its node `node` (the processes torchrun started, not torchrun itself)."""
    suffix = f"sites/{site}/trainer{f'-node{node}' if node else ''}.json".encode()
    return _marked_where(marker, lambda args: b"site_trainer" in args and b"torch.distributed.run" not in args
                         and any(a.endswith(suffix) for a in args))


def supernode_pids(marker: str, site: str) -> list[int]:
    """The SuperNode process of `site` (its group also holds its SuperExec and ClientApps)."""
    needle = f'site-id="{site}"'.encode()
    return _marked_where(marker, lambda args: (any(a.endswith(b"flower-supernode") for a in args[:2])
                                               or b"federation.ops.supernode_main" in args[:3])
                         and any(needle in a for a in args))


def _kill_one(pids: list[int], what: str, rank: int = 0) -> int:
    if not pids:
        raise LookupError(f"no live {what} found")
    pid = pids[min(rank, len(pids) - 1)]
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_site_rank(marker: str, site: str, rank: int = 0, node: int = 0) -> int:
    """SIGKILL one trainer rank of `site` on its node `node` (the `rank`-th by pid); its pid."""
    return _kill_one(site_rank_pids(marker, site, node), f"trainer rank of site {site} node {node}", rank)


def kill_supernode(marker: str, site: str) -> int:
    """SIGKILL the SuperNode of `site` (only that process, as a crash would); its pid."""
    return _kill_one(supernode_pids(marker, site), f"SuperNode of site {site}")


def wait_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
    """Wait up to `timeout_s` for every process carrying `marker` to exit; those still alive."""
    end = time.monotonic() + timeout_s
    while (left := marked_pids(marker)) and time.monotonic() < end:
        time.sleep(0.5)
    return left


def wait_rounds(run: Path, rounds: list[int], proc, timeout_s: float = 400.0) -> None:
    """Block until the run's metrics.jsonl holds exactly `rounds`; fail if `proc` exits or time runs out."""
    end = time.monotonic() + timeout_s
    while rounds_done(run) != rounds:
        if proc.poll() is not None:
            raise AssertionError(f"the run exited with code {proc.returncode} before rounds {rounds}: "
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        if time.monotonic() > end:
            raise AssertionError(f"rounds {rounds} not done within {timeout_s:.0f}s")
        time.sleep(0.1)


# ---- kills inside a given stage (the coordinator's test hook, federation/protocol/testing_hooks.py) ----


def stage_hook_env(hook_file: Path, pause: str = "") -> dict[str, str]:
    """Environment that makes the ServerApp announce every stage it enters to `hook_file` and, with
    `pause` ("<round>:<stage prefix>", e.g. "2:secagg stage 4"), wait there to be killed."""
    from federation.protocol import testing_hooks

    env = {testing_hooks.STAGE_HOOK: str(hook_file)}
    if pause:
        env[testing_hooks.STAGE_PAUSE] = pause
    return env


def stage_entries(hook_file: Path) -> list[dict]:
    """The stages the coordinator announced, in order (complete lines only)."""
    path = Path(hook_file)
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def wait_for_stage(hook_file: Path, rnd: int, stage: str, alive, timeout_s: float = 400.0) -> dict:
    """Block until the coordinator announces entering the stage of round `rnd` whose name starts with
    `stage`; its entry. `alive()` False (the run ended) or the timeout fail the wait."""
    import time

    t0 = time.monotonic()
    while True:
        hits = [e for e in stage_entries(hook_file) if e["round"] == rnd and e["stage"].startswith(stage)]
        if hits:
            return hits[0]
        if not alive():
            raise AssertionError(f"the run ended before round {rnd} entered {stage!r}: {stage_entries(hook_file)}")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"round {rnd} did not enter {stage!r} within {timeout_s:.0f}s")
        time.sleep(0.05)


def release_stage(hook_file: Path) -> None:
    """Let a coordinator paused by SOVFL_TEST_STAGE_PAUSE go on at once."""
    Path(str(hook_file) + ".release").touch()


def wait_site_back(marker: str, site: str, socket: Path, since: float, nnodes: int = 1,
                   timeout_s: float = 300.0) -> None:
    """Block until `site`'s trainer pool was started again after `since` (time.time()) and serves:
    its node 0 wrote `socket`.ready since then and every node has a live rank."""
    ready = Path(str(socket) + ".ready")
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(FileNotFoundError):
            if ready.stat().st_mtime > since and all(site_rank_pids(marker, site, n) for n in range(nnodes)):
                return
        time.sleep(0.2)
    raise AssertionError(f"site {site}'s trainer did not serve again within {timeout_s:.0f}s")


def supernode_starts(run: Path, site: str) -> int:
    """How many times `site`'s SuperNode has connected to the SuperLink in the run `run`: the lines
    Flower's SuperNode logs once its node is activated ("SuperNode ID: ...")."""
    log = run / "logs" / f"site-{site}-supernode.log"
    return log.read_text(errors="replace").count("SuperNode ID:") if log.exists() else 0


def wait_supernode_back(run: Path, site: str, before: int, timeout_s: float = 300.0) -> None:
    """Block until `site`'s restarted SuperNode is active at the SuperLink: it connected more than
    the `before` times counted before it was killed. A new process alone is not enough: a message
    sent before its node is active is answered "Node Unavailable"."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if supernode_starts(run, site) > before:
            return
        time.sleep(0.2)
    raise AssertionError(f"site {site}'s SuperNode did not connect again within {timeout_s:.0f}s")


def wait_metrics_line(path: Path, n: int, proc: subprocess.Popen, timeout: float) -> list[dict]:
    """The run's metrics lines once there are at least `n`; fails if `proc` exits first or at the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            lines = path.read_text().splitlines()
            if len(lines) >= n:
                return [json.loads(x) for x in lines]
        if proc.poll() is not None:
            raise AssertionError(f"sovfl exited early (code {proc.returncode}) before metrics line {n}:\n"
                                 + output_of(proc))
        time.sleep(0.1)
    raise AssertionError(f"no metrics line {n} within {timeout}s")


def output_of(proc: subprocess.Popen, timeout_s: float = 10.0) -> str:
    """What an ended `proc` wrote, for a failure message; bounded, since a process it started may
    still hold its pipe open."""
    try:
        return proc.communicate(timeout=timeout_s)[0] or ""
    except subprocess.TimeoutExpired:
        return f"(its output did not end within {timeout_s:.0f}s: a process it started still holds it)"
