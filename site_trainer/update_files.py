"""Rank 0's update files: up to two long-lived files in /dev/shm, mapped for the trainer's life,
that each round's update is written into.

Writing into a file's fresh pages costs the kernel an allocation, a zeroing and a page-table entry
per 4 KiB page, and unmapping and unlinking the file after the round tears all of it down again:
several times the cost of copying the bytes. Into pages allocated and mapped once, writing the
update is a plain memory copy. So the trainer keeps its update files for its whole life and hands
out a generation-stamped handle (`handoff.Handle.generation`) that its reader must not unlink.

Reuse is safe by locks, not by timing: a reader (`handoff.Reader`) holds a shared flock on the file
from open to close, and a round takes a file only with an exclusive non-blocking flock, held until
its update is written. A file still read is never written: the round takes the other file, or,
while both are read (a ClientApp still uploading two rounds back), a one-off file as before
(`handoff.Writer`, unlinked by its reader). Each file starts with a stamp (`handoff.STAMP_BYTES`):
zeroed while the round writes, the round's generation once it is done; a reader checks it against
its handle, so a handle whose file was taken again fails loudly instead of reading another round's
bytes.

The files are unlinked when the trainer closes them (its shutdown), at interpreter exit, or, after a
kill, by the next trainer of the site (`handoff.sweep_stale`: the names carry the writer's pid).
"""

from __future__ import annotations

import contextlib
import logging
import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from site_trainer import handoff

log = logging.getLogger("sovfl.site_trainer")

SLOTS = 2  # the previous round's update may still be read while the next one is written


