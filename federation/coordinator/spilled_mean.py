"""The round's sample-weighted mean, folded from updates kept on disk: the coordinator's memory at
scale is the global model plus bounded windows, not the model plus a float64 sum plus
the update being folded.

Each verified update is written to a file of its own as it arrives (a sealed one straight from
its envelope, chunk by chunk: envelope_opener.py), checked there slice by slice, and only then
counted. When the round is over the mean is folded slice by slice across the sites, in sorted
site order: for each slice of each tensor a float64 accumulator takes n_i * u_i of every site,
then the sum is divided by the total weight and rounded to float32, which is `WeightedMean`'s
arithmetic element for element (same operations, a fixed order: a resumed run folds bit for bit
as the run that never stopped). FedAvg writes the new model into the global model's own arrays
slice by slice (`apply_fedavg`), so no second model-sized buffer is ever made; other server
optimizers take the dense mean (`result`), one float32 model.

An update that fails anywhere (tag, digest, layout, shape, NaN) is a file that is deleted, never
a partial sum. Files go away once the mean is taken, or with the object.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from federation.coordinator.server_math import fedavg_into
from federation.protocol.codecs import Arrays
from federation.protocol.codecs.base import RAW_BF16, bf16_to_float32
from federation.protocol.pipeline import UpdateRejected
from federation.protocol.wire_dtypes import Spec, master_spec

SLICE = 1 << 22  # elements per step of the fold: 32 MiB of float64 accumulator, whatever the model
SUFFIX = ".update"


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a spilled update is: its dtype in the file (the master dtype, or bf16
    words for a tensor that travels so), shape and byte offset."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        """Elements of the tensor."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass
class Spilled:
    """One site's verified update on disk."""

    site: str
    path: Path
    weight: float
    entries: dict[str, Entry]


