"""A site's SuperExec with the warm ClientApp executor: `python -m federation.ops.warm_superexec`.

The launcher starts it beside a SuperNode run with `--isolation process` (launcher.start_superexec).
Its loop is Flower's SuperExec loop (flwr's supercore/superexec/run_superexec.py): acquire a task
from the SuperNode's Runtime API, launch it through the executor, ask again after
`FLWR_SUPEREXEC_TASK_POLL_INTERVAL`; the executor is warm_executor.WarmClientAppExecutor. It
differs from Flower's in what sovfl sites do not use (no health server, tracing or SuperExec
authentication) and in two things they need: when the SuperNode does not answer (it is being
restarted, on the same port) the loop asks again every poll interval, where Flower's client backs
off up to 20 s, so a restarted SuperNode's first message does not wait for that; and with a wake
name in its environment (superexec_wake.py) it asks when the SuperNode says a message is in, at
once again after a task (two messages may have come), and otherwise only every
`superexec_wake.IDLE_POLL_S`.

When the installed flwr's internals differ from those it was written against (flower_exec.py), it
says so in one line and replaces itself with Flower's own `flower-superexec`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def flower_superexec_argv(address: str, insecure: bool, root_certificates: str | None) -> list[str]:
    """Flower's own SuperExec (its subprocess executor) for the same SuperNode."""
    path = Path(sys.executable).parent / "flower-superexec"
    security = ["--insecure"] if insecure else (["--root-certificates", root_certificates] if root_certificates else [])
    return [str(path) if path.exists() else "flower-superexec", "--runtime-api-address", address, *security]


def serve(address: str, insecure: bool, root_certificates: str | None, executor) -> None:
    """Acquire and launch tasks until a signal ends the process (Flower's handlers close the executor)."""
    from federation.ops import flower_exec as fx
    from federation.ops import superexec_wake
    from federation.ops.warm_executor import say

    interval = fx._get_task_poll_interval()
    waker = superexec_wake.listen(os.environ.get(superexec_wake.WAKE_ENV))
    if os.environ.get(superexec_wake.WAKE_ENV) and waker is None:
        say(f"the SuperNode's wake cannot be received here; asking for tasks every {interval:g}s")
    retry = fx.make_simple_http_retry_invoker()
    retry.max_tries = 1  # a SuperNode that does not answer is asked again on the next poll (module docstring)
    client = fx.RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure,
        root_certificates=fx.validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=[fx.RuntimeVersionHttpInterceptor(component_name="SuperExec")], retry_invoker=retry)
    fx.register_signal_handlers(event_type=fx.EventType.RUN_SUPEREXEC_LEAVE,
                                exit_message="SuperExec terminated gracefully.",
                                exit_handlers=[client.close, executor.close, *([waker.close] if waker else [])])
    plugin = fx.AutoExecPlugin(runtime_api_address=address, insecure=insecure, root_certificates_path=root_certificates,
                               runtime_dependency_install=False, executor=executor)
    away = False
    while True:
        executor.reconcile()
        types, fab_hashes = executor.get_eligible_capacity(set(plugin.supported_task_types), insecure=insecure,
                                                           root_certificates_path=root_certificates)
        try:
            res = client.AcquireTask(fx.AcquireTaskRequest(supported_task_types=types, agentapp_fab_hashes=fab_hashes))
        except Exception as err:  # noqa: BLE001 - the SuperNode is away; asked again below
            if not away:
                say(f"the SuperNode's Runtime API at {address} does not answer ({type(err).__name__}); asking "
                    f"again every {interval:g}s")
            away = True
            time.sleep(interval)
            continue
        if away:
            say(f"the SuperNode's Runtime API at {address} answers again")
            away = False
        if res.HasField("task") and res.token:
            fx._handle_launch_result(plugin.launch_task(token=res.token, task=res.task), res.task)
            continue  # another message may be in already, its wake taken with this one's
        if waker is not None:
            waker.wait(superexec_wake.IDLE_POLL_S)
        else:
            time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """Check flwr's internals (else exec Flower's SuperExec), start the pool, serve."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (HOST:PORT)")
    ap.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (loopback)")
    ap.add_argument("--root-certificates", default=None, help="CA of the Runtime API's TLS certificate")
    ap.add_argument("--parents", type=int, default=1, help="warm ClientApp parents kept ready (each forks a worker per message)")
    args = ap.parse_args(argv)
    try:
        from federation.ops import flower_exec as fx

        fx.check()
    except Exception as err:  # noqa: BLE001 - FlowerInternalsChanged, or an import it wraps
        print(f"sovfl warm executor: {err}; this site's ClientApps run under Flower's flower-superexec instead",
              file=sys.stderr, flush=True)
        argv_flower = flower_superexec_argv(args.runtime_api_address, args.insecure, args.root_certificates)
        os.execvp(argv_flower[0], argv_flower)
    from federation.ops.warm_executor import WarmClientAppExecutor

    executor = WarmClientAppExecutor(args.parents)
    executor.start()
    serve(args.runtime_api_address, args.insecure, args.root_certificates, executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
