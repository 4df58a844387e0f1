"""What the deployment tests share: system packages installed on demand, a PKI for a federation,
and cleanup that runs whatever happened.

The tests install what they need with apt themselves (CI runs them on a fresh root machine);
where that cannot be done (not root, no apt) they skip and say why. apt runs under a file lock,
since pytest-xdist may start both deployment files at once, and only when a tool is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = Path("/var/lock/sovfl-deploy-tests.lock")


def _absent(cmd: str) -> bool:
    return not Path(cmd).exists() if cmd.startswith("/") else shutil.which(cmd) is None


def need_packages(tools: dict[str, str]) -> None:
    """Make every command (or absolute path) of `tools` (-> its Debian package) available, installing
    the missing packages with apt; skip the test, with the reason, where that cannot be done."""
    missing = {cmd: pkg for cmd, pkg in tools.items() if _absent(cmd)}
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"needs root to install {sorted(set(missing.values()))} with apt (missing: {sorted(missing)})")
    if shutil.which("apt-get") is None:
        pytest.skip(f"no apt-get to install {sorted(set(missing.values()))} (missing: {sorted(missing)})")
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another xdist worker may be installing
        missing = {cmd: pkg for cmd, pkg in missing.items() if _absent(cmd)}
        if not missing:
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-q"],
                     ["apt-get", "install", "-y", "-q", *sorted(set(missing.values()))]):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            if proc.returncode != 0:
                pytest.fail(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    still = [cmd for cmd in tools if _absent(cmd)]
    assert not still, f"installed {sorted(set(tools.values()))} but still missing {still}"


def sovfl_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The project's CLI from this checkout, to completion."""
    proc = subprocess.run([sys.executable, "-m", "federation.ops.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **(env or {})},
                          timeout=timeout)
    assert proc.returncode == 0, f"sovfl {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
    return proc


def run(argv: list[str], timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """A command to completion, output captured; a failure shows its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@contextlib.contextmanager
def cleanup():
    """Collects teardown actions and runs all of them, last first, even when one fails."""
    actions: list = []
    try:
        yield actions.append
    finally:
        for action in reversed(actions):
            with contextlib.suppress(Exception):
                action()
