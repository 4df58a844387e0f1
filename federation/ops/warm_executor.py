"""A SuperExec executor that hands each ClientApp task to a worker started before the message.

Flower's own executor (flwr's subprocess_executor.py) starts a fresh `flwr-clientapp` process for
every task, and every message then waits for the interpreter, Flower's imports and ours. This one
implements the same interface (flwr's executor/types.py `Executor`: launch, get_eligible_capacity,
wait_for_capacity, reconcile, close) over a pool of `size` worker processes (warm_worker.py) that
have done those imports and wait. `launch` writes the task's token to an idle worker's stdin and
returns; the worker runs Flower's ClientApp runtime for it and exits; a replacement starts at
once, while the task runs. Each worker serves one task, so no state crosses messages.

Failures:
- a worker that crashes mid-task is what a crashed `flwr-clientapp` is with Flower's executor: its
  task's heartbeat stops, the SuperNode fails the task, the coordinator counts the site out of
  that stage; the executor logs the worker's exit code and keeps `size` workers;
- a worker that dies while idle is replaced;
- no worker ready when a task comes (a burst, or a slow start): the task waits up to
  `ready_wait_s` for the next worker still importing (sooner ready than a fresh process would
  be), then goes to Flower's subprocess executor;
- a pool that cannot start (`max_failed_starts` workers in a row die before they are ready, or
  none is ready within `start_timeout_s`) falls back to Flower's subprocess executor for good,
  with one log line that says why.
Tasks other than ClientApps (none on a SuperNode today) go to Flower's executor as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from federation.ops import flower_exec as fx

WORKER_ARGV = (sys.executable, "-m", "federation.ops.warm_worker")


def say(line: str) -> None:
    """One line on the SuperExec's log."""
    print(f"sovfl warm executor: {line}", file=sys.stderr, flush=True)


@dataclass
class Worker:
    """A started worker: its process and the read end of its `ready` pipe (None once read)."""

    popen: subprocess.Popen
    ready_fd: int | None
    ready: bool = False


