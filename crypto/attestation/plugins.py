"""One plug-in lookup for verifiers and attesters: built-ins first, then installed entry points."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, TypeVar

from .errors import AttestationError

T = TypeVar("T")


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def available(group: str, builtins: Mapping[str, str]) -> dict[str, str]:
    """name -> "module:Class" for built-ins and installed plug-ins (built-ins win on a clash)."""
    out = {ep.name: ep.value for ep in entry_points(group=group)}
    out.update(builtins)
    return out


def load_class(name: str, *, group: str, builtins: Mapping[str, str], base: type[T],
               error: type[AttestationError]) -> type[T]:
    """The class registered as ``name``; ``error`` names what is installed when it is missing."""
    if name in builtins:
        cls = _load(builtins[name])
    else:
        eps = [ep for ep in entry_points(group=group) if ep.name == name]
        if not eps:
            raise error(f"no {base.__name__.lower()} {name!r}; installed: {sorted(available(group, builtins))}")
        cls = eps[0].load()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"entry point {name!r} in {group} does not name a {base.__name__} subclass")
    return cls
