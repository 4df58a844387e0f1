"""Rank 0 writes the update into its hand-off file once, in the wire dtype, a piece at a time.

The weights go from the host tensor straight into the file (one copy). A delta (new weights minus
the global model the relay left in its file) is formed in pieces of `PIECE_BYTES`: the global's
piece is read from the relay's file into a scratch buffer, subtracted from the weights into it in
the tensor's dtype (one torch op; for bf16 and float16 bit for bit the float32 difference rounded
once, a float32 global of a low-precision tensor first rounded to the tensor's dtype), and written
at its place in the update's file. The model's bytes cross memory once per stream (the weights, the
global, the update); the scratch is reused and stays in the CPU's cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from site_trainer import handoff, layout

PIECE_BYTES = 8 * 2**20


class UpdatePacker:
    """Writes updates into `writer`; a delta from the global model in `reader`. One thread at a time
    (its scratch buffer is reused from piece to piece)."""

    def __init__(self, writer: handoff.Writer, specs: dict[str, layout.TensorSpec], reader: handoff.Reader | None,
                 mapped: Mapping[str, np.ndarray] | None = None):
        self.writer, self.specs, self.reader, self.mapped = writer, specs, reader, mapped
        self._scratch = np.empty(0, dtype=np.uint8)
        self._result = np.empty(0, dtype=np.uint8)

    def _out(self, like: torch.Tensor, wire: str) -> torch.Tensor:
        """A reusable buffer shaped like `like` (the difference before it is written)."""
        n = like.numel() * like.element_size()
        if self._result.nbytes < n:
            self._result = np.empty(n, dtype=np.uint8)
        return layout.from_wire(self._result[:n].view(wire), like.dtype)

    def weights(self, name: str, t: torch.Tensor) -> None:
        """The tensor as it travels (a contiguous CPU tensor)."""
        self.writer.write(name, layout.to_wire(t))

    def delta(self, name: str, t: torch.Tensor) -> None:
        """`t` (a contiguous CPU tensor) minus the global tensor `name`, in the update's wire dtype."""
        dtype, wire = self.specs[name].dtype, self.specs[name].wire
        gwire = np.dtype(self.reader.handle_entry(name).dtype)
        flat = t.reshape(-1)
        step = max(1, PIECE_BYTES // max(t.element_size(), 1))
        if self._scratch.nbytes < step * gwire.itemsize:
            self._scratch = np.empty(step * gwire.itemsize, dtype=np.uint8)
        target, whole = self.writer.target(name), None
        if self.mapped is not None:  # the global model's file, mapped while the round trained
            whole = self.mapped[name].reshape(-1)
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            if whole is not None:
                g = whole[start:start + piece.numel()]
            else:
                g = self._scratch[:piece.numel() * gwire.itemsize].view(gwire)
                self.reader.read_range(name, start * gwire.itemsize, g)
            with warnings.catch_warnings():  # a mapped global is read-only: it is only read here
                warnings.simplefilter("ignore", UserWarning)
                glob = layout.from_wire(g, dtype)  # a view, or the float32 global rounded to the tensor's dtype
            at = start * np.dtype(wire).itemsize
            if target is not None:  # straight into the update's mapped file
                out = layout.from_wire(target[at:at + piece.numel() * np.dtype(wire).itemsize].view(wire), dtype)
            elif whole is None and glob.data_ptr() == g.ctypes.data:
                out = glob  # the scratch the global was read into
            else:
                out = self._out(glob, wire)
            if dtype.itemsize >= 2:
                torch.sub(piece, glob, out=out)
            else:  # float8: no arithmetic of its own; in float32, rounded once
                out.copy_(piece.float() - glob.float())
            if target is None:
                self.writer.write_range(name, at, layout.to_wire(out))
