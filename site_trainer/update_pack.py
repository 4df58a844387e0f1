"""Rank 0 writes the update into its hand-off file once, in the wire dtype, a piece at a time.

The weights go from the host tensor straight into the file (one copy). A delta (new weights minus
the global model the relay left in its file) is formed in pieces of `PIECE_BYTES` (on several
threads, `transfer.stream_out`): the global's piece is viewed in its mapped file (or read from it
into a scratch buffer), subtracted from the weights into it in
the tensor's dtype (one torch op; for bf16 and float16 bit for bit the float32 difference rounded
once, a float32 global of a low-precision tensor first rounded to the tensor's dtype), and written
at its place in the update's file. The model's bytes cross memory once per stream (the weights, the
global, the update); the scratch is reused and stays in the CPU's cache.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from site_trainer import handoff, layout, transfer

PIECE_BYTES = transfer.PIECE_BYTES


class UpdatePacker:
    """Writes updates into `writer`; a delta from the global model in `reader`. Its `*_piece`
    methods may run on several threads at once, each on its own pieces (scratch buffers are per
    thread); `weights` and `delta` write a whole tensor, piece by piece."""

    def __init__(self, writer: handoff.Writer, specs: dict[str, layout.TensorSpec], reader: handoff.Reader | None,
                 mapped: Mapping[str, np.ndarray] | None = None):
        self.writer, self.specs, self.reader, self.mapped = writer, specs, reader, mapped
        self._local = threading.local()

    def _buffer(self, which: str, nbytes: int) -> np.ndarray:
        """This thread's reusable buffer `which` of at least `nbytes`."""
        buf = getattr(self._local, which, None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            setattr(self._local, which, buf)
        return buf[:nbytes]

    def _whole(self, piece, name: str, t: torch.Tensor) -> None:
        flat = t.reshape(-1)
        for lo, hi in transfer.pieces(flat.numel(), t.element_size()):
            piece(name, flat, lo, hi)

    def weights(self, name: str, t: torch.Tensor) -> None:
        """The tensor as it travels (a contiguous CPU tensor)."""
        self._whole(self.weights_piece, name, t)

    def delta(self, name: str, t: torch.Tensor) -> None:
        """`t` (a contiguous CPU tensor) minus the global tensor `name`, in the update's wire dtype."""
        self._whole(self.delta_piece, name, t)

    def weights_piece(self, name: str, flat: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the flat tensor, as they travel."""
        if hi > lo:
            self.writer.write_range(name, lo * flat.element_size(), layout.to_wire(flat[lo:hi]))

    def delta_piece(self, name: str, flat: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of the flat tensor minus the global's, in the update's wire dtype."""
        if hi <= lo:
            return
        dtype, wire = self.specs[name].dtype, np.dtype(self.specs[name].wire)
        gwire = np.dtype(self.reader.handle_entry(name).dtype)
        piece, n = flat[lo:hi], hi - lo
        if self.mapped is not None:  # the global model's file, mapped while the round trained
            g = self.mapped[name].reshape(-1)[lo:hi]
        else:
            g = self._buffer("glob", n * gwire.itemsize).view(gwire)
            self.reader.read_range(name, lo * gwire.itemsize, g)
        with warnings.catch_warnings():  # a mapped global is read-only: it is only read here
            warnings.simplefilter("ignore", UserWarning)
            glob = layout.from_wire(g, dtype)  # a view, or the float32 global rounded to the tensor's dtype
        at, target = lo * wire.itemsize, self.writer.target(name)
        if target is not None:  # straight into the update's mapped file
            out = layout.from_wire(target[at:at + n * wire.itemsize].view(wire), dtype)
        elif self.mapped is None and glob.data_ptr() == g.ctypes.data:
            out = glob  # the scratch the global was read into
        else:
            out = layout.from_wire(self._buffer("out", n * wire.itemsize).view(wire), dtype)
        if dtype.itemsize >= 2:
            torch.sub(piece, glob, out=out)
        else:  # float8: no arithmetic of its own; in float32, rounded once
            out.copy_(piece.float() - glob.float())
        if target is None:
            self.writer.write_range(name, at, layout.to_wire(out))
