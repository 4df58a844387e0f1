"""A site's SuperNode wakes its warm SuperExec when a message is in.

Flower's SuperExec finds a ClientApp task by asking the SuperNode's Runtime API (`AcquireTask`)
every poll interval, an HTTP request that both processes serve whether or not a message came. The
SuperNode sovfl runs (supernode_main.py) knows the moment a message's task exists (it is about
to pull the message's objects): it sends one datagram to a Linux abstract UNIX socket the site's
warm SuperExec listens on, and the SuperExec asks at once. Between messages the SuperExec asks
only every `IDLE_POLL_S` (Flower's default interval), so a wake that never comes (a SuperNode
whose flwr lacks what supernode_main.py changes) costs a message no more than Flower's own poll.

The name is drawn by the launcher for each site and given to both processes in WAKE_ENV. A
datagram carries nothing but the wake: a process in the same network namespace that sends one
only causes an early ask.
"""

from __future__ import annotations

import secrets
import select
import socket

WAKE_ENV = "SOVFL_SUPEREXEC_WAKE"
IDLE_POLL_S = 1.0  # Flower's own SuperExec poll interval (flwr 1.41 run_superexec.py)


def new_name(site_id: str) -> str:
    """A fresh abstract socket name for one site's SuperNode and SuperExec."""
    return f"sovfl-superexec-wake-{site_id}-{secrets.token_hex(8)}"


def send(name: str) -> None:
    """Wake the SuperExec listening on `name`; nothing happens when none listens."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto(b"w", "\0" + name)
    except OSError:  # no listener (the SuperExec restarts), or its queue is full: it asks anyway
        pass


class WakeListener:
    """The SuperExec's end: wait for a wake or a timeout, whichever comes first."""

    def __init__(self, name: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + name)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)

    def wait(self, timeout_s: float) -> bool:
        """True when woken within `timeout_s`; every wake queued so far is taken (one ask serves them)."""
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        while True:
            try:
                self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                return bool(ready)

    def close(self) -> None:
        """Release the name (a SuperExec started after this one can bind it)."""
        self._sock.close()


def listen(name: str | None) -> WakeListener | None:
    """The listener for `name`, or None without a name or when it cannot be bound (the caller then
    polls at its own interval)."""
    if not name:
        return None
    try:
        return WakeListener(name)
    except OSError:
        return None
