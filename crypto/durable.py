"""Durable file writes: a reader sees the old content or the new, never a torn file, even after a crash.

The recipe every store of the project uses (keys and certificates, checkpoints, the site's store,
caches, run records): write a temporary file in the target's directory, fsync it, rename it over the
target, fsync the directory so the rename itself survives a power cut. Standard library only, so
every layer can use it (crypto/ is the bottom of the import graph).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory's fsync makes renames in it durable)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` in place and fsync it (for files inside a directory that is itself
    renamed into place afterwards)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o644) -> Path:
    """Replace `path` by `data` atomically and durably, with permissions `mode`; parent created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path