class OwnedFile:
    """One long-lived update file: created now, grown (allocated and mapped) when a round needs more."""

    def __init__(self, tag: str, directory: str | Path | None = None):
        self.path = str(handoff._new_path(directory, tag))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.capacity = 0
        self.mapped: np.ndarray | None = None  # the whole file as bytes, while it is mapped
        self._map: mmap.mmap | None = None
        self._taken = False  # by a round of this process (its own lock would not stop a second take)

    def take(self) -> bool:
        """Lock the file for a round's write (exclusive, never waiting); False: a reader or another
        round holds it."""
        if self._taken:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._taken = True
        return True

    def give_back(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self._taken = False

    def unlinked(self) -> bool:
        """Whether someone removed the file's name (then its handle would name nothing)."""
        return os.fstat(self.fd).st_nlink == 0

    def ensure(self, size: int) -> None:
        """At least `size` bytes, allocated and mapped (MAP_POPULATE: the page-table entries too).
        Where allocation or mapping fails the file is only sized, and writes go through pwrite."""
        if size <= self.capacity:
            return
        self._unmap()
        os.ftruncate(self.fd, size)
        self.capacity = size
        try:
            os.posix_fallocate(self.fd, 0, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return
        self.mapped = np.frombuffer(self._map, dtype=np.uint8)

    def _unmap(self) -> None:
        self.mapped = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still in use: unmapped when it goes
                self._map.close()
            self._map = None

    def close(self) -> None:
        """Unmap, close and unlink (the memory goes back once no reader holds it open)."""
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        handoff.release(self.path)


def _close_all(files: list[OwnedFile]) -> None:
    for f in files:
        with contextlib.suppress(OSError):
            f.close()
    files.clear()


class OwnedWriter(handoff._File):
    """One round's update written into an `OwnedFile` taken for the round (the `handoff.Writer`
    interface). The file is grown on a thread started now (the first round, or a larger layout),
    while the round trains; `close()` stamps the generation and lets readers in."""

    def __init__(self, file: OwnedFile, spec: dict[str, tuple[str, tuple[int, ...]]], generation: int):
        entries, size = handoff.layout_of(spec, base=handoff.STAMP_BYTES)
        super().__init__(handoff.Handle(file.path, entries, generation), os.O_RDWR)
        self.file, self.size, self.generation = file, size, generation
        self.allocate_s: float | None = None
        self._error: OSError | None = None
        self._done = False
        self._growing: threading.Thread | None = None
        if size > file.capacity:
            self._growing = threading.Thread(target=self._grow, name="sovfl-allocate", daemon=True)
            self._growing.start()
        else:
            self._stamp(0)

    def _grow(self) -> None:
        t0 = time.perf_counter()
        try:
            self.file.ensure(self.size)
            self._stamp(0)
        except OSError as err:
            self._error = err
            return
        self.allocate_s = time.perf_counter() - t0

    def _stamp(self, generation: int) -> None:
        data = handoff.stamp(generation)
        if self.file.mapped is not None:
            self.file.mapped[:handoff.STAMP_BYTES] = data
        else:
            os.pwrite(self._fd, data.tobytes(), 0)

    def allocated(self) -> None:
        """Wait until the file is large enough (and mapped, where that worked)."""
        thread = self._growing  # (the packing threads may ask at once)
        if thread is not None:
            thread.join()
            self._growing = None
        if self._error is not None:
            raise OSError(f"update file {self.file.path}: cannot hold {self.size} bytes: {self._error}")

    def target(self, name: str) -> np.ndarray | None:
        """The bytes of array `name` in the mapped file, to be written in place (None: not mapped)."""
        self.allocated()
        if self.file.mapped is None:
            return None
        e = self._entries[name]
        return self.file.mapped[e.offset:e.offset + e.nbytes]

    def write(self, name: str, array: np.ndarray) -> None:
        e = self._entries[name]
        if array.dtype.str != e.dtype or array.shape != e.shape:
            raise ValueError(f"hand-off entry {name}: got {array.dtype.str}{array.shape}, layout says {e.dtype}{e.shape}")
        self.write_range(name, 0, np.ascontiguousarray(array))

    def write_range(self, name: str, start: int, data: np.ndarray) -> None:
        """Write the bytes of `data` (C-contiguous) at byte `start` of array `name`."""
        view = handoff._bytes_of(data)
        self.allocated()
        if self.file.mapped is None:
            self._io(os.pwrite, name, start, view)
            return
        e = self._entry_range(name, start, len(view))
        np.copyto(self.file.mapped[e.offset + start:e.offset + start + len(view)], np.frombuffer(view, np.uint8))

    def _finish(self, generation: int) -> None:
        if self._done:
            return
        self._done = True
        try:
            thread = self._growing
            if thread is not None:
                thread.join()
                self._growing = None
            if self._error is None:
                self._stamp(generation)
        finally:
            self.file.give_back()
            super().close()

    def close(self) -> None:
        """The update is complete: stamp its generation and unlock the file for its reader."""
        self._finish(self.generation)

    def abandon(self) -> None:
        """Nobody will read this round's update: leave the file unstamped (and ready for the next)."""
        self._finish(0)


class UpdateFiles:
    """Rank 0's update files for the trainer's life: `writer(spec)` gives the round a free one."""

    def __init__(self, tag: str, directory: str | Path | None = None, slots: int = SLOTS):
        self.tag, self.directory, self.slots = tag, directory, slots
        self.files: list[OwnedFile] = []
        self.generation = 0
        self._finalizer = weakref.finalize(self, _close_all, self.files)  # at the latest, at interpreter exit

    def writer(self, spec: dict[str, tuple[str, tuple[int, ...]]]) -> OwnedWriter | None:
        """A writer into a file no reader holds, locked until its close; None when every slot is
        still being read (the caller writes a one-off file)."""
        for f in [f for f in self.files if f.unlinked()]:  # removed by someone else: replace it
            self.files.remove(f)
            f.close()
        for f in self.files:
            if f.take():
                return self._writer(f, spec)
        if len(self.files) >= self.slots:
            return None
        f = OwnedFile(self.tag, self.directory)
        self.files.append(f)
        if not f.take():  # (a fresh file: nobody else can hold it)
            raise OSError(f"update file {f.path}: cannot lock it")
        return self._writer(f, spec)

    def writer_or_one_off(self, spec: dict[str, tuple[str, tuple[int, ...]]],
                          one_off: Callable[[], handoff.Writer]) -> OwnedWriter | handoff.Writer:
        """A round's update file: one of these that no reader holds, else `one_off()` (said in the log)."""
        owned = self.writer(spec)
        if owned is not None:
            return owned
        log.info("%s: both update files are still being read (earlier rounds' uploads); this round's update goes "
                 "to a one-off file", self.tag)
        return one_off()

    def _writer(self, f: OwnedFile, spec: dict[str, tuple[str, tuple[int, ...]]]) -> OwnedWriter:
        self.generation += 1
        try:
            return OwnedWriter(f, spec, self.generation)
        except BaseException:
            f.give_back()
            raise

    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def close(self) -> None:
        """Unmap and unlink every file (the trainer's shutdown)."""
        self._finalizer()
