"""The round's checkpoint written off the round's critical path, on a thread of its own.

A checkpoint (model, momentum buffer, downlink reference, SHA-256'd and fsynced) takes seconds
at size, and the sites would idle through it. So the run's log (run_log.RunLog.commit) takes the
checkpoint's snapshot on the driver's thread (resume.checkpoint_job: the JSON state serialized,
the arrays by reference) and hands the write, then the round's metrics line, to
`CheckpointWriter`; the next round starts at once. The
next round waits for the write (`wait`) before anything it does could change what is being
written or need it on disk: when its first stage's replies are in (before they are aggregated:
the model and the optimizer's state change only after that) and before the run ends. So:

- a metrics line still reaches metrics.jsonl only after its round's checkpoint is complete;
- a resumed run finds the previous round's checkpoint whenever the coordinator died after the
  next round's first stage; dying during that stage (the window this buys) may find only the one
  before, and the resume reruns two rounds instead of one: the sites keep the residuals of their
  last 3 rounds for exactly that (federation/site/site_store.py), and every rerun round is a
  fresh SecAgg+ round;
- an error of the write (a full disk) is raised on the driver's thread at the next `wait`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CheckpointWriter:
    """At most one checkpoint write in flight; `wait` for it (and its error)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._seconds: float | None = None
        self.on_done: Callable[[float], None] | None = None  # run on the driver's thread by `wait`

    @property
    def busy(self) -> bool:
        """A write was started and not yet waited for."""
        return self._thread is not None

    def start(self, write: Callable[[], None], on_done: Callable[[float], None] | None = None) -> None:
        """Run `write` on a thread (after waiting for the previous one); `on_done(seconds)` runs on
        the driver's thread in the `wait` that finds it finished."""
        self.wait()
        self._error, self._seconds, self.on_done = None, None, on_done

        def run() -> None:
            t0 = time.monotonic()
            try:
                write()
            except BaseException as err:  # raised on the driver's thread by `wait`
                self._error = err
            finally:
                self._seconds = time.monotonic() - t0

        self._thread = threading.Thread(target=run, name="sovfl-checkpoint")
        self._thread.start()

    def wait(self) -> float:
        """Wait for the write in flight, if any; the seconds waited. Its error is raised here."""
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._thread.join()
        waited = time.monotonic() - t0
        self._thread, err, done, self.on_done = None, self._error, self.on_done, None
        self._error = None
        if err is not None:
            raise err
        if done is not None:
            done(self._seconds or 0.0)
        return waited
