"""A tracker run in a process of its own (`tracking.process: true`, the default): the backend's
Python work (MLflow's SQL, protobuf encoding) never competes with the party's training loop for the
interpreter. The party's writer thread only pickles each call into a pipe; when the child is slow
the pipe fills, that thread waits outside the interpreter lock, and its bounded queue drops and
counts (writer.py)."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any

from tracking.config import BackendSpec
from tracking.tracker import NoOptions, RunInfo, Tracker


class ProcessTracker(Tracker):
    """Forwards every call to `python -m tracking.child` running the tracker `spec` names."""

    Options = NoOptions

    def __init__(self, spec: BackendSpec, run: RunInfo):
        super().__init__(NoOptions(), run)
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.done: dict | None = None
        self.reported = False

    def _send(self, *call: Any) -> None:
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)

    def _read(self) -> None:
        for line in self.proc.stdout:
            doc = json.loads(line)
            if "failed" in doc and not self.reported:
                self.reported = True
                self.report_failure(doc["failed"])
            elif "done" in doc:
                self.done = doc["done"]

    def open(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tracking.child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.reader = threading.Thread(target=self._read, name=f"tracker-{self.spec.kind}-reader", daemon=True)
        self.reader.start()
        self._send(self.spec.kind, dict(self.spec.options), self.run.party, str(self.run.workdir), self.run.experiment)

    def log_params(self, params: dict[str, str]) -> None:
        self._send("log_params", (params,))

    def log_metrics(self, metrics: dict[str, float], step: int, axis: str) -> None:
        self._send("log_metrics", (metrics, step, axis))

    def log_rows(self, rows: list[tuple[int, dict[str, float]]], axis: str) -> None:
        self._send("log_rows", (rows, axis))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("set_tags", (tags,))

    def flush(self) -> None:
        self._send("flush", ())
        self.proc.stdin.flush()

    def close(self) -> None:
        """Ask the child to end its run; wait for its account (the writer's close bounds the wait)."""
        self._send("close", ())
        self.proc.stdin.close()
        self.reader.join()
        self.proc.wait()

    def abandon(self) -> None:
        """Kill the child: a party that no longer waits for it leaves no process behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def lost(self) -> tuple[int, str | None]:
        done = self.done or {}
        return int(done.get("failed", 0)), done.get("error")

    def where(self) -> str:
        return (self.done or {}).get("where") or "(not reported)"
