"""Stochastic integer quantization (int4 / int8 / int16) with two scaling modes.

- ``block``: each block of ``block_size`` values gets its own float32 scale ``max|x|/qmax``
  (sent on the wire). Best accuracy, but scales differ per site, so payloads cannot be summed
  under secure aggregation. For sealed mode / no protection.
- ``clip``: one common scale ``clip/qmax`` from the config, identical on every site, so the
  integers add up in a ring: linear under SecAgg masks. Values outside ``[-clip, clip]`` are
  clipped (error feedback carries the excess to later rounds).

Stochastic rounding ``q = floor(x/s + u)``, ``u ~ U[0, 1)``, is unbiased (E[q*s] = x) for every
value inside the representable range, and the per-element error is bounded:
``|decode(encode(x)) - x| < s`` where ``s`` is the element's scale (block scale, or clip/qmax for
|x| <= clip). Symmetric range ``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1`` (7, 127, 32767),
so the most negative code is never produced and decode rejects it.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .base import Arrays, payload_array
from .bitpack import pack_int4, unpack_int4
from .codec_errors import CodecConfigError, NonFiniteValueError, QuantizedRangeError, ScaleError
from .coders import ValueCoder

_TINY = float(np.finfo(np.float32).tiny)
_DTYPES = {4: np.dtype(np.uint8), 8: np.dtype(np.int8), 16: np.dtype(np.int16)}


class StochasticInt(ValueCoder):
    """``bits``-bit stochastic quantizer; ``clip`` given -> common scale, else per-block scales."""

    def __init__(self, bits: int, block_size: int = 128, clip: float | None = None) -> None:
        if bits not in _DTYPES:
            raise CodecConfigError(f"int quantizer bits must be one of 4, 8, 16, got {bits}")
        self.bits = bits
        self.qmax = 2 ** (bits - 1) - 1
        self.block_size = int(block_size)
        self.clip = clip
        self.linear = clip is not None
        if clip is not None:
            self.scale = np.float32(clip / self.qmax)
            self.token = f"int{bits}:clip={clip!r}"
            self.array_names = ("values",)
        else:
            self.token = f"int{bits}:block={self.block_size}"
            self.array_names = ("values", "scales")

    # -- site ------------------------------------------------------------------------------------

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[Arrays, np.ndarray]:
        """Stochastic rounding to integer codes, with common or per-block scales."""
        m = values.size
        qmax = np.float32(self.qmax)
        if self.clip is not None:
            y = np.clip(values, -self.clip, self.clip).astype(np.float32) / self.scale
            q = np.floor(y + rng.random(m, dtype=np.float32))
            np.clip(q, -qmax, qmax, out=q)
            recon = q * self.scale
            arrays: Arrays = {"values": self.pack(q)}
            return arrays, recon.astype(np.float32, copy=False)
        nblocks = -(-m // self.block_size)
        padded = np.zeros(nblocks * self.block_size, dtype=np.float32)
        padded[:m] = values
        blocks = padded.reshape(nblocks, self.block_size)
        absmax = np.abs(blocks).max(axis=1) if nblocks else np.zeros(0, np.float32)
        scales = np.maximum(absmax / qmax, np.float32(_TINY)).astype(np.float32)
        q = np.floor(blocks / scales[:, None] + rng.random(blocks.shape, dtype=np.float32))
        np.clip(q, -qmax, qmax, out=q)
        recon = (q * scales[:, None]).reshape(-1)[:m]
        return {"values": self.pack(q.reshape(-1)[:m]), "scales": scales}, recon

    def pack(self, q: np.ndarray) -> np.ndarray:
        """Codes in [-qmax, qmax] -> one site's wire array (int4 nibbles, int8, int16)."""
        if self.bits == 4:
            return pack_int4(q)
        return q.astype(_DTYPES[self.bits])

    # -- coordinator -----------------------------------------------------------------------------

    def int_values(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Validated integer codes as int64 (the sum of ``summed`` sites' codes)."""
        if summed > 1:
            q = payload_array(arrays, "values", (np.int32, np.int64), m).astype(np.int64)
            limit = self.qmax * summed
        elif self.bits == 4:
            packed = payload_array(arrays, "values", np.uint8, (m + 1) // 2)
            return unpack_int4(packed, m).astype(np.int64)
        else:
            q = payload_array(arrays, "values", _DTYPES[self.bits], m).astype(np.int64)
            limit = self.qmax
        bad = np.abs(q) > limit
        if bad.any():
            i = int(np.argmax(bad))
            raise QuantizedRangeError(
                f"payload array 'values' holds {int(q[i])} at position {i}, outside [-{limit}, {limit}] "
                f"for int{self.bits} summed over {summed} site(s)"
            )
        return q

    def _scales(self, arrays: Mapping[str, np.ndarray], m: int) -> np.ndarray:
        scales = payload_array(arrays, "scales", np.float32, -(-m // self.block_size))
        finite = np.isfinite(scales)
        if not finite.all():
            raise NonFiniteValueError(
                f"payload array 'scales' contains NaN/Inf at block {int(np.argmin(finite))}"
            )
        bad = scales <= 0
        if bad.any():
            i = int(np.argmax(bad))
            raise ScaleError(f"payload array 'scales' has non-positive scale {float(scales[i])!r} at block {i}")
        return scales

    def decode(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Check the codes (and scales) and scale them back to float32."""
        q = self.int_values(arrays, m, summed)
        if self.clip is not None:
            return q.astype(np.float32) * self.scale
        scales = self._scales(arrays, m)
        return q.astype(np.float32) * np.repeat(scales, self.block_size)[:m]
