"""The site's side of the downlink: the reference file and the relay's global-model receive path.

The ClientApp is a fresh process per message, so the model a site holds lives in a file in the
site trainer's workdir (`downlink/`), in the hand-off layout: the relay passes that very file to
the trainer as the round's global model (no extra copy) and it survives restarts of the trainer
and of the SuperNode. `reference.json` names the current file and its digest; it is replaced
atomically, so a crash leaves the old reference or the new one, never a torn one. numpy only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flwr.app import RecordDict

from federation.protocol.downlink_steps import DIGEST_KEY, RECORD, Arrays, DownlinkError, reconstruct
from federation.protocol.payload_records import from_records
from site_trainer import endpoint, handoff

STALE_S = 3600.0  # reference files older than this and not current are left-overs of a crash


class ReferenceStore:
    """The model this site holds, as a hand-off file under `directory`."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.index = self.dir / "reference.json"

    def load(self) -> tuple[str, Arrays, handoff.Handle] | None:
        """(digest, arrays mapped in place, handle), or None when there is no usable reference."""
        try:
            doc = json.loads(self.index.read_text())
            handle = handoff.Handle.from_json(doc["handle"])
            return str(doc["digest"]), handoff.map_arrays(handle), handle
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none yet, or unreadable: the coordinator's next full model replaces it

    def save(self, arrays: Arrays, digest: str) -> handoff.Handle:
        """Write `arrays` as the new reference and make it current; old files are removed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        old = self.load()
        handle = handoff.write_arrays(arrays, tag="reference", directory=self.dir)
        _fsync(handle.path)  # on disk before the index names it: a power cut cannot leave a torn model
        tmp = self.index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"digest": digest, "handle": handle.to_json()}))
        _fsync(str(tmp))
        os.replace(tmp, self.index)
        if old is not None and old[2].path != handle.path:
            handoff.release(old[2].path)  # a reader that mapped it keeps its mapping
        now = time.time()
        for path in self.dir.glob("sovfl-reference-*"):
            if str(path) != handle.path and now - path.stat().st_mtime > STALE_S:
                handoff.release(str(path))
        return handle


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class GlobalModel:
    """The round's global model as a hand-off for the trainer, and what the reply's status reports."""

    handle: handoff.Handle
    temporary: bool  # a shared-memory copy to unlink after the trainer call
    status: dict = field(default_factory=dict)

    def release(self) -> None:
        if self.temporary:
            handoff.release(self.handle.path)


def trainer_workdir(sock: str) -> Path:
    """The site's workdir, as its trainer service reports it."""
    try:
        info = endpoint.call(sock, "Info", {}, timeout_s=30)
    except (endpoint.TrainerUnavailable, endpoint.TrainerError) as err:
        raise DownlinkError(f"downlink: cannot find the site's workdir for its reference model: {err}") from None
    if not info.get("workdir"):
        raise DownlinkError("downlink: the site trainer does not report its workdir; run the same sovereign-fl "
                            "version on the site as on the coordinator")
    return Path(info["workdir"]) / "downlink"


def receive_global(content: RecordDict, site: str, store_dir: Callable[[], Path]) -> GlobalModel:
    """The global model of a train/evaluate message, ready for the trainer. Without a "downlink"
    record it is the dense model (copied to shared memory); with one, it is rebuilt from the
    reference in `store_dir()` and becomes the new reference. Raises DownlinkError."""
    payload = from_records(content, "global", RECORD)
    if RECORD not in content.config_records:
        return GlobalModel(handoff.write_arrays(payload.arrays, tag=f"{site}-global"), True)
    store = ReferenceStore(store_dir())
    current = store.load()
    model, digest = reconstruct(payload, current[:2] if current else None)
    if current is not None and digest == current[0]:
        handle = current[2]  # "hold": the trainer reads the reference file as it is
    else:
        handle = store.save(model, digest)
    return GlobalModel(handle, False, {DIGEST_KEY: digest})
