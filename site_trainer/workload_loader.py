"""Finding a workload: a `Task` class or a script's model factory, by entry point or import path.

`workload.task` is either an entry point name of group `sovereign_fl.workloads` (the built-ins
`digits`, `slm` and `hf-causal-lm` are registered there by this package's pyproject.toml, exactly
like a user's) or an import path `pkg.module:Class`. Every way this can go wrong is a
`WorkloadError` that names the field, what was found and the fix; configuration loading turns it
into an error of the file, before any process starts.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    import torch.nn as nn

    from site_trainer.workload import Task, TaskContext

GROUP = "sovereign_fl.workloads"


class WorkloadFields(Protocol):
    """What the loader reads of a workload's configuration (site_trainer.config.WorkloadConfig,
    whose validators call this module)."""

    task: str | None
    options: dict[str, Any]
    script: str | None
    model: str | None


class SiteFields(Protocol):
    """What the loader reads of a site's configuration (site_trainer.config.SiteConfig)."""

    id: str
    script: str | None
    workload_options: dict[str, Any]


class WorkloadError(ValueError):
    """A workload that cannot be used; the message names the field, what is wrong and the fix."""


def registered() -> dict[str, metadata.EntryPoint]:
    """Installed workloads by entry point name (the first distribution wins a repeated name)."""
    out: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        out.setdefault(ep.name, ep)
    return out


def _import_path(ref: str, field: str) -> Any:
    """The object named by `pkg.module:attr` (attr may be dotted: `Outer.Inner`)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise WorkloadError(f"{field}: {ref!r} is not an import path; write 'pkg.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # user code may fail in any way while importing
        raise WorkloadError(f"{field}: cannot import module {module_name!r} of {ref!r} ({type(err).__name__}: {err}); "
                            "install the package that provides it (pip install -e ...) or fix the path") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            known = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module_name)
            raise WorkloadError(f"{field}: module {module_name!r} has no attribute {attr!r}"
                                f"{f' (it defines: {known})' if known else ''}; fix the name after the ':'")
        obj = getattr(obj, part)
    return obj


def resolve(ref: str, field: str = "workload.task") -> Any:
    """The object a workload reference names: an entry point name or an import path."""
    if ":" in ref:
        return _import_path(ref, field)
    eps = registered()
    if ref not in eps:
        names = ", ".join(sorted(eps)) or "none installed"
        raise WorkloadError(f"{field}: {ref!r} is neither a registered workload ({names}: entry points of group "
                            f"{GROUP}) nor an import path 'pkg.module:Class'; use one of those names, or register "
                            f"yours under [project.entry-points.\"{GROUP}\"] in its pyproject.toml")
    ep = eps[ref]
    try:
        return ep.load()
    except Exception as err:
        dist = f" by {ep.dist.name}" if getattr(ep, "dist", None) is not None else ""
        raise WorkloadError(f"{field}: workload {ref!r} is registered ({ep.value}{dist}) but does not import "
                            f"({type(err).__name__}: {err}); reinstall the package that provides it "
                            "(pip install -e ...) or fix its entry point") from None


@functools.lru_cache(maxsize=None)
def task_class(ref: str) -> type[Task]:
    """The `Task` subclass `ref` names, checked: a class, a Task, every abstract method implemented,
    an `Options` pydantic model."""
    from site_trainer.workload import Task

    obj = resolve(ref)
    what = f"workload.task: {ref!r}"
    if not inspect.isclass(obj) or not issubclass(obj, Task):
        kind = type(obj).__name__ if not inspect.isclass(obj) else f"class {obj.__qualname__}"
        raise WorkloadError(f"{what} is a {kind}, not a subclass of site_trainer.workload.Task; a declarative task "
                            "subclasses Task and implements build_model, build_data and loss (an existing torchrun "
                            "script goes in workload.script, with the session)")
    missing = sorted(getattr(obj, "__abstractmethods__", ()))
    if missing:
        raise WorkloadError(f"{what} ({obj.__qualname__}) does not implement {', '.join(missing)}: every task "
                            "implements build_model, build_data and loss (site_trainer/workload.py)")
    opts = getattr(obj, "Options", None)
    if not (inspect.isclass(opts) and issubclass(opts, BaseModel)):
        raise WorkloadError(f"{what} ({obj.__qualname__}): Options must be a pydantic BaseModel subclass "
                            f"(got {opts!r}); use site_trainer.workload.NoOptions for a task without options")
    return obj


def validate_options(cls: type[Task], options: dict[str, Any], where: str, label: str) -> BaseModel:
    """`options` through the task's own pydantic model; errors name each field under `where`."""
    try:
        return cls.Options.model_validate(options)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(f"{where}{'.' + loc if loc else ''}: {msg}")
        raise WorkloadError("; ".join(problems) + f" (task {label}, options model {cls.__qualname__}.Options)"
                            ) from None


