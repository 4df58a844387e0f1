"""Writes off the training path: one bounded queue and one thread per tracker.

`put` never blocks: a full queue drops the record and counts it. The thread calls the tracker; a
call that raises loses its record (counted, the first error kept); a tracker that cannot open
loses everything sent to it. One tracker's slowness holds only its own queue. At `close` the
thread gets `timeout_s` to write what is queued; what is left is dropped and counted, and the
count is said once.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracking.config import TrackingConfig
from tracking.process_tracker import ProcessTracker
from tracking.registry import tracker_class
from tracking.tracker import RunInfo, Tracker

log = logging.getLogger("sovfl.tracking")

_STOP = object()


class BoundedWriter:
    """One tracker fed from a bounded queue by a daemon thread (a thread stuck in a dead backend's
    call does not hold the process at exit)."""

    def __init__(self, tracker: Tracker, name: str, capacity: int, warn: Callable[[str], None]):
        self.tracker, self.name, self.warn = tracker, name, warn
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.dropped = 0  # records lost: queue full, a failed call, or left at close
        self.written = 0
        self.error: str | None = None  # the first failure
        self.broken = False  # open failed: nothing reaches the backend
        self._lock = threading.Lock()
        tracker.report_failure = self.failed
        self.thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def put(self, method: str, *args: Any) -> None:
        """Queue `tracker.method(*args)`; never blocks."""
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self._drop(None)

    def _drop(self, err: BaseException | None, records: int = 1) -> None:
        with self._lock:
            self.dropped += records
        if err is not None:
            self.failed(f"{type(err).__name__}: {err}")

    def failed(self, error: str) -> None:
        """The tracker failed: said once, at the first failure."""
        with self._lock:
            first = self.error is None
            self.error = self.error or error
        if first:
            self.warn(f"tracking: tracker {self.name} failed ({self.error}); the records it cannot take are "
                      "counted, and the count is logged when the run ends")

    def _run(self) -> None:
        try:
            self.tracker.open()
        except Exception as err:  # noqa: BLE001 - any backend failure: the run goes on without it
            self.broken = True
            self._drop(err, records=0)
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            if self.broken:
                self._drop(None)
                continue
            method, args = item
            try:
                getattr(self.tracker, method)(*args)
                self.written += 1
            except Exception as err:  # noqa: BLE001
                self._drop(err)
            if self.queue.empty() and not self.broken:
                try:
                    self.tracker.flush()
                except Exception as err:  # noqa: BLE001
                    self._drop(err)
        if not self.broken:
            try:
                self.tracker.close()
            except Exception as err:  # noqa: BLE001
                self._drop(err)

    def close(self, timeout_s: float) -> int:
        """Let the thread write what is queued for up to `timeout_s`; the records dropped in all.
        The stop marker waits for room as long as the deadline allows."""
        deadline = time.monotonic() + timeout_s
        try:
            self.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            marker = 1
        except queue.Full:
            marker = 0
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():  # left behind: nothing it took is known to be written
            self.tracker.abandon()
            with self._lock:
                self.dropped += self.written + max(0, self.queue.qsize() - marker)
                self.written = 0
                self.error = self.error or f"it did not finish within the close timeout ({timeout_s:.0f}s)"
        else:  # what the tracker took but could not write
            lost, error = self.tracker.lost()
            with self._lock:
                self.dropped, self.written = self.dropped + lost, self.written - lost
                self.error = self.error or error
        return self.dropped


class TrackingSession:
    """One party's trackers (`cfg.backends`), each behind its own BoundedWriter. Every method
    returns at once and never raises."""

    def __init__(self, cfg: TrackingConfig, run: RunInfo, warn: Callable[[str], None] | None = None):
        self.cfg, self.run = cfg, run
        self.warn = warn or log.warning
        self.writers: list[BoundedWriter] = []
        for i, spec in enumerate(cfg.backends):
            name = spec.kind if sum(b.kind == spec.kind for b in cfg.backends) == 1 else f"{spec.kind}[{i}]"
            if cfg.process:
                tracker: Tracker = ProcessTracker(spec, run)
            else:
                cls = tracker_class(spec.kind)
                tracker = cls(cls.Options.model_validate(spec.options), run)
            self.writers.append(BoundedWriter(tracker, name, cfg.queue_records, self.warn))
        self.closed = False

    def _put(self, method: str, *args: Any) -> None:
        if self.closed:
            return
        for w in self.writers:
            w.put(method, *args)

    def params(self, params: dict[str, str]) -> None:
        self._put("log_params", params)

    def metrics(self, metrics: dict[str, float], step: int, axis: str = "round") -> None:
        if metrics:
            self._put("log_metrics", metrics, step, axis)

    def rows(self, rows: list[tuple[int, dict[str, float]]], axis: str = "step") -> None:
        """Figures at several steps of `axis`, queued as one record (a site's flush)."""
        if rows:
            self._put("log_rows", rows, axis)

    def tags(self, tags: dict[str, str]) -> None:
        self._put("set_tags", tags)

    def close(self) -> dict[str, int]:
        """Write what is queued (within `close_timeout_s` in all) and end every tracker's run;
        tracker -> records dropped. Each tracker that dropped any says so once, with the count.
        Where each run is goes into the party's tracking.json."""
        if self.closed:
            return {}
        self.closed = True
        deadline = time.monotonic() + self.cfg.close_timeout_s
        dropped = {w.name: w.close(max(0.0, deadline - time.monotonic())) for w in self.writers}
        for w in self.writers:
            if w.dropped:
                self.warn(f"tracking: {w.dropped} record(s) dropped for tracker {w.name} ({self.run.party}), "
                          f"{w.written} written; first failure: {w.error or 'it did not keep up'}")
        self._write_index(dropped)
        return dropped

    def _write_index(self, dropped: dict[str, int]) -> None:
        """tracking.json in the party's workdir: each tracker, where its run is and what it lost
        (`sovfl report` names these runs)."""
        index = [{"tracker": w.name, "where": _safe_where(w.tracker), "written": w.written, "dropped": dropped[w.name]}
                 for w in self.writers]
        try:
            self.run.workdir.mkdir(parents=True, exist_ok=True)
            Path(self.run.workdir, "tracking.json").write_text(json.dumps(
                {"party": self.run.party, "trackers": index}, indent=2))
        except OSError as err:
            self.warn(f"tracking: cannot write {self.run.workdir}/tracking.json: {err}")


def _safe_where(tracker: Tracker) -> str:
    try:
        return tracker.where()
    except Exception as err:  # noqa: BLE001
        return f"unknown ({type(err).__name__})"


def open_session(cfg: TrackingConfig, run: RunInfo, warn: Callable[[str], None] | None = None
                 ) -> TrackingSession | None:
    """The party's tracking session, or None when `cfg` names no tracker."""
    return TrackingSession(cfg, run, warn) if cfg.enabled else None
