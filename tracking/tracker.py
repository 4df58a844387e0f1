"""The tracker plug-in interface.

A tracker writes one party's figures to one backend. Subclass `Tracker`, give it an `Options`
pydantic model, register it under the entry point group `sovereign_fl.trackers` and name it in
`tracking.backends[].kind`. Its methods run in a helper process of its own (process_tracker.py) or,
with `tracking.process: false`, on a thread (writer.BoundedWriter), never on the training path; one
that raises loses that record (counted) and the run goes on. Import the
backend's library inside `open`, not at module level: the configuration finds the class without
importing the library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class NoOptions(BaseModel):
    """A tracker without options."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class RunInfo:
    """Who writes and where: `party` is 'coordinator' or 'site-<id>', `workdir` that party's run
    directory (relative paths in options are under it), `experiment` the federation's name."""

    party: str
    workdir: Path
    experiment: str


class Tracker:
    """One backend for one party's run. Steps: `axis` says what `step` counts ('round' or 'step',
    an optimizer step); a backend that has one step counter per run keeps one per axis."""

    Options: type[BaseModel] = NoOptions

    def __init__(self, options: BaseModel, run: RunInfo):
        self.options, self.run = options, run
        # set by the writer: how a tracker reports a failure it learns of outside its own calls
        self.report_failure: Callable[[str], None] = lambda error: None

    def open(self) -> None:
        """Start the backend's run (import the library here)."""

    def log_params(self, params: dict[str, str]) -> None:
        """The run's configuration, flattened to dotted keys."""

    def log_metrics(self, metrics: dict[str, float], step: int, axis: str) -> None:
        """Figures at `step` of `axis`; keys are '/'-separated paths."""

    def log_rows(self, rows: list[tuple[int, dict[str, float]]], axis: str) -> None:
        """Figures at several steps (a site's flush); override where the backend takes them in one call."""
        for step, metrics in rows:
            self.log_metrics(metrics, step, axis)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Labels of the run (the final model's digest, the checkpoint a user exports)."""

    def flush(self) -> None:
        """Make what was written visible to readers (called when the queue runs empty)."""

    def close(self) -> None:
        """End the backend's run."""

    def lost(self) -> tuple[int, str | None]:
        """Records this tracker accepted but could not write, and the first error (a tracker that
        writes elsewhere, as process_tracker.py does, learns of them late)."""
        return 0, None

    def abandon(self) -> None:
        """The party stops waiting for this tracker (its close timed out): release what can be
        released without waiting (a helper process is killed); a thread's call cannot be stopped."""

    def where(self) -> str:
        """Where a user finds this run (a directory, a URI and run id): for the run's tracking.json."""
        return ""
