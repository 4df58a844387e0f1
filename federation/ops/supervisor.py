"""Child processes we start and must leave none of behind: each in its own process group, with a
marker in its environment that finds every descendant (torchrun's ranks, Flower's ServerApp) when
the group is not enough. Used by the launcher (simulate, coordinator, site) and the site supervisor.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from federation.ops.bytecode import ensure_compiled

MARKER = "SOVFL_RUN_MARKER"  # set by a caller (test, batch system) to find every descendant
OWNER = "SOVFL_SUPERVISOR"  # one per Supervisor: what its sweep kills, and nothing else


class LaunchError(RuntimeError):
    """A process could not be started or died; the message names it and points at its log."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.SystemRandom()  # independent of any seed a caller set: parallel runs pick apart


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where unreadable)."""
    try:
        lo, hi = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free on loopback now (for the SuperLink, SuperNodes and Runtime APIs we start),
    outside the kernel's ephemeral range: a port from that range can be taken between this pick and
    the server's bind by any outgoing connection, including a client that polls the port before its
    server listens (the kernel may connect such a client to itself, and then holds the port)."""
    lo, hi = _ephemeral_ports()
    below, above = range(10000, lo), range(hi + 1, 65536)
    ports = below if len(below) >= len(above) else above
    for _ in range(256 if len(ports) else 0):  # none outside the range: the kernel's choice
        port = _pick.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every pick taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """Console scripts from the interpreter's own environment (works without an activated venv)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log, for error messages that point at what went wrong."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class Proc:
    """A child process we started: its name, handle and log file."""

    name: str
    popen: subprocess.Popen
    log: Path
    grace_s: float = 10.0  # how long a SIGTERM may take before SIGKILL (a site's trackers write their last records)
    log_start: int = 0  # where its output begins in `log` (a restart appends to the same file)

    def alive(self) -> bool:
        """Whether it still runs."""
        return self.popen.poll() is None


@dataclass
class Supervisor:
    """Owns child processes; `close()` leaves none behind."""

    workdir: Path
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[Proc] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of every child: our bin first on PATH, telemetry off, this supervisor's marker."""
        env = dict(os.environ)
        # Flower's processes start helpers (flower-superexec, flwr-clientapp) by name: our
        # environment's bin directory must come first on PATH even when it is not activated.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update({OWNER: self.owner, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                    "FLWR_HOME": str(self.workdir / "flwr-home")})
        env.update(extra or {})
        return env

    def start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None,
              grace_s: float = 10.0) -> Proc:
        """Start a child in its own process group, output to logs/<name>.log; stopping it waits
        `grace_s` after SIGTERM."""
        ensure_compiled()  # children import our packages from bytecode, not source (ops/bytecode.py)
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with open(log, "ab") as out:
            start = out.tell()
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env(extra_env), cwd=self.workdir, start_new_session=True)
        proc = Proc(name, popen, log, grace_s, start)
        self.procs.append(proc)
        (self.workdir / "pids.json").write_text(json.dumps({p.name: p.popen.pid for p in self.procs}, indent=1))
        return proc

    def stop(self, proc: Proc, grace_s: float | None = None) -> None:
        """SIGTERM the process group, then SIGKILL after `grace_s` (default: the process's own)."""
        self.stop_all([proc], grace_s)

    def stop_all(self, procs: list[Proc], grace_s: float | None = None) -> None:
        """SIGTERM every group at once, wait for all under one deadline (default: the longest grace
        of `procs`), then SIGKILL what is left: a teardown costs the slowest child's shutdown, not
        the sum of them all."""
        if grace_s is None:
            grace_s = max((p.grace_s for p in procs), default=10.0)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
                os.killpg(proc.popen.pid, signal.SIGCONT)  # a stopped (hung) process must see the TERM
        end = time.monotonic() + grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.0, end - time.monotonic()))
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # stragglers in the group (e.g. superexec)
                os.killpg(proc.popen.pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5)

    def close(self) -> None:
        """Stop every child, then kill anything that still carries our marker (torchrun ranks)."""
        self.stop_all(list(reversed(self.procs)))
        self.procs.clear()
        end = time.monotonic() + 10.0  # a SIGKILLed process lingers until the kernel has run its exit
        while (left := marked_pids(self.owner, OWNER)) and time.monotonic() < end:
            for pid in left:  # anything that left its group (torchrun's ranks, the ServerApp)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def marked_pids(marker: str, var: str = MARKER) -> list[int]:
    """Live processes whose environment carries `var=marker`."""
    needle = f"{var}={marker}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    out.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return out
