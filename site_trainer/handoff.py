"""Zero-pickle hand-off of named arrays between the Flower relay and trainer rank 0.

A model crosses the process boundary as one file in /dev/shm (RAM-backed): the writer lays the
arrays out back to back and sends only the path and a small JSON layout over the socket; the
reader maps the file and views each array in place. numpy only, so the torch-free relay can use it.
"""

from __future__ import annotations

import os
import uuid
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
    """What travels over the socket instead of the tensors."""

    path: str
    entries: tuple[Entry, ...]

    def to_json(self) -> dict:
        return {"path": self.path, "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries]}

    @staticmethod
    def from_json(obj: dict) -> "Handle":
        try:
            entries = tuple(Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in obj["entries"])
            return Handle(str(obj["path"]), entries)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed hand-off handle: {err}") from None


def _new_path(directory: str | Path | None, tag: str) -> Path:
    base = Path(directory) if directory else (_SHM_DIR or Path(os.environ.get("TMPDIR", "/tmp")))
    return base / f"sovfl-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _create(size: int, tag: str, directory: str | Path | None) -> Path:
    path = _new_path(directory, tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
    finally:
        os.close(fd)
    return path


def allocate(spec: dict[str, tuple[str, tuple[int, ...]]], tag: str = "x",
             directory: str | Path | None = None) -> tuple[Handle, dict[str, np.ndarray]]:
    """Create a file for arrays of the given (dtype, shape) and return writable views into it.

    Lets the producer write results in place (torch copies straight into the views).
    """
    entries, offset = [], 0
    for name, (dtype, shape) in spec.items():
        e = Entry(name, np.dtype(dtype).str, tuple(int(x) for x in shape), offset)
        entries.append(e)
        offset += -(-e.nbytes // _ALIGN) * _ALIGN
    handle = Handle(str(_create(offset, tag, directory)), tuple(entries))
    return handle, map_arrays(handle, writable=True)


def write_arrays(arrays: dict[str, np.ndarray], tag: str = "x", directory: str | Path | None = None) -> Handle:
    """Copy `arrays` into a fresh shared-memory file (one memcpy each) and return its handle."""
    handle, views = allocate({n: (a.dtype.str, a.shape) for n, a in arrays.items()}, tag, directory)
    for name, arr in arrays.items():
        np.copyto(views[name], arr, casting="no")
    return handle


def map_arrays(handle: Handle, writable: bool = False) -> dict[str, np.ndarray]:
    """View the arrays of `handle` in place (no copy). Valid while the file exists or is mapped."""
    size = os.path.getsize(handle.path)
    need = max((e.offset + e.nbytes for e in handle.entries), default=0)
    if need > size:
        raise ValueError(f"hand-off file {handle.path} holds {size} bytes but its layout needs {need}")
    if not handle.entries or need == 0:
        return {e.name: np.empty(e.shape, dtype=e.dtype) for e in handle.entries}
    buf = np.memmap(handle.path, dtype=np.uint8, mode="r+" if writable else "r", shape=(size,))
    return {e.name: buf[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape) for e in handle.entries}


def release(path: str | None) -> None:
    """Unlink a hand-off file; mappings stay valid until dropped. Missing files are fine."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
