"""What the deployment tests share: system packages installed on demand (system_packages.py), the
project's CLI, and cleanup that runs whatever happened."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from system_packages import need_packages  # noqa: F401 - the deployment tests' installer

ROOT = Path(__file__).resolve().parents[1]


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
