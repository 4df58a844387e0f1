"""Host-memory policy for ZeRO ranks: give the memory of freed tensors back to the OS at once.

torch allocates CPU tensors with malloc. glibc's defaults suit a process whose working set only
grows: after the first large free it raises its mmap threshold (up to 32 MiB), so later tensors
come from the heap, and freed heap pages stay resident (the heap shrinks only from its top).
A ZeRO rank lives on the opposite pattern: each block's full-size parameters, gradients and
activations are allocated and freed again, step after step. Measured with
benchmarks/zero_memory.py (64-block GPT, 4 ranks, zero3): under glibc's defaults a rank's peak
resident set reached 4.7x the 16P/K bytes of its model states; with this policy it is within 1.2x.

The policy: tensors of 16 KiB and more get their own mapping, returned to the OS when freed
(and the threshold stays fixed); the heap top is trimmed on every free and grows without padding.
It costs a page fault per touched page of each new large tensor, so only ZeRO ranks on the CPU
use it: ddp ranks hold everything anyway, and on GPUs the model states are in device memory (host
memory there holds batches and one hand-off tensor at a time). Other C libraries are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

log = logging.getLogger("sovfl.trainer")

MMAP_THRESHOLD_BYTES = 16 * 1024
_LONG_LIVED_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


_policy: dict[str, int] = {}  # the settings in force, once applied


def _mallopt():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: its mallopt parameters are the ones below
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def return_freed_memory_eagerly(mmap_threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Apply the policy to this process's glibc malloc; False (and a log line) where there is none."""
    mallopt = _mallopt()
    if mallopt is None:
        log.info("host memory: not glibc, allocator left at its defaults")
        return False
    settings = ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, 0), (_M_TOP_PAD, 0))
    if not all(mallopt(param, value) == 1 for param, value in settings):
        log.warning("host memory: glibc refused mallopt%s; freed tensors may stay resident", settings)
        return False
    _policy["mmap_threshold"] = mmap_threshold
    return True


@contextlib.contextmanager
def long_lived():
    """Allocate what lives as long as the trainer (weight shards, optimizer moments) from the heap.

    Under the policy every tensor of 16 KiB or more is its own mapping, and a mapping carries one
    page of slack (malloc's header pushes a page-sized tensor into one more page): about 4 KiB per
    tensor, a few percent of the model states when shards are small. Tensors that are never freed
    need no mapping of their own, so they are packed in the heap instead.
    """
    threshold = _policy.get("mmap_threshold")
    mallopt = _mallopt() if threshold is not None else None
    if mallopt is None:
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _LONG_LIVED_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, threshold)
