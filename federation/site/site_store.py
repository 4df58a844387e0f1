"""The site's own store: the model it holds (downlink reference) and its codec residual.

The ClientApp is a fresh process per message, so what a site keeps between rounds lives in files
under the site trainer's workdir, in the hand-off layout: `downlink/` holds the reference model
(the relay passes that very file to the trainer as the round's global model, no extra copy) and
`residual/` the codec's error-feedback residual (what a lossy codec did not send yet; it never
goes back to the trainer). Both survive restarts of the trainer and of the SuperNode. Each file
is named by an index (`<tag>.json`) that is replaced atomically after the file is fsynced, so a
crash leaves the old content or the new, never a torn one. numpy only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from crypto.durable import fsync_path, write_atomic
from federation.protocol.codecs import Arrays
from site_trainer import handoff

STALE_S = 3600.0  # files older than this and not current are left-overs of a crash


class ArrayFile:
    """Named arrays in one hand-off file under `directory`, with a small metadata index."""

    def __init__(self, directory: str | Path, tag: str):
        self.dir, self.tag = Path(directory), tag
        self.index = self.dir / f"{tag}.json"

    def read(self) -> tuple[dict, Arrays, handoff.Handle] | None:
        """(metadata, arrays mapped in place, handle), or None when there is nothing usable."""
        try:
            doc = json.loads(self.index.read_text())
            handle = handoff.Handle.from_json(doc.pop("handle"))
            return doc, handoff.map_arrays(handle), handle
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # none yet, or unreadable: the next write replaces it

    def write(self, arrays: Arrays, **meta) -> handoff.Handle:
        """Write `arrays` and make them current; the previous file is removed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        old = self.read()
        handle = handoff.write_arrays(arrays, tag=self.tag, directory=self.dir)
        fsync_path(handle.path)  # on disk before the index names it: a power cut cannot leave a torn file
        write_atomic(self.index, json.dumps({**meta, "handle": handle.to_json()}))
        if old is not None and old[2].path != handle.path:
            handoff.release(old[2].path)  # a reader that mapped it keeps its mapping
        now = time.time()
        for path in self.dir.glob(f"sovfl-{self.tag}-*"):
            if str(path) != handle.path and now - path.stat().st_mtime > STALE_S:
                handoff.release(str(path))
        return handle


class ReferenceStore:
    """The model this site holds (downlink), with its digest."""

    def __init__(self, directory: str | Path):
        self.file = ArrayFile(directory, "reference")
        self.dir = self.file.dir

    def load(self) -> tuple[str, Arrays, handoff.Handle] | None:
        """(digest, arrays mapped in place, handle), or None when there is no usable reference."""
        found = self.file.read()
        if found is None or not isinstance(found[0].get("digest"), str):
            return None
        return found[0]["digest"], found[1], found[2]

    def save(self, arrays: Arrays, digest: str) -> handoff.Handle:
        """Write `arrays` as the new reference and make it current."""
        return self.file.write(arrays, digest=digest)


class ResidualStore:
    """The codec's error-feedback residual: kept here, beside the reference, between rounds."""

    def __init__(self, directory: str | Path):
        self.file = ArrayFile(directory, "residual")

    def load(self) -> Arrays:
        """The residual ({} when there is none), mapped in place: replacing the file later leaves
        this mapping valid."""
        found = self.file.read()
        return found[1] if found else {}

    def save(self, arrays: Arrays, rnd: int) -> None:
        """Keep `arrays` (the residual after round `rnd`) for the next round."""
        self.file.write(arrays, round=rnd)


class SiteStore:
    """Everything a site keeps between messages, under its workdir."""

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)
        self.reference = ReferenceStore(self.workdir / "downlink")
        self.residual = ResidualStore(self.workdir / "residual")
