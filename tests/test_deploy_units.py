"""The deployment pieces that need no container runtime: `sovfl health` against real sockets."""

from __future__ import annotations

import socket

from conftest import sovfl
from federation.ops.health_cmd import tcp_accepts, unix_accepts


def test_health_checks_real_sockets(tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert tcp_accepts(f"127.0.0.1:{port}", 2.0)
    assert not tcp_accepts(f"127.0.0.1:{port}", 2.0)  # closed now
    path = tmp_path / "sovfl-x-1.sock"
    assert not unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(path))
        srv.listen()
        assert unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)
    assert not unix_accepts(str(tmp_path / "sovfl-*.sock"), 1.0)  # a stale socket file is not health
    proc = sovfl("health", "--tcp", f"127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 1 and f"tcp 127.0.0.1:{port} does not accept" in proc.stderr
