"""Properties through which the coordinator shows its parts' attributes as its own.

`Coordinator.model` is its `RunState`'s model, `Coordinator.sites` its roster's sites, and so on:
one place to read them for tools and tests, while each part owns its own.
"""

from __future__ import annotations


def state_field(name: str) -> property:
    """The owner's `state.<name>` (run_state.RunState), read and written."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v),
                    doc=f"The run state's `{name}` (run_state.py).")


def part_field(part: str, name: str) -> property:
    """The owner's `<part>.<name>`, read and written."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, v: setattr(getattr(self, part), name, v), doc=f"`{part}.{name}`.")
