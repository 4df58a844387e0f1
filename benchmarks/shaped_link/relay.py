"""The userspace delay line of a shaped link: a TCP relay that holds each chunk for a fixed time.

The kernel here has no sch_netem, so the link's propagation delay is added in userspace. Every
chunk read from one side is stamped with the time it arrived and written to the other side once
`delay` seconds have passed, while the relay keeps reading: the bytes in flight (rate x delay,
the bandwidth-delay product) sit in the relay's queue, and throughput stays the link's rate (a
store-and-forward relay that waited for each write before the next read would serialise delay
and throughput). The queue is capped (`max_queue_bytes`): past it the relay stops reading, and
TCP's own flow control pushes back on the sender. asyncio Protocols, not streams: each chunk is
copied once out of the kernel and once into it, which keeps 1 Gbit/s within one core's reach.

One relay process serves several routes. A route listens in one network namespace and connects
out from another (None: this process's own), so the same process joins the host's loopback and
a namespace created by the harness: a socket belongs to the namespace it was made in, whatever
the thread does after (setns(2), done around the socket() call only).

Run by path with a JSON argument (stdlib only, so it needs no package on sys.path):
    python relay.py '{"routes": [{"listen": ["127.0.0.1", 0], "listen_ns": null,
                                  "connect": ["10.213.1.1", 7000], "connect_ns": "sfl-...-s",
                                  "delay_forward": 0.0, "delay_backward": 0.015}],
                      "max_queue_bytes": 67108864}'
It prints one line `READY <port> <port> ...` (the listening port of each route) once every route
listens, and runs until it is terminated.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import sys

CLONE_NEWNET = 0x40000000
# The loop waits in select(2), whose timeout has microseconds: epoll_wait's whole milliseconds,
# rounded up, made a chunk leave 0-1 ms late, depending on where its due time fell in the
# millisecond (a 10 ms link measured 11.1 ms, one of 8.9 ms 8.9 ms). A relay has a few sockets,
# well under select's 1024. What is due within EARLY of a wake-up goes with it.
EARLY = 0.00005
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_netns(name: str | None):
    """Run the body with this thread in network namespace `name` (`ip netns` name); None: stay."""
    if name is None:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:  # a thread left in the wrong namespace: stop here
                os._exit(70)
    finally:
        os.close(own)
        os.close(target)


def tcp_socket(ns: str | None) -> socket.socket:
    """A non-blocking TCP socket of namespace `ns`, Nagle off (small messages must not wait)."""
    with in_netns(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class Side(asyncio.Protocol):
    """One socket of a relayed connection. What it receives goes through its delay line to `peer`:
    each chunk is stamped on arrival and written `delay` s later (a timer per due time, every chunk
    due in one write), while reading goes on; reading pauses only when the line holds
    `max_bytes` or the peer's socket pushes back."""

    def __init__(self, delay: float, max_bytes: int):
        self.delay, self.max_bytes = delay, max_bytes
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer: Side | None = None
        self.chunks: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.paused: set[str] = set()  # why reading is paused: "line" full, "peer" pushing back
        self.done = False  # our EOF was passed on

    # reading this side
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._push(data)
        if self.queued >= self.max_bytes:
            self._pause("line")

    def eof_received(self) -> bool:
        self._push(None)
        return True  # half-close: the other direction goes on

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.peer is not None and self.peer.transport is not None:
            if exc is not None or not self.done:
                self.peer.transport.abort() if exc is not None else self.peer.transport.close()

    # flow control from our own transport: the peer's line must stop feeding us
    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer._pause("peer")

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer._resume("peer")

    def _pause(self, why: str) -> None:
        if not self.paused and self.transport is not None:
            self.transport.pause_reading()
        self.paused.add(why)

    def _resume(self, why: str) -> None:
        self.paused.discard(why)
        if not self.paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # the delay line toward the peer
    def _push(self, data: bytes | None) -> None:
        self.chunks.append((self.loop.time() + self.delay, data))
        self.queued += len(data or b"")
        self._schedule()

    def _schedule(self) -> None:
        if self.timer is None and self.chunks and self.peer is not None and self.peer.transport is not None:
            self.timer = self.loop.call_at(self.chunks[0][0] - EARLY, self.release)

    def release(self) -> None:
        """Write every chunk that is due; pass EOF on; schedule the next."""
        self.timer = None
        now, out, eof = self.loop.time() + EARLY, [], False
        while self.chunks and self.chunks[0][0] <= now:
            data = self.chunks.popleft()[1]
            if data is None:
                eof = True
                break
            out.append(data)
        peer = self.peer.transport
        if out:
            self.queued -= sum(map(len, out))
            peer.write(out[0] if len(out) == 1 else b"".join(out))
            if self.queued < self.max_bytes // 2:
                self._resume("line")
        if eof:
            self.done = True
            if peer.can_write_eof():
                peer.write_eof()
            if self.peer.done:  # both ways are over
                peer.close()
                self.transport.close()
            return
        self._schedule()


async def _connect_upstream(route: dict, max_queue: int, client: Side) -> None:
    loop = asyncio.get_running_loop()
    out = tcp_socket(route.get("connect_ns"))
    try:
        await loop.sock_connect(out, tuple(route["connect"]))
        _, upstream = await loop.create_connection(
            lambda: Side(float(route.get("delay_backward", 0.0)), max_queue), sock=out)
    except OSError:
        out.close()
        client.transport.abort()
        return
    client.peer, upstream.peer = upstream, client
    client._schedule()  # what the client sent while we connected


async def serve(config: dict) -> None:
    """Listen on every route, print READY with the ports, serve until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    max_queue = int(config.get("max_queue_bytes", 64 << 20))
    servers, ports, pending = [], [], set()
    for route in config["routes"]:
        lsock = tcp_socket(route.get("listen_ns"))
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(tuple(route["listen"]))
        lsock.listen(128)
        ports.append(lsock.getsockname()[1])

        def factory(route=route) -> Side:
            client = Side(float(route.get("delay_forward", 0.0)), max_queue)
            task = loop.create_task(_connect_upstream(route, max_queue, client))
            pending.add(task)
            task.add_done_callback(pending.discard)
            return client

        servers.append(await loop.create_server(factory, sock=lsock))
    print("READY " + " ".join(map(str, ports)), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    # a late wake-up is added delay: on a busy machine the line must run ahead of the work it carries.
    # Round-robin real-time priority where allowed (the kernel caps real-time tasks at 95% of the
    # CPU, and the relay mostly sleeps), else a lower nice value
    if config.get("realtime"):
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(int(config["realtime"])))
        except (OSError, AttributeError):
            config.setdefault("nice", -10)
    if config.get("nice"):
        try:
            os.nice(int(config["nice"]))
        except OSError:
            pass
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    try:
        loop.run_until_complete(serve(config))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
