"""Flower's Grid with the SuperLink's transient errors retried.

A SuperLink under load answers some calls with HTTP 500 (`sqlite3.OperationalError: database is
locked` with `--database`), and a restart or a proxy resets connections; flwr 1.41's HttpGrid
raises either to the ServerApp, which would end the whole run on one such answer. Every call
the driver makes goes through here: a transient error is retried with backoff (0.25 s
doubling to 8 s) for up to `budget_s` from the call's start, each retry counted and said once per
streak; anything else, or a SuperLink down past the budget, is raised (`--resume` then
continues the run from its last checkpoint).

Retrying a push may push a message twice if the failed attempt stored it; messages are content
addressed (their id is their hash), so the SuperLink keeps one, and a site handles a round's
message once.
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import httpx

try:  # the gRPC transports of older Flower releases
    import grpc
except ImportError:  # pragma: no cover
    grpc = None


def transient(err: BaseException) -> bool:
    """Whether `err` is worth retrying: a 5xx/429/408 answer, a broken or refused connection, a
    locked database, an unavailable gRPC peer."""
    if isinstance(err, httpx.HTTPStatusError):
        code = err.response.status_code
        return code >= 500 or code in (408, 429)
    if isinstance(err, (httpx.TransportError, ConnectionError, TimeoutError)):
        return True
    if isinstance(err, sqlite3.OperationalError):
        return "locked" in str(err) or "busy" in str(err)
    if grpc is not None and isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return "database is locked" in str(err)


class RetryingGrid:
    """A Grid whose push, pull and node listing survive the SuperLink's transient errors."""

    def __init__(self, grid: Any, budget_s: float, progress: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.inner, self.budget_s = grid, budget_s
        self.progress = progress or (lambda line: None)
        self.sleep = sleep
        self.retries: Counter[str] = Counter()  # call -> retries over the run

    def __getattr__(self, name: str) -> Any:  # run, create_message, ...: as the inner Grid has them
        return getattr(self.inner, name)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        end, wait, said = time.monotonic() + self.budget_s, 0.25, False
        while True:
            try:
                out = fn()
                if said:
                    self.progress(f"SuperLink: {what} went through after {self.retries[what]} retr(ies) so far")
                return out
            except Exception as err:
                left = end - time.monotonic()
                if not transient(err) or left <= 0:
                    if transient(err):
                        raise TimeoutError(f"the SuperLink kept failing {what} for {self.budget_s:.0f}s "
                                           f"(deadlines.superlink_retry_s); last error: {type(err).__name__}: "
                                           f"{str(err)[:300]}; continue the run with --resume") from err
                    raise
                self.retries[what] += 1
                if not said:
                    self.progress(f"SuperLink: {what} failed ({type(err).__name__}: {str(err)[:200]}); "
                                  f"retrying for up to {left:.0f}s")
                    said = True
                self.sleep(min(wait, left))
                wait = min(wait * 2, 8.0)

    def push_messages(self, messages: Iterable) -> list[str]:
        """Grid.push_messages, retried."""
        msgs = list(messages)
        return list(self._call("push_messages", lambda: self.inner.push_messages(msgs)))

    def pull_messages(self, message_ids: Iterable[str]) -> list:
        """Grid.pull_messages, retried."""
        ids = list(message_ids)
        return list(self._call("pull_messages", lambda: self.inner.pull_messages(ids)))

    def get_node_ids(self) -> list[int]:
        """Grid.get_node_ids, retried."""
        return list(self._call("get_node_ids", lambda: self.inner.get_node_ids()))
