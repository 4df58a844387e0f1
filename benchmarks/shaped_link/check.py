"""Measure what a shaped link gives: its rate each way (a bulk TCP transfer) and its RTT (ping-pong).

Plain Python sockets on both ends (nothing to install): a server on the host's loopback is the
link's target, a client goes through the link's local port. The rate is the receiver's: bytes
after the first chunk over the time from the first chunk to the last, so neither connection set-up
nor the one-way delay counts; the RTT is the median of small request/response exchanges on one
connection.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

BUF = 1 << 20


@dataclass(frozen=True)
class Measured:
    up_mbit: float
    down_mbit: float
    rtt_ms: float

    def within(self, rate_mbit: float, rtt_ms: float, tolerance: float = 0.10, down_mbit: float | None = None) -> list[str]:
        """What is off by more than `tolerance` (relative) from nominal; empty when the link is as asked."""
        off = []
        for what, got, want in (("uplink Mbit/s", self.up_mbit, rate_mbit),
                                ("downlink Mbit/s", self.down_mbit, down_mbit or rate_mbit),
                                ("RTT ms", self.rtt_ms, rtt_ms)):
            if abs(got - want) > tolerance * want:
                off.append(f"{what} {got:.1f} vs nominal {want:g} (more than {tolerance:.0%} off)")
        return off


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the link closed mid-message")
        out += chunk
    return bytes(out)


def _sink(sock: socket.socket, n: int) -> tuple[float, int]:
    """Receive n bytes; (seconds from the end of the first chunk to the last byte, bytes in that time)."""
    buf = memoryview(bytearray(BUF))
    got = first_bytes = 0
    t_first = 0.0
    while got < n:
        k = sock.recv_into(buf, min(BUF, n - got))
        if not k:
            raise ConnectionError("the link closed mid-transfer")
        if not got:
            t_first, first_bytes = time.perf_counter(), k
        got += k
    return time.perf_counter() - t_first, n - first_bytes


def _source(sock: socket.socket, n: int) -> None:
    block = b"\xa5" * BUF
    sent = 0
    while sent < n:
        sent += sock.send(block[: min(BUF, n - sent)])


class TargetServer:
    """The link's far end, in a process of its own (sender and receiver must not share a GIL):
    echo (E), sink (S: receive n, answer the timing) or source (G: send n)."""

    def __init__(self):
        ctx = multiprocessing.get_context("fork")
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_forever, args=(theirs,), daemon=True)
        self._proc.start()
        self.address = tuple(ours.recv())

    def close(self) -> None:
        self._proc.kill()
        self._proc.join(10)


def _serve_forever(pipe) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the handler of the process it was forked from
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sock = socket.create_server(("127.0.0.1", 0))
    pipe.send(sock.getsockname())
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _handle(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        try:
            mode, n = struct.unpack("!cQ", _recv_exact(conn, 9))
            if mode == b"E":
                for _ in range(n):
                    conn.sendall(_recv_exact(conn, 64))
            elif mode == b"S":
                seconds, counted = _sink(conn, n)
                conn.sendall(struct.pack("!dQ", seconds, counted))
            elif mode == b"G":
                _source(conn, n)
                _recv_exact(conn, 1)  # the client says it has everything
        except (ConnectionError, OSError):
            pass


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def ping_ms(port: int, pings: int = 30, stat=statistics.median) -> float:
    """The RTT, in ms, of `pings` 64-byte exchanges through a link's local `port` to a TargetServer,
    on one connection (the first few, which warm the path up, not counted): their median, or `stat`."""
    with _connect(port) as sock:
        sock.sendall(struct.pack("!cQ", b"E", pings + 3))
        rtts = []
        for i in range(pings + 3):
            t = time.perf_counter()
            sock.sendall(bytes(64))
            _recv_exact(sock, 64)
            if i >= 3:
                rtts.append(time.perf_counter() - t)
    return stat(rtts) * 1000


def measure(port: int, nominal_mbit: float, seconds: float = 2.0, pings: int = 30) -> Measured:
    """Rate up and down and the RTT through a link's local `port` to a TargetServer (its target)."""
    n = int(nominal_mbit * 1e6 / 8 * seconds)
    rtt_ms = ping_ms(port, pings)  # RTT first, on an idle link
    with _connect(port) as sock:
        sock.sendall(struct.pack("!cQ", b"S", n))
        _source(sock, n)
        secs, counted = struct.unpack("!dQ", _recv_exact(sock, 16))
        up = counted * 8 / secs / 1e6
    with _connect(port) as sock:
        sock.sendall(struct.pack("!cQ", b"G", n))
        secs, counted = _sink(sock, n)
        sock.sendall(b"k")
        down = counted * 8 / secs / 1e6
    return Measured(up_mbit=up, down_mbit=down, rtt_ms=rtt_ms)


def check(link, seconds: float = 2.0) -> Measured:
    """Measure `link` (a ShapedLink, entered) against a fresh target server."""
    server = TargetServer()
    try:
        port = link.forward(server.address)
        return measure(port, max(link.rate_mbit, link.down_mbit or 0), seconds)
    finally:
        server.close()
