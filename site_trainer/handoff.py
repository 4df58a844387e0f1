"""Zero-pickle hand-off of named arrays between the Flower relay and trainer rank 0.

A model crosses the process boundary as one file in /dev/shm (RAM-backed): the writer lays the
arrays out back to back and sends only the path and a small JSON layout over the socket; the
reader maps the file and views each array in place. numpy only, so the torch-free relay can use it.

The trainer's rank 0 reads the global model with `Reader` (pread, a piece at a time, no mapping of
the relay's file in the load) and writes the update into one of its own long-lived, mapped files
(`update_files`), whose handles carry a `generation`: the reader leaves such a file in place, and
`Reader` holds it under a shared lock so that its writer does not reuse it meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_ALIGN = 64
_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


@dataclass(frozen=True)
class Handle:
    """What travels over the socket instead of the tensors.

    `generation`: None for a file made for this hand-off alone (its reader unlinks it); a number for
    a file its writer owns and reuses (the trainer's update files, `update_files`): the reader must
    not unlink it, and `Reader` checks that the file still holds that generation."""

    path: str
    entries: tuple[Entry, ...]
    generation: int | None = None

    @property
    def owned(self) -> bool:
        """Whether the writer owns the file (reuses it; the reader leaves it in place)."""
        return self.generation is not None

    def to_json(self) -> dict:
        out = {"path": self.path, "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries]}
        if self.generation is not None:
            out["generation"] = self.generation
        return out

    @staticmethod
    def from_json(obj: dict) -> "Handle":
        try:
            entries = tuple(Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in obj["entries"])
            gen = obj.get("generation")
            return Handle(str(obj["path"]), entries, None if gen is None else int(gen))
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed hand-off handle: {err}") from None


def owned_path(reply_handle: dict | None) -> bool:
    """Whether a handle's JSON names a file its writer owns (so nobody else may unlink it)."""
    return bool(reply_handle) and reply_handle.get("generation") is not None


# An owned file starts with a stamp: what generation of bytes it holds (0 while being written).
STAMP_BYTES = 64
_MAGIC = b"sovflgen"


def stamp(generation: int) -> np.ndarray:
    """The STAMP_BYTES an owned file starts with when it holds `generation`."""
    out = np.zeros(STAMP_BYTES, dtype=np.uint8)
    out[:8] = np.frombuffer(_MAGIC, dtype=np.uint8)
    out[8:16] = np.frombuffer(int(generation).to_bytes(8, "little"), dtype=np.uint8)
    return out


def _check_stamp(fd: int, handle: Handle) -> None:
    """Take a shared lock on an owned file (its writer rewrites it only under an exclusive one) and
    check it still holds the handle's generation."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"hand-off file {handle.path} is being rewritten (generation {handle.generation} "
                         "is gone)") from None
    head = os.pread(fd, 16, 0)
    gen = int.from_bytes(head[8:16], "little") if len(head) == 16 and head[:8] == _MAGIC else None
    if gen != handle.generation:
        raise ValueError(f"hand-off file {handle.path} holds generation {gen}, not {handle.generation}: "
                         "its writer reused it before it was read")


def scratch_dir(directory: str | Path | None = None) -> Path:
    """Where hand-off files go: `directory` if given, else /dev/shm (memory), else $TMPDIR."""
    return Path(directory) if directory else (_SHM_DIR or Path(os.environ.get("TMPDIR", "/tmp")))


def _new_path(directory: str | Path | None, tag: str) -> Path:
    return scratch_dir(directory) / f"sovfl-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale(tag: str, directory: str | Path | None = None) -> list[str]:
    """Unlink the hand-off files of `tag` whose writer process no longer exists (a rank killed while
    it wrote its update, so nothing released them): in /dev/shm they are memory, and nothing else
    would ever free them. Returns the paths removed."""
    prefix, removed = f"sovfl-{tag}-", []
    for path in scratch_dir(directory).glob(f"{prefix}*"):
        pid, _, rest = path.name[len(prefix):].partition("-")
        if not pid.isdigit() or len(rest) != 12 or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(str(path))
    return removed


def _create(size: int, tag: str, directory: str | Path | None) -> Path:
    path = _new_path(directory, tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
    finally:
        os.close(fd)
    return path


def layout_of(spec: dict[str, tuple[str, tuple[int, ...]]], base: int = 0) -> tuple[tuple[Entry, ...], int]:
    """The entries of arrays of `spec` laid out back to back from byte `base`, and the end."""
    entries, offset = [], base
    for name, (dtype, shape) in spec.items():
        e = Entry(name, np.dtype(dtype).str, tuple(int(x) for x in shape), offset)
        entries.append(e)
        offset += -(-e.nbytes // _ALIGN) * _ALIGN
    return tuple(entries), offset


def _bytes_of(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy), whatever its shape, empty ones included."""
    if not array.flags.c_contiguous:
        raise ValueError(f"hand-off I/O needs a C-contiguous array, got one of strides {array.strides}")
    return memoryview(array.reshape(-1).view(np.uint8))


def _pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _check_size(handle: Handle, size: int) -> None:
    need = max((e.offset + e.nbytes for e in handle.entries), default=0)
    if need > size:
        raise ValueError(f"hand-off file {handle.path} holds {size} bytes but its layout needs {need}")


class _File:
    """An open hand-off file and its layout; closes with `close()` or a `with` block."""

    def __init__(self, handle: Handle, flags: int):
        self.handle = handle
        self._entries = {e.name: e for e in handle.entries}
        self._fd = os.open(handle.path, flags)

    def _entry_range(self, name: str, start: int, n: int) -> Entry:
        e = self._entries[name]
        if start < 0 or start + n > e.nbytes:
            raise ValueError(f"hand-off entry {name}: bytes [{start}, {start + n}) outside its {e.nbytes}")
        return e

    def _io(self, op, name: str, start: int, view: memoryview) -> None:
        """pread/pwrite `view` at byte `start` of array `name` until done: one call moves at most
        ~2 GiB on Linux, and may move less."""
        e = self._entry_range(name, start, len(view))
        done = 0
        while done < len(view):
            n = op(self._fd, view[done:], e.offset + start + done)
            if n <= 0:
                raise ValueError(f"hand-off file {self.handle.path} ended at byte {e.offset + start + done} ({name})")
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Writer(_File):
    """A fresh hand-off file for arrays of a given (dtype, shape), filled one array at a time.

    `allocate=True`: the file's pages are allocated and mapped into this process now, on a thread,
    while the caller does other work (the trainer: while it trains). Writing into a file's fresh
    pages costs the kernel an allocation, a zeroing and a copy per 4 KiB page; into pages already
    allocated and mapped a write is a plain memory copy. The mapping is dropped at `close`, so the
    file's pages count in this process's resident set only from the allocation to the close. The
    first write waits for the allocation; where it fails (no space, no support) the writes fall back
    to pwrite, which allocates as it goes.
    """

    def __init__(self, spec: dict[str, tuple[str, tuple[int, ...]]], tag: str = "x", directory: str | Path | None = None,
                 allocate: bool = False):
        entries, size = layout_of(spec)
        super().__init__(Handle(str(_create(size, tag, directory)), entries), os.O_RDWR if allocate else os.O_WRONLY)
        self.size = size
        self.allocate_s: float | None = None  # how long the allocation took (None: not asked, or it failed)
        self._map: mmap.mmap | None = None
        self._bytes: np.ndarray | None = None  # the mapped file, as bytes
        self._allocating = threading.Thread(target=self._allocate, name="sovfl-allocate", daemon=True) \
            if allocate and size else None
        if self._allocating is not None:
            self._allocating.start()

    def _allocate(self) -> None:
        t0 = time.perf_counter()
        try:
            os.posix_fallocate(self._fd, 0, self.size)
            self._map = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):  # the writes allocate (and say so if they cannot)
            return
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.allocate_s = time.perf_counter() - t0

    def allocated(self) -> None:
        """Wait until the allocation asked for is over (done, or given up)."""
        thread = self._allocating  # (the packing threads may ask at once)
        if thread is not None:
            thread.join()
            self._allocating = None

    def _io(self, op, name: str, start: int, view: memoryview) -> None:
        self.allocated()
        if self._bytes is None:
            super()._io(op, name, start, view)
            return
        e = self._entry_range(name, start, len(view))
        np.copyto(self._bytes[e.offset + start:e.offset + start + len(view)], np.frombuffer(view, dtype=np.uint8))

    def close(self) -> None:
        self.allocated()  # never close the descriptor or the mapping under the allocating thread
        self._bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None
        super().close()

    def abandon(self) -> None:
        """Nobody will read what was written: close and unlink the file (its memory goes back)."""
        self.close()
        release(self.handle.path)

    def target(self, name: str) -> np.ndarray | None:
        """The bytes of array `name` in the mapped file, to be written in place (None: not mapped)."""
        self.allocated()
        if self._bytes is None:
            return None
        e = self._entries[name]
        return self._bytes[e.offset:e.offset + e.nbytes]

    def write(self, name: str, array: np.ndarray) -> None:
        e = self._entries[name]
        if array.dtype.str != e.dtype or array.shape != e.shape:
            raise ValueError(f"hand-off entry {name}: got {array.dtype.str}{array.shape}, layout says {e.dtype}{e.shape}")
        self._io(os.pwrite, name, 0, _bytes_of(np.ascontiguousarray(array)))

    def write_range(self, name: str, start: int, data: np.ndarray) -> None:
        """Write the bytes of `data` (C-contiguous) at byte `start` of array `name`: a piece of a
        tensor, for writers that produce it a piece at a time (the update's delta)."""
        self._io(os.pwrite, name, start, _bytes_of(data))


