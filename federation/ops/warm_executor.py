"""A SuperExec executor that hands each ClientApp task to a worker forked from a warm parent.

Flower's own executor (flwr's subprocess_executor.py) starts a fresh `flwr-clientapp` process for
every task, and every message then waits for the interpreter, Flower's imports and ours. This one
implements the same interface (flwr's executor/types.py `Executor`: launch, get_eligible_capacity,
wait_for_capacity, reconcile, close) over `size` warm parents (warm_worker.py), started before
any message, that have done those imports once. `launch` writes the task's token to a ready
parent's stdin; the parent forks a worker, which runs Flower's ClientApp runtime for it and exits.
A task costs a fork, not an interpreter and its imports, in time and in CPU; each worker serves one
task, so no state crosses messages (warm_worker.py says why the fork is safe).

Failures:
- a worker that crashes mid-task is what a crashed `flwr-clientapp` is with Flower's executor: its
  task's heartbeat stops, the SuperNode fails the task, the coordinator counts the site out of
  that stage; the executor logs the worker's exit code (its parent reports it);
- a parent that dies is replaced; workers it forked run on (their exit codes are not known);
- no parent ready when a task comes (one being replaced): the task waits up to `ready_wait_s`
  for it, then goes to Flower's subprocess executor;
- a pool that cannot start (`max_failed_starts` parents in a row die before they are ready, or
  none is ready within `start_timeout_s`, or a parent refuses to fork because a thread is alive
  in it) falls back to Flower's subprocess executor for good, with one log line that says why.
Tasks other than ClientApps (none on a SuperNode today) go to Flower's executor as well.
"""

from __future__ import annotations

import select
import sys
import time
from collections.abc import Callable

from federation.ops import flower_exec as fx
from federation.ops.warm_parent import WarmParent

PARENT_ARGV = (sys.executable, "-m", "federation.ops.warm_worker")


def say(line: str) -> None:
    """One line on the SuperExec's log."""
    print(f"sovfl warm executor: {line}", file=sys.stderr, flush=True)


