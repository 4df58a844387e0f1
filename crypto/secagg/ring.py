"""Arithmetic in the ring Z_{2^b}, b <= 32, on uint32 numpy arrays.

uint32 addition and subtraction wrap modulo 2^32, and 2^b divides 2^32, so we add and subtract
freely in uint32 and reduce to b bits (one AND) only where values leave a party: a masked chunk
on the wire, the unmasked sum. The canonical representative of a ring element is in [0, 2^b).
"""

from __future__ import annotations

import numpy as np

MIN_BITS = 8
MAX_BITS = 32


def modulus(bits: int) -> int:
    """2^bits."""
    check_bits(bits)
    return 1 << bits


def check_bits(bits: int) -> None:
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"ring bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")


def reduce_inplace(arr: np.ndarray, bits: int) -> np.ndarray:
    """arr mod 2^bits, in place (a no-op for 32 bits)."""
    if bits < 32:
        np.bitwise_and(arr, np.uint32((1 << bits) - 1), out=arr)
    return arr


def add(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a + b) mod 2^bits as a new array."""
    return reduce_inplace(np.add(a, b, dtype=np.uint32), bits)


def sub(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(a - b) mod 2^bits as a new array."""
    return reduce_inplace(np.subtract(a, b, dtype=np.uint32), bits)


def neg(a: np.ndarray, bits: int) -> np.ndarray:
    """-a mod 2^bits as a new array."""
    return reduce_inplace(np.negative(a.astype(np.uint32)), bits)
