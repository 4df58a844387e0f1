"""Trackers found by name: the entry points of group `sovereign_fl.trackers` (a user's package
registers its own the same way), or an import path `pkg.module:Class`."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from pydantic import BaseModel

from tracking.tracker import Tracker

GROUP = "sovereign_fl.trackers"


def names() -> list[str]:
    """The installed trackers' names."""
    return sorted(ep.name for ep in entry_points(group=GROUP))


def tracker_class(kind: str) -> type[Tracker]:
    """The Tracker class named `kind`; a clear error naming the installed ones when there is none."""
    if ":" in kind:
        module, _, attr = kind.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    else:
        found = [ep for ep in entry_points(group=GROUP) if ep.name == kind]
        if not found:
            raise ValueError(f"no tracker {kind!r}: installed trackers (entry points {GROUP}) are {names()}; "
                             "or give an import path 'pkg.module:Class'")
        cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        raise ValueError(f"tracker {kind!r} is {cls!r}, not a subclass of tracking.tracker.Tracker")
    return cls


def options_model(kind: str) -> type[BaseModel]:
    """The pydantic model a tracker's options are checked against."""
    return tracker_class(kind).Options
