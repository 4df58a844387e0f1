"""Folding a stage's replies while the next ones are pulled: the driver's receive, concurrent.

A SecAgg+ train stage brings one large masked reply per site (63 MB each for a 28M-parameter model
at an 18-bit ring), and checking one (SHA-256 of every chunk, the signature, unpacking the ring
words and adding them) took seconds of CPU. Folded one after the other on the driver's thread,
the replies that arrived meanwhile waited on the SuperLink: 14-30 s of a WAN benchmark round went
to that (README, "Time to loss across wide-area links"). `Folds` runs a step's `receive` on a
small pool instead, one reply per thread, while the driver goes on pulling: hashing, AES and
numpy's loops release the GIL, so the folds overlap each other and the pulls. At most `workers`
replies are held (pulled and not yet folded); the driver pulls no further reply until one is
done, so memory stays bounded as with one (`workers` = 1 folds inline on the driver's
thread).

Each fold's span (start, end, seconds after the stage's push began) is kept by site: the stage's
`receive_s` is the time any fold ran (their union), `receive_busy_s` their sum.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from federation.coordinator.strategy import ExchangeResult, Reply


class Folds:
    """The folds of one stage: `submit` each good reply, `close` once the stage is over."""

    def __init__(self, receive: Callable[[Reply], None], workers: int, t0: float, result: ExchangeResult):
        self.receive, self.t0, self.result = receive, t0, result
        self.workers = max(1, int(workers))
        self._pool = (ThreadPoolExecutor(self.workers, thread_name_prefix="sovfl-receive")
                      if self.workers > 1 else None)
        self._running: set[Future] = set()

    def room(self) -> bool:
        """Whether another reply may be pulled now (fewer than `workers` folds are running)."""
        self._reap()
        return len(self._running) < self.workers

    def submit(self, reply: Reply) -> None:
        """Fold `reply`: on a worker thread, or here when there is one worker."""
        if self._pool is None:
            self._fold(reply)
        else:
            self._running.add(self._pool.submit(self._fold, reply))

    def wait(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, waking early when a running fold ends (its slot is free)."""
        if not self._running:
            time.sleep(max(0.0, timeout))
            return
        wait(self._running, timeout=max(0.0, timeout), return_when=FIRST_COMPLETED)
        self._reap()

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every fold; then the stage's receive seconds. The first error a fold raised is
        raised here (after all have ended, so no fold is still changing the strategy's state)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        running, self._running = self._running, set()
        spans = sorted(self.result.receive_spans.values())
        self.result.receive_busy_s = sum(end - start for start, end in spans)
        self.result.receive_s, last = 0.0, float("-inf")
        for start, end in spans:  # the union of the spans
            self.result.receive_s += max(0.0, end - max(start, last))
            last = max(last, end)
        if raise_errors:
            for f in running:
                f.result()

    def _reap(self) -> None:
        done = {f for f in self._running if f.done()}
        self._running -= done
        for f in done:
            f.result()  # a fold's error ends the stage as it did inline

    def _fold(self, reply: Reply) -> None:
        start = time.monotonic()
        try:
            self.receive(reply)
        finally:
            end = time.monotonic()
            self.result.receive_spans[reply.name] = (start - self.t0, end - self.t0)  # one key per thread


class StripeLocks:
    """Locks over fixed stripes of one shared array (SecAgg+'s ring accumulator), so that folds on
    several threads add into it at once: a fold holds the stripes its slice touches, taken in
    ascending order (no two folds can wait on each other), and two folds never update the same
    words at the same time whatever slices the replies claim."""

    def __init__(self, length: int, stripe: int):
        self.stripe = max(1, int(stripe))
        self._locks = [threading.Lock() for _ in range(max(1, -(-int(length) // self.stripe)))]

    @contextmanager
    def hold(self, offset: int, count: int) -> Iterator[None]:
        """Hold the stripes of [offset, offset + count) (clamped to the array) for the block."""
        first = min(len(self._locks) - 1, max(0, offset // self.stripe))
        last = min(len(self._locks) - 1, max(first, (offset + max(1, count) - 1) // self.stripe))
        held = self._locks[first:last + 1]
        for lock in held:
            lock.acquire()
        try:
            yield
        finally:
            for lock in reversed(held):
                lock.release()
