"""Give freed tensor memory back to the system, in the processes that handle whole models.

glibc serves an allocation of at least its mmap threshold with its own mapping, returned to the
system on free; smaller ones come from the heap, which it rarely shrinks. The threshold starts at
128 KiB but rises to the size of each large block freed (up to 32 MiB), so after one round of a
model's tensors most of the next round's come from the heap and can stay resident after they are
freed (tests/test_bulk_channel.py: 0 of 64 MiB freed arrays leave the process without this, 64
with it). How much of the coordinator's between-round memory this was at 101M parameters was not
isolated from the other fixes made with it (benchmarks/large_update.py measures them together).
Setting the threshold explicitly turns that adjustment off.

numpy-free and torch-free (the ClientApp imports it); a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

M_MMAP_THRESHOLD = -3  # mallopt(3) parameter numbers (malloc.h)
THRESHOLD = 1 << 20  # bytes: an array this large or larger has its own mapping

log = logging.getLogger("sovfl.memory")
_done = False


def return_freed_tensors(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process (once); whether it was set."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator decides
        _done = False
    if not _done:
        log.debug("mallopt(M_MMAP_THRESHOLD) unavailable: freed tensor memory may stay resident")
    return _done


_trim = None


def trim_freed() -> None:
    """Give back what glibc holds freed in its arenas (malloc_trim(0)): a long transfer on several
    threads frees a chunk-sized message per step, and the arenas of gRPC's threads kept those pages
    resident, growing with the transfer's size (measured: 100 MiB more per 400 MiB downloaded on
    4 streams, back to the baseline after a trim). A no-op where the C library is not glibc."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)