class WarmClientAppExecutor:
    """Flower's executor interface over a pool of warm ClientApp workers (module docstring)."""

    def __init__(self, size: int, argv: tuple[str, ...] = WORKER_ARGV, *, start_timeout_s: float = 120.0,
                 ready_wait_s: float = 30.0, max_failed_starts: int = 3, log: Callable[[str], None] = say):
        if size < 1:
            raise ValueError(f"a warm pool needs at least one worker, not {size}")
        self.size, self.argv, self.log = size, tuple(argv), log
        self.start_timeout_s, self.ready_wait_s, self.max_failed_starts = start_timeout_s, ready_wait_s, max_failed_starts
        self.idle: list[Worker] = []  # started, not yet handed a task (ready or still importing)
        self.busy: dict[int, tuple[subprocess.Popen, int]] = {}  # pid -> (worker, its task id)
        self.cold = fx.SubprocessExecutor()
        self.fallback: str | None = None  # why the pool was given up (None: it serves)
        self.failed_starts = 0  # workers in a row that died before they were ready
        self.served = {"warm": 0, "subprocess": 0}

    # ---- the pool ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the pool and wait until a worker is ready, or fall back (module docstring)."""
        end = time.monotonic() + self.start_timeout_s
        self._top_up()
        while self.fallback is None and not any(w.ready for w in self.idle):
            if time.monotonic() > end:
                self._fall_back(f"no worker was ready within {self.start_timeout_s:g}s")
                return
            self._poll_ready(0.2)
            self._reap_idle()
            self._top_up()
        if self.fallback is None:
            self.log(f"{self.size} warm ClientApp worker(s) (pid {', '.join(str(w.popen.pid) for w in self.idle)})")

    def _spawn(self) -> Worker:
        r, w = os.pipe()
        try:
            popen = subprocess.Popen([*self.argv, "--ready-fd", str(w)], stdin=subprocess.PIPE, pass_fds=(w,))
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        return Worker(popen, r)

    def _top_up(self) -> None:
        while self.fallback is None and len(self.idle) < self.size:
            try:
                self.idle.append(self._spawn())
            except OSError as err:
                self._fall_back(f"a worker could not be started ({err})")

    def _poll_ready(self, timeout_s: float) -> None:
        """Read the `ready` of workers that wrote it, waiting up to `timeout_s` for one."""
        pending = {w.ready_fd: w for w in self.idle if w.ready_fd is not None}
        if not pending:
            return
        readable, _, _ = select.select(list(pending), [], [], timeout_s)
        for fd in readable:
            worker = pending[fd]
            worker.ready = os.read(fd, 16).startswith(b"ready")  # b"": it exited first (_reap_idle)
            if worker.ready:
                self.failed_starts = 0
            os.close(fd)
            worker.ready_fd = None

    def _reap_idle(self) -> None:
        dead = [w for w in self.idle if w.popen.poll() is not None]
        self.idle = [w for w in self.idle if w not in dead]
        for worker in dead:
            code = worker.popen.returncode
            if worker.ready_fd is not None:
                os.close(worker.ready_fd)
                worker.ready_fd = None
            if worker.ready:
                self.log(f"an idle worker (pid {worker.popen.pid}) exited with code {code}; starting another")
                continue
            self.failed_starts += 1
            if self.failed_starts < self.max_failed_starts:
                self.log(f"a starting worker (pid {worker.popen.pid}) exited with code {code} before it was ready "
                         f"({self.failed_starts} in a row; the pool gives up at {self.max_failed_starts}); starting another")
            else:
                self._fall_back(f"{self.failed_starts} workers in a row exited with code {code} before they were "
                                "ready (their output is above)")

    def _reap_busy(self) -> None:
        for pid, (popen, task_id) in list(self.busy.items()):
            code = popen.poll()
            if code is None:
                continue
            del self.busy[pid]
            if code != 0:
                self.log(f"the worker (pid {pid}) serving task {task_id} exited with code {code}: a failed "
                         "ClientApp, as with Flower's own executor")

    def _fall_back(self, why: str) -> None:
        if self.fallback is not None:
            return
        self.fallback = why
        self._stop_idle()
        self.log(f"the warm pool cannot start: {why}; Flower's subprocess executor (a fresh flwr-clientapp "
                 "process per message) serves this SuperNode's tasks from now on")

    def _stop_idle(self) -> None:
        for worker in self.idle:
            with contextlib.suppress(OSError):
                worker.popen.stdin.close()  # end of input: a waiting worker exits on its own
            with contextlib.suppress(OSError):
                worker.popen.terminate()
            if worker.ready_fd is not None:
                os.close(worker.ready_fd)
        for worker in self.idle:
            try:
                worker.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.popen.kill()
        self.idle.clear()

    def _ready_worker(self) -> Worker | None:
        """An idle ready worker, waiting up to ready_wait_s for one still starting."""
        end = time.monotonic() + self.ready_wait_s
        while True:
            self._reap_idle()
            ready = next((w for w in self.idle if w.ready), None)
            if ready is not None or self.fallback is not None or time.monotonic() > end:
                return ready
            self._top_up()
            self._poll_ready(min(0.2, max(0.0, end - time.monotonic())))

    # ---- Flower's Executor interface --------------------------------------------------------

    def launch(self, spec: fx.ExecutionSpec) -> fx.LaunchResult:
        """Hand the task to a ready worker; Flower's subprocess executor when none is (or for other tasks)."""
        if self.fallback is None and spec.task_type == fx.TaskType.CLIENT_APP:
            self._poll_ready(0.0)
            while (worker := self._ready_worker()) is not None:
                self.idle.remove(worker)
                if self._hand(worker, spec):
                    self.log(f"task {spec.task_id} handed to worker pid {worker.popen.pid}")
                    self.busy[worker.popen.pid] = (worker.popen, spec.task_id)
                    self.served["warm"] += 1
                    self._top_up()  # the replacement starts while the task runs
                    return fx.LaunchResult.accepted()
            if self.fallback is None:
                self.log(f"no warm worker ready within {self.ready_wait_s:g}s: task {spec.task_id} starts a fresh "
                         "flwr-clientapp process")
        self.served["subprocess"] += 1
        return self.cold.launch(spec)

    def _hand(self, worker: Worker, spec: fx.ExecutionSpec) -> bool:
        """Write the task to the worker's stdin; False if it died meanwhile."""
        task = {"runtime_api_address": spec.runtime_api_address, "token": spec.token, "insecure": spec.insecure,
                "root_certificates_path": spec.root_certificates_path, "parent_pid": spec.parent_pid,
                "runtime_dependency_install": spec.runtime_dependency_install}
        try:
            worker.popen.stdin.write(json.dumps(task).encode() + b"\n")
            worker.popen.stdin.close()
        except OSError:  # BrokenPipeError: it exited since it said ready
            with contextlib.suppress(OSError):
                worker.popen.stdin.close()
            worker.popen.wait()
            self.log(f"an idle worker (pid {worker.popen.pid}) exited with code {worker.popen.returncode} before "
                     f"task {spec.task_id} reached it; handing it to another")
            return False
        return True

    def get_eligible_capacity(self, supported_task_types: set[fx.TaskType], *, insecure: bool = False,
                              root_certificates_path: str | None = None) -> tuple[set[fx.TaskType], set[str]]:
        """Every task type: a task without a ready worker goes to Flower's executor."""
        del insecure, root_certificates_path
        return supported_task_types, set()

    def wait_for_capacity(self, task_type: fx.TaskType | None = None, *, fab_hash: str | None = None,
                          insecure: bool = False, root_certificates_path: str | None = None) -> None:
        """No capacity gate (as Flower's subprocess executor)."""
        del task_type, fab_hash, insecure, root_certificates_path

    def reconcile(self) -> None:
        """Between task polls: note ready and dead workers, and keep `size` of them."""
        self._poll_ready(0.0)
        self._reap_idle()
        self._reap_busy()
        self._top_up()

    def close(self) -> None:
        """Stop the idle workers; busy ones finish their task (they watch the SuperExec's pid, as
        Flower's ClientApps do)."""
        self._stop_idle()
