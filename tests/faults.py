"""Fault injection against a running federation: find and SIGKILL the coordinator's processes.

Used by tests/test_e2e_resume.py and tests/fault_soak.py (`make soak`). Processes are found by the
run marker every child of `sovfl` carries (SOVFL_RUN_MARKER) and the pids.json of the workdir.
"""

from __future__ import annotations

import json
import os
import signal
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