def write_arrays(arrays: dict[str, np.ndarray], tag: str = "x", directory: str | Path | None = None) -> Handle:
    """Copy `arrays` into a fresh shared-memory file (one copy each) and return its handle."""
    with Writer({n: (a.dtype.str, a.shape) for n, a in arrays.items()}, tag, directory) as writer:
        for name, arr in arrays.items():
            writer.write(name, arr)
    return writer.handle


class Reader(_File, Mapping):
    """The arrays of a hand-off file, each read into a fresh array when asked for (pread, no mapping).

    Holds the file open, so it stays readable after the writer unlinks it. A file its writer owns
    (`Handle.owned`) is held under a shared lock from open to close, which keeps its writer from
    reusing it; opening one that no longer holds the handle's generation fails (ValueError).
    """

    def __init__(self, handle: Handle):
        super().__init__(handle, os.O_RDONLY)
        try:
            _check_size(handle, os.fstat(self._fd).st_size)
            if handle.owned:  # held under a shared lock until closed: its writer does not reuse it meanwhile
                _check_stamp(self._fd, handle)
        except (OSError, ValueError):
            self.close()
            raise

    def __getitem__(self, name: str) -> np.ndarray:
        e = self._entries[name]
        out = np.empty(e.shape, dtype=e.dtype)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read array `name` into `out` (C-contiguous, of the entry's dtype and shape): no allocation,
        so rank 0 reads straight into a parameter or a pinned staging buffer."""
        e = self._entries[name]
        if out.dtype.str != e.dtype or out.shape != e.shape or not out.flags.c_contiguous:
            raise ValueError(f"hand-off entry {name}: cannot read {e.dtype}{e.shape} into "
                             f"{out.dtype.str}{out.shape}{'' if out.flags.c_contiguous else ' (not contiguous)'}")
        self._io(_pread, name, 0, _bytes_of(out))

    def handle_entry(self, name: str) -> Entry:
        return self._entries[name]

    def read_range(self, name: str, start: int, out: memoryview | np.ndarray) -> None:
        """Read bytes [start, start + len(out)) of array `name` into `out` (bytes, or a C-contiguous
        array): a piece of a tensor, for readers that stream a large file through a small buffer."""
        self._io(_pread, name, start, out if isinstance(out, memoryview) else _bytes_of(out))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def map_arrays(handle: Handle) -> dict[str, np.ndarray]:
    """View the arrays of `handle` in place (no copy), read-only. Valid while the file exists or is mapped.

    The mapping is populated up front (MAP_POPULATE where the platform has it): the reader touches
    every page anyway, and one pass in the kernel costs less than a page fault per 4 KiB.
    """
    fd = os.open(handle.path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        _check_size(handle, size)
        if not handle.entries or size == 0 or all(e.nbytes == 0 for e in handle.entries):
            return {e.name: np.empty(e.shape, dtype=e.dtype) for e in handle.entries}
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = np.frombuffer(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ), dtype=np.uint8)
    finally:
        os.close(fd)
    return {e.name: buf[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape) for e in handle.entries}


_PREMAPPER: ThreadPoolExecutor | None = None


def _forget_premapper() -> None:
    global _PREMAPPER
    _PREMAPPER = None  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_premapper)


class Premapped:
    """`map_arrays(handle)` on a worker thread, asked for now: the file's pages are mapped while the
    caller does other work (the trainer: the global model, mapped while the round trains, for the
    delta). The worker is started once and kept (a thread's start waits for the scheduler)."""

    def __init__(self, handle: Handle):
        global _PREMAPPER
        if _PREMAPPER is None:
            _PREMAPPER = ThreadPoolExecutor(1, "sovfl-premap")
        self._arrays: dict[str, np.ndarray] | None = None
        self._job = _PREMAPPER.submit(self._map, handle)

    def _map(self, handle: Handle) -> None:
        try:
            self._arrays = map_arrays(handle)
        except (OSError, ValueError):  # the reader's pread serves instead
            pass

    def arrays(self) -> dict[str, np.ndarray] | None:
        """The mapped arrays (read-only), or None if the file could not be mapped."""
        self._job.result()
        return self._arrays

    def drop(self) -> None:
        """Let go of the mapping (unmapped once no view of it is left)."""
        self._job.result()
        self._arrays = None


def release(path: str | None) -> None:
    """Unlink a hand-off file; mappings stay valid until dropped. Missing files are fine."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
