"""`python -m tracking.child`: one tracker in a process of its own (tracking/process_tracker.py).

Reads length-prefixed pickled calls on stdin, the first naming the tracker; answers on stdout with
JSON lines: `{"failed": ERROR}` at the first call that fails, `{"done": {...}}` when told to close
or when stdin ends (the party stopped: it ignores SIGINT and SIGTERM, which a party's process group
may get, and writes what it was sent). Runs at a lower priority than the party it serves: its work yields to training.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import sys
from pathlib import Path

from tracking.registry import tracker_class
from tracking.tracker import RunInfo


def _frames(stream):
    while True:
        head = stream.read(4)
        if len(head) < 4:
            return
        (size,) = struct.unpack("<I", head)
        yield pickle.loads(stream.read(size))


def _say(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> None:
    os.nice(10)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the party's stop must not cut its last records: stdin's end does
        signal.signal(sig, signal.SIG_IGN)
    frames = _frames(sys.stdin.buffer)
    kind, options, party, workdir, experiment = next(frames)
    cls = tracker_class(kind)
    tracker = cls(cls.Options.model_validate(options), RunInfo(party, Path(workdir), experiment))
    failed, error, broken = 0, None, False
    try:
        tracker.open()
    except Exception as err:  # noqa: BLE001 - reported to the party, which goes on without it
        error, broken = f"{type(err).__name__}: {err}", True
        _say({"failed": error})
    for method, args in frames:
        if method == "close":
            break
        if broken:
            failed += method != "flush"
            continue
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # noqa: BLE001
            failed += method != "flush"
            if error is None:
                error = f"{type(err).__name__}: {err}"
                _say({"failed": error})
    if not broken:
        try:
            tracker.close()
        except Exception as err:  # noqa: BLE001
            error = error or f"{type(err).__name__}: {err}"
    try:
        where = tracker.where()
    except Exception as err:  # noqa: BLE001
        where = f"unknown ({type(err).__name__})"
    _say({"done": {"failed": failed, "error": error, "where": where}})


if __name__ == "__main__":
    main()
