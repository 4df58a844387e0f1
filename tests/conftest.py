"""Shared fixtures: e2e runs of `sovfl simulate` as a real subprocess tree on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sovfl(*args: str, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "federation.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=ROOT, **kw)


@pytest.fixture
def marker() -> str:
    return uuid.uuid4().hex


def live_marked(marker: str) -> list[int]:
    from federation.launcher import marked_pids

    return marked_pids(marker)
