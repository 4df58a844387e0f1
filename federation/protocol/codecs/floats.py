"""Float value coders: float32 (identity), fp16 and bf16 (deterministic casts).

Bounds (for finite inputs inside the format's range):
- float32: exact.
- fp16: round-to-nearest-even; relative error <= 2**-11 for |x| >= 2**-14, absolute error
  <= 2**-25 below that; |x| > 65504 is clamped to ±65504 (error feedback keeps the excess).
- bf16: round-to-nearest-even on the top 16 bits of float32; relative error <= 2**-8; values
  that would round to Inf are clamped to the largest finite bf16.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .base import Arrays, bf16_to_float32, payload_array
from .codec_errors import NonFiniteValueError
from .coders import ValueCoder

FP16_MAX = float(np.finfo(np.float16).max)


def _reject_non_finite(values: np.ndarray, name: str = "values") -> None:
    bad = ~np.isfinite(values)
    if bad.any():
        raise NonFiniteValueError(
            f"payload array {name!r} contains NaN/Inf at {int(bad.sum())} position(s) (first at {int(np.argmax(bad))})"
        )


class Float32Values(ValueCoder):
    """Values as float32: no loss. Linear (sums of payloads are payloads of the sum)."""

    token = "identity"
    array_names = ("values",)
    linear = True

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[Arrays, np.ndarray]:
        """The values as float32 (no loss)."""
        out = np.array(values, dtype=np.float32, copy=True)
        return {"values": out}, out

    def decode(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Check length and finiteness; the values as float32."""
        values = payload_array(arrays, "values", np.float32, m)
        _reject_non_finite(values)
        return values.astype(np.float32, copy=True)



class Fp16Values(ValueCoder):
    """IEEE half precision, clamped to ±65504 so nothing becomes Inf. Not linear (bit patterns)."""

    token = "fp16"
    array_names = ("values",)

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[Arrays, np.ndarray]:
        """Round to half precision, clamped to ±65504."""
        half = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)
        return {"values": half}, half.astype(np.float32)

    def decode(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Check length and finiteness; back to float32."""
        values = payload_array(arrays, "values", np.float16, m)
        _reject_non_finite(values)
        return values.astype(np.float32)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit pattern (uint16), round-to-nearest-even, Inf clamped to max finite."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    overflow = (rounded & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if overflow.any():
        rounded[overflow] = (rounded[overflow] & np.uint16(0x8000)) | np.uint16(0x7F7F)
    return rounded


class Bf16Values(ValueCoder):
    """bfloat16 carried as its uint16 bit pattern (numpy has no bf16 dtype). Not linear."""

    token = "bf16"
    array_names = ("values",)

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[Arrays, np.ndarray]:
        """Round to bf16 (nearest even), carried as uint16 bit patterns."""
        bits = bf16_bits(values)
        return {"values": bits}, bf16_to_float32(bits)

    def decode(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Reject NaN/Inf bit patterns; back to float32."""
        bits = payload_array(arrays, "values", np.uint16, m)
        bad = (bits & np.uint16(0x7F80)) == np.uint16(0x7F80)
        if bad.any():
            raise NonFiniteValueError(
                f"payload array 'values' holds bf16 NaN/Inf patterns at {int(bad.sum())} position(s) "
                f"(first at {int(np.argmax(bad))})"
            )
        return bf16_to_float32(bits)