class WarmClientAppExecutor:
    """Flower's executor interface over warm ClientApp parents (module docstring)."""

    def __init__(self, size: int, argv: tuple[str, ...] = PARENT_ARGV, *, start_timeout_s: float = 120.0,
                 ready_wait_s: float = 30.0, fork_timeout_s: float = 10.0, max_failed_starts: int = 3,
                 log: Callable[[str], None] = say):
        if size < 1:
            raise ValueError(f"a warm pool needs at least one parent, not {size}")
        self.size, self.argv, self.log = size, tuple(argv), log
        self.start_timeout_s, self.ready_wait_s, self.max_failed_starts = start_timeout_s, ready_wait_s, max_failed_starts
        self.fork_timeout_s = fork_timeout_s
        self.parents: list[WarmParent] = []  # started, ready or still importing
        self.busy: dict[int, tuple[WarmParent, int]] = {}  # worker pid -> (its parent, its task id)
        self.cold = fx.SubprocessExecutor()
        self.fallback: str | None = None  # why the pool was given up (None: it serves)
        self.failed_starts = 0  # parents in a row that died before they were ready
        self.served = {"warm": 0, "subprocess": 0}

    # ---- the parents -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the parents and wait until one is ready, or fall back (module docstring)."""
        end = time.monotonic() + self.start_timeout_s
        self._top_up()
        while self.fallback is None and not any(p.ready for p in self.parents):
            if time.monotonic() > end:
                self._fall_back(f"no parent was ready within {self.start_timeout_s:g}s")
                return
            self._read(0.2)
            self._reap_parents()
            self._top_up()
        if self.fallback is None:
            self.log(f"{self.size} warm ClientApp parent(s) (pid {', '.join(str(p.pid) for p in self.parents)}), "
                     "a worker forked per message")

    def _top_up(self) -> None:
        while self.fallback is None and len(self.parents) < self.size:
            try:
                self.parents.append(WarmParent.start(self.argv))
            except OSError as err:
                self._fall_back(f"a parent could not be started ({err})")

    def _read(self, timeout_s: float) -> None:
        """Take what the parents said, waiting up to `timeout_s` for any of them to say something."""
        fds = [p.events for p in self.parents if p.events >= 0]
        if timeout_s > 0 and fds:
            select.select(fds, [], [], timeout_s)
        for parent in self.parents:
            was_ready = parent.ready
            parent.read(0.0)
            if parent.ready and not was_ready:
                self.failed_starts = 0
            self._note_exits(parent)

    def _note_exits(self, parent: WarmParent) -> None:
        for pid, code in parent.take_exits():
            _, task_id = self.busy.pop(pid, (None, None))
            if code != 0:
                self.log(f"the worker (pid {pid}) serving task {task_id} exited with code {code}: a failed "
                         "ClientApp, as with Flower's own executor")

    def _reap_parents(self) -> None:
        for parent in [p for p in self.parents if not p.alive()]:
            if parent not in self.parents:  # a fall-back stopped them all
                return
            self.parents.remove(parent)
            parent.stop()  # reads what it said last (the exits it reaped), then closes its pipe
            self._note_exits(parent)
            code = parent.popen.returncode
            orphans = [pid for pid, (p, _) in self.busy.items() if p is parent]
            for pid in orphans:
                del self.busy[pid]
            running = f"; its running worker(s) (pid {', '.join(map(str, orphans))}) go on" if orphans else ""
            if parent.unsafe is not None:
                self._fall_back(f"the parent (pid {parent.pid}) would not fork with {parent.unsafe} alive in it")
            elif parent.ready:
                self.log(f"a warm parent (pid {parent.pid}) exited with code {code}{running}; starting another")
            else:
                self.failed_starts += 1
                if self.failed_starts < self.max_failed_starts:
                    self.log(f"a starting parent (pid {parent.pid}) exited with code {code} before it was ready "
                             f"({self.failed_starts} in a row; the pool gives up at {self.max_failed_starts}); "
                             "starting another")
                else:
                    self._fall_back(f"{self.failed_starts} parents in a row exited with code {code} before they "
                                    "were ready (their output is above)")

    def _fall_back(self, why: str) -> None:
        if self.fallback is not None:
            return
        self.fallback = why
        self._stop_parents()
        self.log(f"the warm pool cannot start: {why}; Flower's subprocess executor (a fresh flwr-clientapp "
                 "process per message) serves this SuperNode's tasks from now on")

    def _stop_parents(self) -> None:
        for parent in self.parents:
            parent.stop()
        self.parents.clear()

    def _ready_parent(self) -> WarmParent | None:
        """A ready parent, waiting up to ready_wait_s for one still starting."""
        end = time.monotonic() + self.ready_wait_s
        while True:
            self._reap_parents()
            ready = next((p for p in self.parents if p.ready), None)
            if ready is not None or self.fallback is not None or time.monotonic() > end:
                return ready
            self._top_up()
            self._read(min(0.2, max(0.0, end - time.monotonic())))

    # ---- Flower's Executor interface --------------------------------------------------------

    def launch(self, spec: fx.ExecutionSpec) -> fx.LaunchResult:
        """Fork a worker for the task from a ready parent; Flower's subprocess executor when none is
        (or for other tasks)."""
        if self.fallback is None and spec.task_type == fx.TaskType.CLIENT_APP:
            self._read(0.0)
            task = {"runtime_api_address": spec.runtime_api_address, "token": spec.token, "insecure": spec.insecure,
                    "root_certificates_path": spec.root_certificates_path, "parent_pid": spec.parent_pid,
                    "runtime_dependency_install": spec.runtime_dependency_install}
            while (parent := self._ready_parent()) is not None:
                pid = parent.hand({**task, "handed_at": time.time()}, spec.task_id, self.fork_timeout_s)
                if pid is not None:
                    self.log(f"task {spec.task_id} handed to worker pid {pid}")
                    self.busy[pid] = (parent, spec.task_id)
                    self.served["warm"] += 1
                    return fx.LaunchResult.accepted()
                if parent.alive():  # hung: replaced like a dead one
                    self.log(f"a warm parent (pid {parent.pid}) forked no worker within {self.fork_timeout_s:g}s; "
                             "stopping it")
                    parent.popen.kill()
                    parent.popen.wait()
                self._reap_parents()
                self._top_up()
            if self.fallback is None:
                self.log(f"no warm parent ready within {self.ready_wait_s:g}s: task {spec.task_id} starts a fresh "
                         "flwr-clientapp process")
        self.served["subprocess"] += 1
        return self.cold.launch(spec)

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
        """Between task polls: note ready and dead parents and ended workers, keep `size` parents."""
        self._read(0.0)
        self._reap_parents()
        self._top_up()

    def close(self) -> None:
        """Stop the parents; running workers finish their task (they watch the SuperExec's pid, as
        Flower's ClientApps do)."""
        self._stop_parents()
