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
    """The codec's error-feedback residual, one file per round it was kept after.

    A round can be run twice: a coordinator killed after this site encoded round r resumes from
    round r-1's checkpoint and asks for round r again. The rerun must start from the residual
    the first attempt started from, or the site would send (and then drop) what the dead attempt
    already folded in, and the resumed run would not be the run that would have happened. So the
    residual after each round is kept under that round's number, `load(before=r)` reads the newest
    one kept before round r, a save for round r drops those of later rounds (a dead timeline) and
    only the newest `keep` survive: a resume goes back at most to the last checkpoint but one (the
    fallback when the newest checkpoint is corrupt), so 3 is enough. The same holds for an update
    that was encoded but never aggregated (an aborted SecAgg round): the coordinator names the last
    round whose update it aggregated (`load(at=...)`), and the site goes on from that residual as
    if the lost round had never been encoded. That round's residual is kept however many rounds
    since were encoded and lost (`save(protect=...)`; make soak found a site whose updates were
    lost for 3 rounds running encode the 4th from nothing).
    """

    PREFIX = "residual-"

    def __init__(self, directory: str | Path, keep: int = 3):
        self.dir, self.keep = Path(directory), keep

    def rounds(self) -> list[int]:
        """The rounds a residual is kept after, oldest first."""
        found = []
        for index in self.dir.glob(f"{self.PREFIX}*.json"):
            number = index.stem[len(self.PREFIX):]
            if number.isdigit():
                found.append(int(number))
        return sorted(found)

    def _file(self, rnd: int) -> ArrayFile:
        return ArrayFile(self.dir, f"{self.PREFIX}{rnd}")

    def load(self, before: int, at: int | None = None) -> Arrays:
        """The residual kept after round `at` (the last round whose update was aggregated; 0: none)
        or, when `at` is None, after the newest round before round `before`; {} when there is none.
        Mapped in place: replacing the file later leaves this mapping valid."""
        if at is not None:
            found = self._file(at).read() if 0 < at < before else None
            return found[1] if found is not None else {}
        for rnd in reversed([r for r in self.rounds() if r < before]):
            found = self._file(rnd).read()
            if found is not None:
                return found[1]
        return {}

    def save(self, arrays: Arrays, rnd: int, protect: int | None = None) -> None:
        """Keep `arrays` (the residual after round `rnd`); forget later rounds and all but the
        newest `keep`, except round `protect` (the last round aggregated, which the next round
        starts from if this one is lost)."""
        self._file(rnd).write(arrays, round=rnd)
        kept = self.rounds()
        for old in [r for r in kept if r > rnd] + [r for r in kept if r <= rnd][:-self.keep]:
            if old != protect:
                self._drop(old)

    def _drop(self, rnd: int) -> None:
        file = self._file(rnd)
        found = file.read()
        file.index.unlink(missing_ok=True)
        if found is not None:
            handoff.release(found[2].path)


class SiteStore:
    """Everything a site keeps between messages, under its workdir."""

    def __init__(self, workdir: str | Path):
        self.workdir = Path(workdir)
        self.reference = ReferenceStore(self.workdir / "downlink")
        self.residual = ResidualStore(self.workdir / "residual")
