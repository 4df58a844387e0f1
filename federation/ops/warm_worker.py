"""One warm ClientApp worker: Flower's ClientApp runtime, its imports done before its task arrives.

The warm executor (warm_executor.py) starts workers ahead of any message. A worker imports
Flower's ClientApp runtime (flwr, httpx, protobuf), our ClientApp with its mods (gRPC; never
torch), writes `ready` to the file descriptor it was given, then waits on stdin for its one task:
a JSON line with the task's token and the SuperNode's Runtime API (a pipe, not argv, which other
users of the machine can read). It runs Flower's `run_clientapp` for that token as a
`flwr-clientapp` process would: the message comes over the Runtime API, the reply goes back the
same way, and the process ends with Flower's exit code. One difference: a message object the
SuperNode has not stored yet is asked for again within 50-250 ms rather than 1-10 s
(flower_exec.prompt_object_pulls), since a warm worker asks as soon as the task exists. One task
per process, so nothing of one message, run or key can reach the next. End of input before a
task (the SuperExec went away) ends it quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def warm_up() -> None:
    """Import what every task needs, so that no task waits for it."""
    import encodings.cp437  # noqa: F401 - the FAB's zip names
    import flwr.cli.install  # noqa: F401 - the FAB install each task runs
    import flwr.clientapp.utils  # noqa: F401 - the app loader
    import grpc._channel  # noqa: F401 - imported by gRPC's first channel (the trainer call)
    import grpc._simple_stubs  # noqa: F401
    from cryptography.hazmat.backends.openssl import backend  # noqa: F401 - loaded by the first certificate read

    import federation.site.client_app  # noqa: F401 - our ClientApp, its mods, gRPC
    from federation.ops import flower_exec as fx

    # Flower's Runtime API client imports its HTTP transport (httpcore, h11) when the first one is
    # made: make one (it opens no connection) and close it.
    fx.RuntimeHttpClient.from_server_address(server_address="127.0.0.1:9", insecure=True, root_certificates=None,
                                             interceptors=[], retry_invoker=fx.make_simple_http_retry_invoker()).close()
    fx.prompt_object_pulls()  # the task's objects may still be on their way to the SuperNode (flower_exec.py)


def read_task() -> dict | None:
    """The task handed to this worker (None when stdin ends first)."""
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def serve(task: dict) -> None:
    """Flower's ClientApp runtime for the task's token (ends the process with Flower's exit code)."""
    from federation.ops import flower_exec as fx
    from federation.protocol.message_cost import TASK_START_ENV

    os.environ[TASK_START_ENV] = repr(time.time())  # the message's cost starts here (message_cost.py)
    fx.run_clientapp(
        runtime_api_address=task["runtime_api_address"], token=task["token"], insecure=task["insecure"],
        certificates=fx.validate_and_resolve_root_certificates(task["root_certificates_path"], task["insecure"]),
        parent_pid=task["parent_pid"], runtime_dependency_install=task["runtime_dependency_install"])


def main(argv: list[str] | None = None) -> int:
    """Warm up, say ready, serve the one task handed over (none: exit quietly)."""
    ap = argparse.ArgumentParser(description="a warm ClientApp worker (started by the warm executor)")
    ap.add_argument("--ready-fd", type=int, required=True, help="where to write `ready` once warm")
    args = ap.parse_args(argv)
    warm_up()
    os.write(args.ready_fd, b"ready\n")
    os.close(args.ready_fd)
    task = read_task()
    if task is None:
        return 0
    serve(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
