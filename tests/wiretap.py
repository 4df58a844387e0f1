"""A recording TCP proxy for wire audits: every byte between the sites and the SuperLink, kept.

Sites dial the tap; the tap dials the SuperLink and copies both directions, appending what it
relays to `up` (sites -> SuperLink) and `down`. With TLS off, this is what an observer of the
network (or a curious operator of the link) would see.
"""

from __future__ import annotations

import socket
import threading

import numpy as np


class WireTap:
    def __init__(self) -> None:
        self.up, self.down = bytearray(), bytearray()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._upstream = ("127.0.0.1", 0)

    def start(self, upstream: str) -> str:
        """Relay to `upstream` (HOST:PORT); returns the address the sites should dial."""
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()
        return "127.0.0.1:%d" % self._server.getsockname()[1]

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=30)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            threading.Thread(target=self._pipe, args=(client, server, self.up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.down), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def windows(arrays: dict[str, np.ndarray], size: int = 24) -> list[bytes]:
    """Every non-overlapping `size`-byte run of the arrays' raw bytes that says something (not one
    repeated byte): if an update crossed the wire in the clear, these would be in the capture."""
    out = []
    for a in arrays.values():
        raw = np.ascontiguousarray(a).tobytes()
        for i in range(0, len(raw) - size + 1, size):
            w = raw[i:i + size]
            if len(set(w)) > 4:
                out.append(w)
    return out


def found(needles: list[bytes], haystack: bytes | bytearray) -> int:
    hay = bytes(haystack)
    return sum(n in hay for n in needles)
