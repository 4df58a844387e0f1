"""What one authenticated, verified hop can move on this machine at most: the ceiling for any data path.

A hop that a federation can trust does at least this per byte: the sender encrypts it (TLS), the
receiver decrypts it, hashes it against a digest it was promised (SHA-256) and puts it somewhere
that outlives the process (a file). Here that is done with nothing else around it: Python's `ssl`
sockets with mutual TLS from a freshly provisioned PKI (the federation's own certificates),
4 MiB reads into one reused buffer, `hashlib.sha256` and `os.pwrite`; every step releases the GIL,
so `streams` concurrent connections (one per site, as in the run) use the machine's cores as the
real channel could. No gRPC, no framing, no chunk bookkeeping: a real data path can only be slower.

benchmarks/large_update.py prints it beside the Flower anchor: if the ceiling is below 10 x the
anchor's rate per hop, a 10x speedup per hop is not reachable on this machine by any design that
encrypts, verifies and stores what it moves.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

from crypto.pki import provision

CHUNK = 4 << 20


def _contexts(pki: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    coord, site = pki / "coordinator", pki / "sites" / "site-0"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(coord / "server.crt", coord / "server.key")
    server.load_verify_locations(coord / "ca.crt")
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(site / "client.crt", site / "client.key")
    client.load_verify_locations(site / "ca.crt")
    return server, client


def _receive(conn: ssl.SSLSocket, size: int, path: Path, out: dict) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    got = 0
    try:
        while got < size:
            filled = 0
            while filled < CHUNK and got + filled < size:
                n = conn.recv_into(view[filled:], CHUNK - filled)
                if not n:
                    raise ConnectionError("sender closed early")
                filled += n
            hashlib.sha256(view[:filled]).digest()
            os.pwrite(fd, view[:filled], got)
            got += filled
        conn.sendall(b"k")  # the sender closes only after this: a close with unread data resets the stream
    finally:
        os.close(fd)
        conn.close()
    out["got"] = got


def tls_ceiling_mb_s(size: int = 400 << 20, streams: int = 2) -> float:
    """MB/s per stream of `streams` concurrent mutual-TLS loopback transfers of `size` bytes each,
    the receiver hashing and writing every byte to a file."""
    with tempfile.TemporaryDirectory(prefix="tls-ceiling-") as tmp:
        work = Path(tmp)
        provision(work / "pki", ["site-0"], hosts=("127.0.0.1", "localhost"))
        server_ctx, client_ctx = _contexts(work / "pki")
        data = memoryview(os.urandom(CHUNK))
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(streams)
        port = listener.getsockname()[1]
        results: list[dict] = [{} for _ in range(streams)]

        def accept_all() -> None:
            threads = []
            for i in range(streams):
                raw, _ = listener.accept()
                conn = server_ctx.wrap_socket(raw, server_side=True)
                t = threading.Thread(target=_receive, args=(conn, size, work / f"in-{i}", results[i]))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()

        def send() -> None:
            with client_ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                        server_hostname="localhost") as sock:
                for lo in range(0, size, CHUNK):
                    sock.sendall(data[:min(CHUNK, size - lo)])
                sock.recv(1)

        acceptor = threading.Thread(target=accept_all)
        acceptor.start()
        t0 = time.perf_counter()
        senders = [threading.Thread(target=send) for _ in range(streams)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        acceptor.join()
        seconds = time.perf_counter() - t0
        listener.close()
        if any(r.get("got") != size for r in results):
            raise RuntimeError(f"TLS ceiling: a stream ended short: {results}")
        return size / 1e6 / seconds
