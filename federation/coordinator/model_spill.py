"""The global model on disk while a SecAgg+ round holds its ring (the coordinator's memory at scale).

A SecAgg+ round's sum is a ring of P + 1 words, as large as the float32 model; holding both would be
2 x the model. Once the round's train messages are built (the model went into the data path's offer
file or into Flower's serialized records), the model is not read again until FedAvg's step, so it
is written to a file and its tensors are replaced, in the driver's own dict, by read-only maps of
that file (`spill_model`): through the sites' uploads and while the ring exists, the coordinator
does not hold it. The step then writes the new model into the mean's arrays, which are views of the
ring's words (secagg_round.in_ring_mean), reading the old model one slice at a time and dropping
the slice's pages once read (`step_into_mean`): the round holds the ring and bounded windows, never
the ring and the model. The arithmetic is the in-place step's, element for element.

If the round ends without a step (aborted, below quorum), `restore_model` reads the model back
into memory. The file is unlinked as soon as it is mapped: it goes with the last map, and a
coordinator killed in between leaves a `*.update` file that the next start deletes.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from pathlib import Path

import numpy as np

from federation.coordinator.envelope_opener import PageDropper
from federation.coordinator.server_math import fedavg_into, replaces
from federation.coordinator.spilled_mean import SUFFIX

SLICE = 1 << 22  # elements per step: 16 MiB of the old model mapped in at a time

log = logging.getLogger("sovfl.coordinator")


def _is_spilled(arr: object) -> bool:
    """Whether `arr` views a spilled model's map."""
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, _ModelMap)


class _ModelMap(mmap.mmap):
    """The map of a spilled model (a type of its own, so its views are recognised)."""


def spill_model(model: dict[str, np.ndarray], directory: Path) -> int:
    """Write `model`'s tensors to a file under `directory` and put read-only views of a map of it
    in their place, in the dict itself (every holder of the dict sees them); the bytes written, 0
    if the model stays in memory (already spilled, or the disk refused: logged)."""
    if not model or any(_is_spilled(a) or not isinstance(a, np.ndarray) for a in model.values()):
        return 0
    page = mmap.PAGESIZE
    places, size = {}, 0
    for name, arr in model.items():
        places[name] = size
        size += -(-arr.nbytes // page) * page  # each tensor on its own pages: dropping one slice spares the next
    path = directory / f"model-{uuid.uuid4().hex}{SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            for name, arr in model.items():
                flat = np.ascontiguousarray(arr).reshape(-1)
                for lo in range(0, flat.size, SLICE):
                    view = memoryview(flat[lo:lo + SLICE]).cast("B")
                    offset = places[name] + lo * flat.itemsize
                    while len(view):
                        done = os.pwrite(fd, view, offset)
                        view, offset = view[done:], offset + done
            mm = _ModelMap(fd, max(size, 1), access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
            path.unlink()
    except OSError as err:
        log.warning("cannot write the global model to %s (%s): it stays in memory beside the SecAgg+ ring", directory, err)
        return 0
    for name, arr in list(model.items()):
        model[name] = np.frombuffer(mm, arr.dtype, arr.size, places[name]).reshape(arr.shape)
    return size


def restore_model(model: dict[str, np.ndarray]) -> None:
    """Read a spilled model back into memory (in the dict itself), one tensor at a time."""
    drop = PageDropper()
    for name, arr in list(model.items()):
        if _is_spilled(arr):
            model[name] = np.array(arr)
            drop(arr)


def step_into_mean(model: np.ndarray, mean: np.ndarray, update_kind: str, lr: float) -> np.ndarray:
    """FedAvg's step written into `mean`'s own array (it is consumed), the old tensor read one slice
    at a time, its pages dropped once read: `model + lr * mean` (delta) or
    `model + lr * (mean - model)` (weights), in the in-place step's float32 operations."""
    if replaces(update_kind, lr):
        return mean
    drop = PageDropper()
    old, new = model.reshape(-1), mean.reshape(-1)
    for lo in range(0, new.size, SLICE):
        m, u = old[lo:lo + SLICE], new[lo:lo + SLICE]
        fedavg_into(m, u, update_kind, lr, out=u)
        drop(m)
    return mean