def _unlink(paths: list[Path]) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def writable_f32(a: np.ndarray) -> bool:
    """Whether a model tensor can take its next value in place."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous


def disjoint(model: Arrays) -> bool:
    """Whether no two tensors of `model` share memory (tied weights as one buffer would take a
    step twice if each were written in place)."""
    spans = sorted((a.__array_interface__["data"][0], a.nbytes) for a in model.values()
                   if isinstance(a, np.ndarray) and a.nbytes)
    return all(start + n <= nxt for (start, n), (nxt, _) in zip(spans, spans[1:]))


def clear_stale(directory: Path) -> None:
    """Delete the update files a coordinator that stopped mid-round left in `directory`."""
    if directory.is_dir():
        _unlink(sorted(directory.glob("*" + SUFFIX)))


class SpilledMean:
    """Updates on disk, and the weighted mean folded from them (see the module docstring)."""

    def __init__(self, spec: Spec, directory: Path | None = None):
        self.spec = spec
        self.master = master_spec(spec)
        self.directory = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        self.directory.mkdir(parents=True, exist_ok=True)
        self.updates: list[Spilled] = []
        self._files: list[Path] = []
        self._finalizer = weakref.finalize(self, _unlink, self._files)

    @property
    def count(self) -> int:
        """Updates taken."""
        return len(self.updates)

    @property
    def total_weight(self) -> float:
        """Σ n_i, summed in the fold's order."""
        total = 0.0
        for u in self._ordered():
            total += u.weight
        return total

    # ---- taking updates in -------------------------------------------------------------------
    def new_file(self, site: str) -> Path:
        """A fresh file for `site`'s update (deleted with this object unless `discard`ed first)."""
        path = self.directory / f"{''.join(c if c.isalnum() or c in '-_' else '_' for c in site)[:64]}-{uuid.uuid4().hex}{SUFFIX}"
        path.touch(mode=0o600)
        self._files.append(path)
        return path

    def discard(self, path: Path) -> None:
        """Delete a file whose update was refused."""
        _unlink([path])
        if path in self._files:
            self._files.remove(path)

    def add_arrays(self, site: str, arrays: Arrays, weight: float) -> None:
        """Spill an update that is already in memory and checked (`check_update`)."""
        self._check_weight(weight)
        path, entries, offset = self.new_file(site), {}, 0
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                for name in self.spec:
                    a = np.ascontiguousarray(arrays[name])
                    entries[name] = Entry(a.dtype, tuple(a.shape), offset)
                    _pwrite_all(fd, a.reshape(-1).view(np.uint8) if a.size else b"", offset)
                    offset += a.nbytes
            finally:
                os.close(fd)
        except BaseException:
            self.discard(path)
            raise
        self.updates.append(Spilled(site, path, float(weight), entries))

    def add_file(self, site: str, path: Path, layout: list[tuple[str, np.dtype, tuple[int, ...], int]],
                 weight: float) -> None:
        """Take the verified payload `new_file(site)` holds, laid out as `layout` says, once it is an
        update of the model: the tensors the spec names, each of its shape and of its master dtype
        or bf16 words where it travels so, all finite (UpdateRejected with check_update's reasons;
        the caller discards the file)."""
        self._check_weight(weight)
        entries = {name: Entry(dt, shape, off) for name, dt, shape, off in layout}
        if set(entries) != set(self.spec) or len(entries) != len(layout):
            missing = sorted(set(self.spec) - set(entries))
            extra = sorted(set(entries) - set(self.spec))
            raise UpdateRejected("wrong_tensors", f"missing {missing[:5]}, unexpected {extra[:5]}")
        for name, e in entries.items():
            wire, master = np.dtype(self.spec[name][0]), np.dtype(self.master[name][0])
            if e.dtype != master and not (wire == RAW_BF16 and e.dtype == RAW_BF16):
                raise UpdateRejected("wrong_dtype", f"{name} is {e.dtype}, expected {master}")
            if tuple(e.shape) != tuple(self.spec[name][1]):
                raise UpdateRejected("wrong_shape", f"{name} has shape {tuple(e.shape)}, "
                                     f"expected {tuple(self.spec[name][1])}")
        spilled = Spilled(site, path, float(weight), entries)
        with open(path, "rb", buffering=0) as f:
            for name, e in entries.items():
                for lo in range(0, e.size, SLICE):
                    if not np.isfinite(self._read(f.fileno(), e, lo, min(e.size, lo + SLICE))).all():
                        raise UpdateRejected("non_finite", f"{name} contains NaN or Inf")
        self.updates.append(spilled)

    @staticmethod
    def _check_weight(weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")

    # ---- the mean ----------------------------------------------------------------------------
    def _ordered(self) -> list[Spilled]:
        return sorted(self.updates, key=lambda u: u.site)  # stable: a site's updates keep their order

    @staticmethod
    def _read(fd: int, e: Entry, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of one tensor of a spilled update, as the values it stands for."""
        buf = np.empty(hi - lo, e.dtype)
        want, got = buf.nbytes, 0
        view = memoryview(buf.view(np.uint8)) if want else memoryview(b"")
        while got < want:
            n = os.preadv(fd, [view[got:]], e.offset + lo * e.dtype.itemsize + got)
            if n <= 0:
                raise UpdateRejected("truncated", f"update file ends {want - got} bytes early")
            got += n
        return bf16_to_float32(buf) if e.dtype == RAW_BF16 else buf

    def slices(self):
        """(tensor, lo, hi, float32 mean of elements [lo, hi)) for every slice of every tensor, in
        the spec's order; the float64 accumulator of one slice at a time."""
        if not self.updates:
            raise ValueError("no update was added")
        order, total = self._ordered(), self.total_weight
        files = [open(u.path, "rb", buffering=0) for u in order]
        try:
            for name, (_, shape) in self.master.items():
                size = int(np.prod(shape, dtype=np.int64)) if shape else 1
                for lo in range(0, size, SLICE):
                    hi = min(size, lo + SLICE)
                    acc = np.empty(hi - lo, np.float64)
                    for i, (u, f) in enumerate(zip(order, files)):
                        x = self._read(f.fileno(), u.entries[name], lo, hi)
                        if i == 0:
                            np.multiply(x, u.weight, out=acc, dtype=np.float64)
                        else:
                            acc += x.astype(np.float64) * u.weight
                        del x
                    np.divide(acc, total, out=acc)
                    yield name, lo, hi, acc.astype(np.float32)
                    del acc
        finally:
            for f in files:
                f.close()

    def result(self) -> Arrays:
        """The dense float32 mean (for the optimizers that need it whole); the files are deleted."""
        out = {name: np.empty(shape, np.float32) for name, (_, shape) in self.master.items()}
        for name, lo, hi, part in self.slices():
            out[name].reshape(-1)[lo:hi] = part
        self.close()
        return out

    def apply_fedavg(self, model: Arrays, update_kind: str, lr: float, in_place: bool = True) -> Arrays:
        """FedAvg's step (`ServerOptimizer.step`'s arithmetic, element for element), slice by slice:
        the new model, as a new dict. `in_place`: written into the model's own float32 arrays, so no
        second model-sized buffer is made (a tensor that is not a writable float32 array gets a new
        one). The files are deleted."""
        out = dict(model)
        in_place = in_place and disjoint(model)
        for name in self.master:
            if not (in_place and writable_f32(model[name])):
                out[name] = np.empty(model[name].shape, np.float32)
        for name, lo, hi, u in self.slices():
            fedavg_into(model[name].reshape(-1)[lo:hi], u, update_kind, lr, out=out[name].reshape(-1)[lo:hi])
        self.close()
        return out

    def close(self) -> None:
        """Delete the files; the object holds no update after this."""
        _unlink(list(self._files))
        self._files.clear()
        self.updates = []
