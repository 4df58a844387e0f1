"""Rank 0's request pump and the command every rank runs next.

Global rank 0 serves the site's endpoint, queues each request, checks it and broadcasts a small
command (train, evaluate, export, background steps, heartbeat, stop) that every rank then runs in
lock-step, so that no rank ever waits on a collective another rank did not enter. Heartbeats keep
idle collectives from reaching their timeout; SIGTERM or the endpoint's Stop only set a flag, read
at the next command. The session (`session.Session`) owns one `CommandLoop` and runs the rounds it
yields.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from site_trainer import endpoint, handoff, layout, update_files

log = logging.getLogger("sovfl.trainer")

HEARTBEAT_S = 5.0
POLL_S = 0.2  # how often rank 0 looks at the stop flag while idle


class RequestRejected(ValueError):
    """A round request is unusable (wrong model layout, non-finite values): answered, not trained."""


class _Request:
    """Rank 0's side of one command: the caller's future and the open global model."""

    def __init__(self, method: str, request: dict, fut: Future | None, reader: handoff.Reader | None):
        self.method, self.request, self.fut, self.reader = method, request, fut, reader
        # the update's file, made ready while the round trains (one of the trainer's own, or a one-off)
        self.update: handoff.Writer | update_files.OwnedWriter | None = None
        self.premapped: handoff.Premapped | None = None  # the global model, mapped while the round trains

    def answer(self, reply: dict) -> None:
        fut, self.fut = self.fut, None
        if fut is None:
            return
        if fut.set_running_or_notify_cancel():
            fut.set_result(reply)
        elif not handoff.owned_path(reply.get("update")):  # nobody waits any more: free a one-off file
            handoff.release((reply.get("update") or {}).get("path"))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.premapped is not None:
            self.premapped.drop()
            self.premapped = None
        if self.update is not None:  # the round ended without an update: nobody will read the file
            self.update.abandon()
            self.update = None


def open_global(request: dict, expected: layout.Layout) -> handoff.Reader:
    """Rank 0: open the request's global model and check its layout (names, dtypes, shapes)
    before any rank sees it; values are checked as they load. RequestRejected says what is wrong."""
    try:
        reader = handoff.Reader(handoff.Handle.from_json(request["global"]))
    except (KeyError, OSError, ValueError) as err:
        raise RequestRejected(f"cannot read the global model hand-off: {err}") from None
    try:
        check_layout(reader, expected)
    except BaseException:
        reader.close()
        raise
    return reader


def check_layout(reader: handoff.Reader, expected: layout.Layout) -> None:
    """The global model's tensors are the site's exchanged tensors, in order, each in a wire dtype
    and shape it accepts; RequestRejected names the first that is not."""
    names = expected.names
    if list(reader) != names:
        missing = sorted(set(names) - set(reader))
        extra = sorted(set(reader) - set(names))
        raise RequestRejected(f"global model does not match this site's model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    for e, spec in zip(reader.handle.entries, expected.exchanged):
        ok = layout.accepted_wire(spec.dtype)
        if e.dtype not in ok or e.shape != spec.shape:
            raise RequestRejected(f"global tensor {e.name}: got {e.dtype}{e.shape}, expected "
                                  f"{' or '.join(ok)}{spec.shape} ({layout.dtype_name(spec.dtype)})")


class CommandLoop:
    """The session's command pump: the endpoint's requests queued on rank 0 (gRPC threads), taken
    by the ranks' loop one command at a time. `session` is the `Session` that owns it: the rounds
    it begins and ends, its checkpoints, overlap and exports are the session's."""

    def __init__(self, session: Any):
        self.session = session
        self.commands: queue.Queue = queue.Queue()
        self.stop_requested = False
        self.idle_s = 0.0  # rank 0: seconds waiting for a command since the last train reply

    def handle(self, method: str, request: dict) -> dict:
        """Called on gRPC threads: queue the work for the ranks' loop and wait for its answer."""
        s = self.session
        if method == "Info":
            return s.info()
        if method == "Stop":
            self.stop_requested = True
            return {"ok": True, "stopping": True}
        fut: Future = Future()
        self.commands.put((method, request, fut))
        try:
            return fut.result(timeout=float(request.get("timeout_s", 600)))
        except TimeoutError:
            fut.cancel()
            return {"ok": False, "error": f"site {s.site}: {method} did not finish in time"}

    def rounds(self) -> Iterator[Any]:
        """Collective: the session's rounds, the same on every rank, until the trainer is stopped
        (see `Session.rounds`)."""
        s = self.session
        server = self._serve() if s.rank == 0 else None
        previous = self._catch_sigterm()
        try:
            while True:
                req, kind = self._next_command()
                if kind == "stop":
                    return
                if kind is None:
                    continue
                rnd = s._begin(req, kind)
                if rnd is None:
                    continue
                try:
                    yield rnd
                except GeneratorExit:  # the loop was left mid-round: answer, then let it close
                    s._end(rnd, closing=True)
                    raise
                s._end(rnd)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if server is not None:
                self._shutdown(server)

    def serve_one(self, method: str, request: dict, body) -> dict:
        """Collective: one request handed over in-process (see `Session.serve_one`)."""
        s = self.session
        kind = {"Train": "train", "Evaluate": "evaluate"}[method]
        fut: Future | None = Future() if s.rank == 0 else None
        reader = s.open_global(request) if s.rank == 0 else None
        rnd = s._begin(_Request(method, request, fut, reader), kind)
        if rnd is not None:
            try:
                body(rnd)
            finally:
                s._end(rnd)
        return fut.result(timeout=0) if fut is not None else {}

    def _catch_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_term(signum, frame):  # noqa: ARG001 - only a flag: the loop ends at its next command
            self.stop_requested = True
        return signal.signal(signal.SIGTERM, on_term)

    def _serve(self):
        s = self.session
        server = endpoint.serve(s.config.socket, s.handle)
        Path(s.config.socket + ".ready").write_text(json.dumps(s.info()))
        log.info("site %s: trainer ready with %d rank(s) on %s", s.site, s.world, s.config.socket)
        return server

    def _shutdown(self, server) -> None:
        s = self.session
        server.stop(grace=1.0)
        if s._current is not None:
            s._current.answer({"ok": False, "error": f"site {s.site}: the training loop stopped"})
            s._current.close()
        while True:
            try:
                _, _, fut = self.commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_result({"ok": False, "error": f"site {s.site}: the trainer is stopping"})
        for path in s.last_files:
            handoff.release(path)
        s.close_files()
        for p in (s.config.socket, s.config.socket + ".ready"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def _take_request(self) -> tuple[str, dict, Future | None]:
        """Rank 0: the next request, background steps while they are due and none came (federation.
        overlap), a heartbeat when none came in time, or Stop. Time spent waiting is idle time."""
        s = self.session
        background = s.overlap.pending
        now = time.monotonic()
        end = now + (0.0 if s.ckpt_due is not None or background else HEARTBEAT_S)  # a due checkpoint: now
        try:
            while not self.stop_requested:
                try:
                    method, request, fut = self.commands.get(timeout=max(0.0, min(POLL_S, end - time.monotonic())))
                    return method, request, fut
                except queue.Empty:
                    if time.monotonic() >= end:
                        if background:
                            return "Step", {"steps": self._background_chunk()}, None
                        return "Heartbeat", {}, None
            return "Stop", {}, None
        finally:
            if not background and s.ckpt_due is None:
                self.idle_s += time.monotonic() - now

    def _background_chunk(self) -> int:
        """Rank 0: how many background steps to run before looking for a request again: about
        POLL_S of work (one step at first), never past the budget."""
        ov = self.session.overlap
        per_step = ov.seconds / ov.steps if ov.steps else POLL_S
        return max(1, min(ov.budget - ov.steps, int(POLL_S / max(per_step, 1e-6))))

    def _next_command(self) -> tuple[_Request | None, str | None]:
        """Collective: rank 0 takes the next request and tells every rank what to run ("train",
        "evaluate", "stop" or None for a heartbeat), writing a due local checkpoint first."""
        s = self.session
        if s.rank == 0:
            method, request, fut = self._take_request()
            ckpt = None
            if s.ckpt_due is not None:
                ckpt, s.ckpt_due = s.ckpt_due, None
            reader = None
            if method in ("Train", "Evaluate"):
                for path in s.last_files:  # the previous reply has been read by now
                    handoff.release(path)
                s.last_files = []
                try:
                    if fut.cancelled():
                        raise RequestRejected("the caller gave up before the request was taken")
                    reader = s.open_global(request)
                except RequestRejected as err:
                    if not fut.cancelled():
                        fut.set_result({"ok": False, "error": f"site {s.site}: {err}"})
                    method, request, fut = "Heartbeat", {}, None
            elif method == "Export":
                pass  # every rank streams its part (below)
            elif fut is not None:  # a caller's method the loop does not run (Heartbeat, Step, Stop are its own)
                fut.set_result({"ok": False, "error": f"site {s.site}: unknown method {method!r}"})
                method, request, fut = "Heartbeat", {}, None
            header = [method, {k: v for k, v in request.items() if k != "global"}, ckpt]
        else:
            header, fut = [None, None, None], None
        if s.world > 1:
            dist.broadcast_object_list(header, src=0)
        method, request, ckpt = header
        if ckpt is not None:
            s.save_checkpoint(ckpt)
        if method == "Stop":
            return None, "stop"
        if method == "Heartbeat":
            return None, None
        if method == "Step":  # every rank: the same background steps (site_trainer/overlap.py)
            s.overlap.run(int(request["steps"]))
            return None, None
        if method == "Export":
            s._export(fut)
            return None, None
        req = _Request(method, request, fut, reader) if s.rank == 0 else _Request(method, request, None, None)
        return req, {"Train": "train", "Evaluate": "evaluate"}[method]