def model_factory(ref: str) -> Callable[[dict[str, Any]], nn.Module]:
    """A script workload's `factory(options) -> nn.Module`, checked to be callable with one argument."""
    factory = _import_path(ref, "workload.model") if ":" in ref else None
    if factory is None:
        raise WorkloadError(f"workload.model: {ref!r} is not an import path; write 'pkg.module:factory' naming "
                            "a function factory(options: dict) -> torch.nn.Module")
    if not callable(factory):
        raise WorkloadError(f"workload.model: {ref!r} is a {type(factory).__name__}, not a callable; it must name "
                            "a function factory(options: dict) -> torch.nn.Module")
    try:
        inspect.signature(factory).bind({})
    except TypeError:
        raise WorkloadError(f"workload.model: {ref!r} must accept one argument, the workload options: "
                            "factory(options: dict) -> torch.nn.Module") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return factory


def check_workload(cfg: WorkloadFields) -> None:
    """Everything about the workload that can be checked without a site: the task imports, is a
    complete Task and accepts `options`; or the script's model factory imports."""
    if cfg.task is not None:
        validate_options(task_class(cfg.task), cfg.options, "workload.options", repr(cfg.task))
    else:
        model_factory(cfg.model or "")


def check_site(cfg: WorkloadFields, site: SiteFields) -> None:
    """One site's view of the workload: its merged options, or the script on this machine."""
    if site.script is not None and not Path(site.script).is_file():
        raise WorkloadError(f"sites[{site.id}].script: {site.script} does not exist on this machine; give the path of "
                            "the site's torchrun script (relative paths are resolved from the config file's directory)")
    if cfg.task is not None:
        if site.workload_options:
            validate_options(task_class(cfg.task), merge_options(cfg.options, site.workload_options),
                             f"sites[{site.id}].workload_options (merged over workload.options)", repr(cfg.task))
        return
    script = Path(cfg.script or "")
    if not script.is_file():
        raise WorkloadError(f"workload.script: {script} does not exist on site {site.id}'s machine; give the path "
                            "of the torchrun script (relative paths are resolved from the directory sovfl runs in)")


def check_sites(cfg: WorkloadFields, sites: list[SiteFields]) -> None:
    """`check_site` for every site: for the federation's schema, so that a bad per-site option is
    refused when the file is loaded rather than when that site's trainer starts."""
    for site in sites:
        check_site(cfg, site)


def build_task(cfg: WorkloadFields, ctx: TaskContext, options: dict[str, Any] | None = None) -> Task:
    """An instance of the configured task for `ctx` (options: the site's merged options)."""
    if cfg.task is None:
        raise WorkloadError("this workload is a script (workload.script): it has no Task to build")
    cls = task_class(cfg.task)
    opts = options if options is not None else cfg.options
    validated = validate_options(cls, opts, "workload.options", repr(cfg.task))
    try:
        return cls(validated, ctx)
    except WorkloadError:
        raise
    except ValueError as err:  # a task refuses what its options point at (a model directory, a data glob)
        raise WorkloadError(f"task {cfg.task!r} on site {ctx.site}: {err}") from None


def merge_options(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`: nested mappings merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out
