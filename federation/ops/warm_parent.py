"""The warm executor's handle on one warm ClientApp parent (warm_worker.py): start it, hand it a
task, read what it says (ready, a worker forked, a worker's exit), stop it."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from collections.abc import Sequence

ONE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1"}  # numpy's OpenBLAS starts no thread pool: the parent forks


class WarmParent:
    """A started parent process: its stdin (tasks) and the read end of its event pipe."""

    def __init__(self, popen: subprocess.Popen, events: int):
        self.popen, self.events = popen, events
        self.pending = b""
        self.ready = False
        self.unsafe: str | None = None  # why it refused to fork, if it did
        self.forked: dict[int, int] = {}  # task id -> worker pid, until taken
        self.exits: list[tuple[int, int]] = []  # (worker pid, exit code), until taken

    @classmethod
    def start(cls, argv: Sequence[str]) -> WarmParent:
        """Start `argv` (the parent's program) with its event pipe's write end as `--events-fd`."""
        r, w = os.pipe()
        env = {**os.environ, **ONE_THREAD_ENV}
        try:
            popen = subprocess.Popen([*argv, "--events-fd", str(w)], stdin=subprocess.PIPE, pass_fds=(w,), env=env)
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        return cls(popen, r)

    @property
    def pid(self) -> int:
        """The parent's process id (its workers have their own)."""
        return self.popen.pid

    def alive(self) -> bool:
        """Running, still talking (its event pipe open) and willing to fork."""
        return self.popen.poll() is None and self.events >= 0 and self.unsafe is None

    def read(self, timeout_s: float = 0.0) -> None:
        """Take what the parent wrote, waiting up to `timeout_s` for something."""
        if self.events < 0:
            return
        readable, _, _ = select.select([self.events], [], [], timeout_s)
        if not readable:
            return
        chunk = os.read(self.events, 1 << 16)
        if not chunk:  # it exited
            os.close(self.events)
            self.events = -1
            return
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self._event(line.decode(errors="replace").split(" ", 2))

    def _event(self, words: list[str]) -> None:
        if words[0] == "ready":
            self.ready = True
        elif words[0] == "forked" and len(words) == 3:
            self.forked[int(words[1])] = int(words[2])
        elif words[0] == "exit" and len(words) == 3:
            self.exits.append((int(words[1]), int(words[2])))
        elif words[0] == "unsafe":
            self.unsafe = " ".join(words[1:])

    def hand(self, task: dict, task_id: int, timeout_s: float) -> int | None:
        """Hand `task` over; the pid of the worker forked for it, or None if the parent did not
        fork one within `timeout_s` (it died, or refused)."""
        try:
            self.popen.stdin.write(json.dumps({**task, "task_id": task_id}).encode() + b"\n")
            self.popen.stdin.flush()
        except OSError:  # BrokenPipeError: it exited since it said ready
            return None
        end = time.monotonic() + timeout_s
        while task_id not in self.forked and self.alive():
            left = end - time.monotonic()
            if left <= 0:
                return None
            self.read(left)
        return self.forked.pop(task_id, None)

    def take_exits(self) -> list[tuple[int, int]]:
        """The (worker pid, exit code) pairs reported since the last call."""
        exits, self.exits = self.exits, []
        return exits

    def stop(self, timeout_s: float = 5.0) -> None:
        """End its input (it exits on its own), then make sure; running workers are left to finish."""
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        for _ in range(64):  # what it wrote before it ended; its workers closed their copies of the pipe
            if self.events < 0:
                break
            self.read(0.1)
        if self.events >= 0:
            os.close(self.events)
            self.events = -1
