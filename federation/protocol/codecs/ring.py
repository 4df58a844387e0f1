"""Ring arithmetic for masked sums of integer codes: Z / 2**bits with a centred lift.

Under SecAgg each site sends ``(q + mask) mod 2**bits``; the masks cancel in the sum, leaving
``sum(q) mod 2**bits``. With ``bits = sum_bits(qmax, n)`` the true sum lies in
``[-qmax*n, qmax*n]``, a range of ``2*qmax*n + 1 <= 2**bits`` values, so it never wraps and the
centred lift recovers it exactly. Pack masked elements with ``bitpack.pack_bits(v, bits)``:
that is the honest wire size (e.g. int8 codes over 16 sites need 12 bits, not 8).
"""

from __future__ import annotations

import numpy as np

from .errors import CodecConfigError


def sum_bits(qmax: int, n_sites: int) -> int:
    """Smallest ring width that holds the sum of ``n_sites`` codes in ``[-qmax, qmax]``."""
    if n_sites < 1 or qmax < 1:
        raise CodecConfigError(f"need n_sites >= 1 and qmax >= 1, got n_sites={n_sites}, qmax={qmax}")
    bits = (2 * qmax * n_sites).bit_length()
    if bits > 62:
        raise CodecConfigError(f"sum of {n_sites} sites needs {bits} bits, more than the supported 62")
    return bits


def _mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


def to_ring(q: np.ndarray, bits: int) -> np.ndarray:
    """Signed integer codes -> uint64 ring elements mod 2**bits (two's complement, truncated)."""
    return q.astype(np.int64).view(np.uint64) & _mask(bits)


def from_ring(v: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements -> signed int64 in ``[-2**(bits-1), 2**(bits-1))`` (centred lift)."""
    v = np.asarray(v, dtype=np.uint64) & _mask(bits)
    signed = v.astype(np.int64)
    signed[v >= np.uint64(1 << (bits - 1))] -= np.int64(1 << bits)
    return signed
