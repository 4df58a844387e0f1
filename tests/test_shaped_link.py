"""The shaped-link harness (benchmarks/shaped_link/): real namespaces, veth, tbf and the delay relay.

Needs root (skipped otherwise, with the reason); iproute2 is installed when missing. The assertions on time are one-sided,
so a loaded machine cannot fail them: the delay line never releases a byte early (RTT >= nominal,
less the relay's timer resolution)
and the token bucket never lets more through than its rate; the figures within 10% of nominal
are benchmarks/shaped_link_check.py's to report.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.shaped_link import ShapedLink  # noqa: E402
from benchmarks.shaped_link.check import TargetServer, measure  # noqa: E402

pytestmark = pytest.mark.usefixtures("shaped_links")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


class EchoUntilEof:
    """Echoes every byte back, closes after the client's EOF (half-close) once all is echoed."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        got = bytearray()
        reader = threading.Thread(target=lambda: [got.extend(c) for c in iter(lambda: sock.recv(1 << 16), b"")])
        reader.start()
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        reader.join(60)
    return bytes(got)


def test_bytes_cross_intact_both_ways_over_several_connections_and_targets():
    echo_a, echo_b = EchoUntilEof(), EchoUntilEof()
    payloads = [os.urandom(1 << 20) for _ in range(3)]
    with ShapedLink(rate_mbit=50, rtt_ms=10) as link:
        names = _namespaces()
        assert link.site_ns in names and link.coord_ns in names
        qdisc = subprocess.run(["tc", "-n", link.site_ns, "qdisc", "show", "dev", f"{link.name}s"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc, qdisc
        ports = [link.forward(echo_a.address), link.forward(echo_b.address)]
        assert ports[0] != ports[1] and link.forward(echo_a.address) == ports[0]
        results: dict[int, bytes] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _roundtrip(ports[i % 2], payloads[i])))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, payload in enumerate(payloads):
            assert hashlib.sha256(results[i]).digest() == hashlib.sha256(payload).digest(), f"connection {i}"
        relays = list(link._relays)
    # gone afterwards: namespaces (with the veth pair and the qdiscs) and the relay processes
    names = _namespaces()
    assert link.site_ns not in names and link.coord_ns not in names
    assert relays and all(p.poll() is not None for p in relays)


def test_the_link_is_never_faster_than_nominal_nor_its_rtt_shorter():
    server = TargetServer()
    try:
        with ShapedLink(rate_mbit=40, rtt_ms=20, down_mbit=80) as link:
            m = measure(link.forward(server.address), 80, seconds=0.5, pings=10)
    finally:
        server.close()
    assert m.rtt_ms >= 20.0 - 1.0  # each way's half is held that long, to the relay's +-0.5 ms
    assert m.up_mbit <= 1.05 * 40 and m.down_mbit <= 1.05 * 80  # the token buckets, each way
    assert m.down_mbit > m.up_mbit  # the asymmetric link is shaped per direction


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="rate must be positive"):
        ShapedLink(rate_mbit=0, rtt_ms=10)
    with pytest.raises(ValueError):
        ShapedLink(rate_mbit=10, rtt_ms=-1)


def test_grpc_calls_cross_the_link_as_flower_s_do():
    """What the sites' SuperNodes speak to the SuperLink: gRPC (HTTP/2) on one long-lived connection."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "probe", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request[::-1])}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with ShapedLink(rate_mbit=50, rtt_ms=10) as link:
            local = link.forward(("127.0.0.1", port))
            with grpc.insecure_channel(f"127.0.0.1:{local}") as channel:
                echo = channel.unary_unary("/probe/Echo")
                big = os.urandom(3 << 20)
                assert echo(big, timeout=60) == big[::-1]
                for i in range(5):  # small calls on the open connection: each one round trip at least
                    t = time.perf_counter()
                    assert echo(bytes([i]) * 10, timeout=30) == bytes([i]) * 10
                    assert time.perf_counter() - t >= 0.010 - 0.001
    finally:
        server.stop(None)
