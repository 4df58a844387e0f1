"""Every flwr internal the warm ClientApp executor relies on, named in this one module.

Flower's SuperExec machinery (flwr/supercore/superexec/) and its ClientApp runtime
(flwr/supernode/runtime/run_clientapp.py) are not a public API: they are the seam a SuperNode
started with `--isolation process` leaves to the operator. The warm executor (warm_executor.py),
its SuperExec (warm_superexec.py) and its warm parents and workers (warm_worker.py) import Flower's pieces from
here and nowhere else, and `check()` compares what they use with the installed flwr: a new flwr
that renames, moves or re-signs any of them fails `check()` (and tests/test_flower_exec.py) with a
message that names each difference, instead of a TypeError in the middle of a round. The SuperExec
runs `check()` before anything else and, when it fails, hands the site to Flower's own
`flower-superexec` (its subprocess executor).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import platform
from importlib.metadata import version

from federation.config.supernode_polls import FLOWER_OBJECT_WAIT_S


class FlowerInternalsChanged(RuntimeError):
    """The installed flwr is not the one the warm executor was written against."""


HINT = ("Until federation/ops/flower_exec.py is adapted to it, set federation.warm_clientapps: 0 "
        "(Flower's own executor).")

try:
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.exit import register_signal_handlers
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor
    from flwr.supercore.superexec.executor.types import ExecutionSpec, Executor, LaunchResult, LaunchResultStatus
    from flwr.supercore.superexec.plugin import AutoExecPlugin
    from flwr.supercore.superexec.run_superexec import _get_task_poll_interval, _handle_launch_result
    from flwr.supercore.telemetry import EventType
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    run_clientapp_module = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    from flwr.supernode.runtime.run_clientapp import run_clientapp
except ImportError as _err:  # a name moved: say which, not a bare ImportError deep in a site's start
    raise FlowerInternalsChanged(f"the warm ClientApp executor imports a flwr internal that flwr "
                                 f"{version('flwr')} no longer has: {_err}. {HINT}") from _err

FLWR_VERSION = "1.41.0"  # the flwr whose internals this module was written against (pyproject pins it)

# What the executor reads and calls, as that flwr has it.
EXECUTION_SPEC_FIELDS = ("task_type", "runtime_api_address", "token", "insecure", "root_certificates_path",
                         "runtime_dependency_install", "parent_pid", "suppress_output", "task_id", "fab_hash")
EXECUTOR_METHODS = {  # the Executor protocol (executor/types.py): method -> its parameters
    "get_eligible_capacity": ("self", "supported_task_types", "insecure", "root_certificates_path"),
    "wait_for_capacity": ("self", "task_type", "fab_hash", "insecure", "root_certificates_path"),
    "launch": ("self", "spec"),
    "reconcile": ("self",),
    "close": ("self",),
}
CALLS = {  # function -> the parameters it is called with
    "run_clientapp": (run_clientapp, ("runtime_api_address", "token", "insecure", "certificates", "parent_pid",
                                      "runtime_dependency_install")),
    "AutoExecPlugin": (AutoExecPlugin, ("runtime_api_address", "insecure", "root_certificates_path",
                                        "runtime_dependency_install", "executor")),
    "AutoExecPlugin.launch_task": (AutoExecPlugin.launch_task, ("self", "token", "task")),
    "RuntimeHttpClient.from_server_address": (RuntimeHttpClient.from_server_address,
                                              ("server_address", "insecure", "root_certificates", "interceptors",
                                               "retry_invoker")),
    "run_clientapp_module.pull_and_inflate_object_from_tree": (
        getattr(run_clientapp_module, "pull_and_inflate_object_from_tree", None),
        ("object_tree", "pull_object_fn", "confirm_object_received_fn", "return_type", "max_concurrent_pulls",
         "max_time", "max_tries_per_object", "initial_backoff", "backoff_cap")),
    "_get_task_poll_interval": (_get_task_poll_interval, ()),
    "_handle_launch_result": (_handle_launch_result, ("result", "task")),
    "validate_and_resolve_root_certificates": (validate_and_resolve_root_certificates,
                                               ("root_cert_path", "insecure")),
}


def differences() -> list[str]:
    """What in the installed flwr differs from what this module expects (empty: nothing)."""
    out = []
    installed = version("flwr")
    if installed != FLWR_VERSION:
        out.append(f"flwr {installed} is installed; the warm executor was written against flwr {FLWR_VERSION}")
    fields = tuple(f.name for f in dataclasses.fields(ExecutionSpec))
    if fields != EXECUTION_SPEC_FIELDS:
        out.append(f"flwr...executor.types.ExecutionSpec has fields {fields}, expected {EXECUTION_SPEC_FIELDS}")
    for name, params in EXECUTOR_METHODS.items():
        got = _params(getattr(Executor, name, None))
        if got != params:
            out.append(f"flwr...executor.types.Executor.{name} takes {got}, expected {params}")
    for name, (fn, params) in CALLS.items():
        got = _params(fn)
        if got != params:
            out.append(f"flwr {name} takes {got}, expected {params}")
    if getattr(TaskType, "CLIENT_APP", None) != "flwr-clientapp":
        out.append("flwr.supercore.constant.TaskType.CLIENT_APP is not 'flwr-clientapp'")
    for field_name in ("supported_task_types", "agentapp_fab_hashes"):
        if field_name not in AcquireTaskRequest.DESCRIPTOR.fields_by_name:
            out.append(f"flwr.proto.runtime_pb2.AcquireTaskRequest has no field {field_name}")
    for status in ("ACCEPTED", "FAILED"):
        if not hasattr(LaunchResultStatus, status):
            out.append(f"flwr LaunchResultStatus has no {status}")
    if not hasattr(EventType, "RUN_SUPEREXEC_LEAVE"):
        out.append("flwr.supercore.telemetry.EventType has no RUN_SUPEREXEC_LEAVE")
    if not hasattr(make_simple_http_retry_invoker(), "max_tries"):
        out.append("flwr's RetryInvoker has no max_tries")
    return out


def answer_platform_probes() -> None:
    """Ask the interpreter's platform questions once in this process, for its forks to inherit.

    Flower's ClientApp runtime sends a telemetry event as it starts, and builds the event's payload
    even when FLWR_TELEMETRY_ENABLED=0 only skips the sending: `platform.architecture()` in it runs
    the `file` command on the interpreter, a process start in every worker. Its answer cannot change
    while the interpreter runs, so it is remembered (`functools.cache`, here in the warm parent
    only), as `platform.platform()` remembers its own."""
    probe = getattr(platform.architecture, "__wrapped__", platform.architecture)
    platform.architecture = functools.cache(probe)
    platform.architecture()
    platform.platform()


def prompt_object_pulls(initial_backoff_s: float = 0.05, backoff_cap_s: float = 0.25) -> None:
    """In this process, Flower's ClientApp runtime asks the SuperNode again for a message object
    not stored yet after `initial_backoff_s`, doubling up to `backoff_cap_s` (flwr's defaults: 1 s
    doubling up to 10 s). A SuperNode makes a task startable before it has pulled the message's
    objects from the SuperLink (flwr's supernode/start_client_internal.py stores the message
    first); a fresh `flwr-clientapp` process spends its imports meanwhile, a warm worker asks at
    once, and with flwr's defaults it would then wait a whole second (and up to ten) for objects
    that arrive milliseconds later. Each retry is one local request to the SuperNode; the tries
    allowed per object grow so that an object may take as long as with flwr's defaults (about
    5000 s) to arrive. The override is this module attribute of flwr's run_clientapp module, in a
    warm worker's own process only: the function and its arguments are Flower's."""
    pull = run_clientapp_module.pull_and_inflate_object_from_tree
    base = pull.func if isinstance(pull, functools.partial) else pull
    run_clientapp_module.pull_and_inflate_object_from_tree = functools.partial(
        base, initial_backoff=initial_backoff_s, backoff_cap=backoff_cap_s,
        max_tries_per_object=int(FLOWER_OBJECT_WAIT_S / backoff_cap_s))


def check() -> None:
    """Raise FlowerInternalsChanged naming every difference, or return quietly."""
    diff = differences()
    if diff:
        raise FlowerInternalsChanged(
            "the warm ClientApp executor relies on flwr internals that changed (federation/ops/flower_exec.py): "
            + "; ".join(diff) + ". " + HINT)


def _params(fn) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


__all__ = ["AcquireTaskRequest", "AutoExecPlugin", "EventType", "ExecutionSpec", "Executor", "FlowerInternalsChanged",
           "LaunchResult", "LaunchResultStatus", "RuntimeHttpClient", "RuntimeVersionHttpInterceptor",
           "SubprocessExecutor", "TaskType", "check", "differences", "make_simple_http_retry_invoker",
           "register_signal_handlers", "run_clientapp", "validate_and_resolve_root_certificates",
           "_get_task_poll_interval", "_handle_launch_result"]
