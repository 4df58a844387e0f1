"""The warm ClientApp parent: imports once, forks one worker per ClientApp task.

The warm executor (warm_executor.py) starts this process ahead of any message. It imports Flower's
ClientApp runtime (flwr, httpx, protobuf), our ClientApp with its mods (gRPC; never torch) and
the site's attestation plug-ins (warm_preload.py), freezes what it loaded out of the garbage
collector, says `ready` on its event descriptor, then reads tasks from stdin, one JSON line each
(a pipe, not argv, which other users of the machine can read). For each task it forks a worker,
which runs Flower's `run_clientapp` for the task's token as a `flwr-clientapp` process would: the message
comes over the Runtime API, the reply goes back the same way, and the worker ends with Flower's
exit code. One difference: a message object the SuperNode has not stored yet is asked for again
within 50-250 ms rather than 1-10 s (flower_exec.prompt_object_pulls), since a warm worker asks
as soon as the task exists.

Why a fork is safe here: the parent never runs a task, so a worker starts from the state the
imports left and nothing of one message, run or key reaches the next. The parent starts no gRPC
channel (gRPC's core is not running at fork) and forks only while it has one thread: before each
fork it checks, and with another thread alive it refuses and exits (the executor then falls back
to Flower's executor). OpenBLAS (numpy's, imported by flwr) is held to one thread by the executor
(OPENBLAS_NUM_THREADS) so it starts no pool. Random state: Python's `random` reseeds itself in a
forked child; numpy's global generator does not, so each worker reseeds it from the OS; keys and
nonces come from the OS (`cryptography`, `secrets`) and OpenSSL reseeds after fork.

Events the parent writes, one line each: `ready`, `forked <task_id> <pid>`, `exit <pid> <code>`
(a worker it reaped; a signal as its negative number), `unsafe <why>` (it exits). End of stdin
ends the parent quietly; workers still running finish their tasks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import sys
import threading
import time

REAP_EVERY_S = 0.2  # how soon a worker's exit reaches the executor's log


def warm_up() -> None:
    """Import what every task needs, so that no task waits for it, and set it aside for the forks."""
    import encodings.cp437  # noqa: F401 - the FAB's zip names
    import flwr.cli.install  # noqa: F401 - the FAB install each task runs
    import flwr.clientapp.utils  # noqa: F401 - the app loader
    import grpc._channel  # noqa: F401 - imported by gRPC's first channel (the trainer call)
    import grpc._simple_stubs  # noqa: F401
    from cryptography.hazmat.backends.openssl import backend  # noqa: F401 - loaded by the first certificate read

    import federation.site.client_app  # noqa: F401 - our ClientApp, its mods, gRPC
    from federation.ops import flower_exec as fx, warm_preload

    # Flower's Runtime API client imports its HTTP transport (httpcore, h11) when the first one is
    # made: make one (it opens no connection) and close it.
    fx.RuntimeHttpClient.from_server_address(server_address="127.0.0.1:9", insecure=True, root_certificates=None,
                                             interceptors=[], retry_invoker=fx.make_simple_http_retry_invoker()).close()
    fx.prompt_object_pulls()  # the task's objects may still be on their way to the SuperNode (flower_exec.py)
    fx.answer_platform_probes()  # Flower's telemetry payload would start a `file` process in each worker
    warm_preload.preload()  # the site's attestation plug-ins, named by the launcher
    # What the imports left is shared with every worker until written to: kept out of the
    # collector's passes (which write to every object they visit), a worker's collections copy
    # none of it.
    gc.freeze()


def _event(fd: int, line: str) -> None:
    os.write(fd, line.encode() + b"\n")


def _reap(events: int) -> None:
    """Report every worker that ended since the last call."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _event(events, f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def fork_safety() -> str | None:
    """Why forking now would be unsafe (another thread alive, Python's or native), or None."""
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.current_thread())
        return f"{threading.active_count()} Python threads ({names})"
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: Python's count is what there is
        return None
    return f"{native} threads (a library started native ones)" if native > 1 else None


def _become_worker(events: int) -> None:
    """In a just-forked worker: drop the parent's channels, reseed what a fork copies."""
    os.close(events)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def fork_per_task(events: int) -> dict | None:
    """The parent's loop: fork a worker per task line on stdin. Returns only in a worker, with its
    task; in the parent, None once stdin ends (or refuses to fork: `unsafe` on `events`)."""
    pending = b""
    try:
        while True:
            _reap(events)
            readable, _, _ = select.select([0], [], [], REAP_EVERY_S)
            if not readable:
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                task = json.loads(line)
                unsafe = fork_safety()
                if unsafe is not None:
                    _event(events, f"unsafe {unsafe}")
                    return None
                pid = os.fork()
                if pid == 0:
                    _become_worker(events)
                    return task
                _event(events, f"forked {task['task_id']} {pid}")
    except KeyboardInterrupt:  # the site is being stopped (its process group got Ctrl-C)
        return None


def serve(task: dict) -> None:
    """Flower's ClientApp runtime for the task's token (ends the process with Flower's exit code)."""
    from federation.ops import flower_exec as fx
    from federation.protocol.message_cost import TASK_START_ENV

    os.environ[TASK_START_ENV] = repr(task.get("handed_at", time.time()))  # the message's cost starts here
    fx.run_clientapp(
        runtime_api_address=task["runtime_api_address"], token=task["token"], insecure=task["insecure"],
        certificates=fx.validate_and_resolve_root_certificates(task["root_certificates_path"], task["insecure"]),
        parent_pid=task["parent_pid"], runtime_dependency_install=task["runtime_dependency_install"])


def main(argv: list[str] | None = None) -> int:
    """Warm up, say ready, fork a worker per task; a worker serves its task."""
    ap = argparse.ArgumentParser(description="the warm ClientApp parent (started by the warm executor)")
    ap.add_argument("--events-fd", type=int, required=True, help="where to write `ready`, forks and exits")
    args = ap.parse_args(argv)
    warm_up()
    _event(args.events_fd, "ready")
    task = fork_per_task(args.events_fd)
    if task is not None:
        serve(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
