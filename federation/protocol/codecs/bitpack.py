"""Bit-level packing: fixed-width fields, int4 nibbles, and Rice-coded sorted indices.

All vectorised numpy (chunked to bound temporary memory), so a 10M-parameter update packs in
well under a second. Layout is little-endian at bit level (``np.packbits(bitorder="little")``).
"""

from __future__ import annotations

import numpy as np

from .codec_errors import (
    IndexRangeError,
    MetadataError,
    PayloadLengthError,
    QuantizedRangeError,
    TruncatedPayloadError,
)

_CHUNK = 1 << 16  # values per chunk; a multiple of 8 keeps every chunk byte-aligned
MAX_RICE_R = 32


def packed_nbytes(count: int, width: int) -> int:
    """Bytes that `count` fields of `width` bits take once packed."""
    return (count * width + 7) // 8


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers (each < 2**width) into ``width``-bit fields."""
    values = np.asarray(values)
    count = int(values.size)
    if width == 0:
        return np.zeros(0, dtype=np.uint8)
    if width in (8, 16, 32, 64):
        return values.astype(f"<u{width // 8}").view(np.uint8).copy()
    out = np.empty(packed_nbytes(count, width), dtype=np.uint8)
    shifts = np.arange(width, dtype=np.uint64)
    for start in range(0, count, _CHUNK):
        v = values[start : start + _CHUNK].astype(np.uint64)
        bits = ((v[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        packed = np.packbits(bits.reshape(-1), bitorder="little")
        offset = start * width // 8
        out[offset : offset + packed.size] = packed
    return out


def unpack_bits(buf: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`; ``buf`` must already have been length-checked."""
    if width == 0:
        return np.zeros(count, dtype=np.uint64)
    if width in (8, 16, 32, 64):
        return buf.view(f"<u{width // 8}").astype(np.uint64)
    out = np.empty(count, dtype=np.uint64)
    shifts = np.arange(width, dtype=np.uint64)
    for start in range(0, count, _CHUNK):
        m = min(_CHUNK, count - start)
        nbits = m * width
        first = start * width // 8
        bits = np.unpackbits(buf[first : first + (nbits + 7) // 8], bitorder="little", count=nbits)
        out[start : start + m] = (bits.reshape(m, width).astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
    return out


# --- int4 nibbles ------------------------------------------------------------------------------


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Two int4 values in [-7, 7] per byte, low nibble first, stored with offset 8 (nibble 8 == 0)."""
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(8))
    return u[0::2] | (u[1::2] << np.uint8(4))


def unpack_int4(packed: np.ndarray, count: int, name: str = "values") -> np.ndarray:
    """Inverse of :func:`pack_int4`; rejects nibble 0 (-8, never produced) and non-zero padding."""
    u = np.empty(packed.size * 2, dtype=np.uint8)
    u[0::2] = packed & np.uint8(0x0F)
    u[1::2] = packed >> np.uint8(4)
    if u.size > count and u[count] != 8:
        raise PayloadLengthError(f"payload array {name!r} has a non-zero padding nibble after {count} int4 values")
    u = u[:count]
    if count and (u == 0).any():
        raise QuantizedRangeError(
            f"payload array {name!r} holds int4 value -8 at position {int(np.argmax(u == 0))}; "
            "the codec only produces [-7, 7]"
        )
    return u.astype(np.int8) - np.int8(8)


# --- Rice-coded sorted indices ------------------------------------------------------------------


def _gaps(indices: np.ndarray) -> np.ndarray:
    return np.diff(indices.astype(np.int64), prepend=np.int64(-1)) - 1


def best_rice_r(gaps: np.ndarray) -> int:
    """Rice parameter minimising total bits (k*(r+1) + sum(gap >> r)), searched near log2(mean)."""
    if gaps.size == 0:
        return 0
    mean = float(gaps.mean())
    centre = int(np.log2(mean)) if mean >= 1 else 0
    best, best_bits = 0, None
    for r in range(max(0, centre - 2), min(MAX_RICE_R, centre + 3) + 1):
        total = gaps.size * (r + 1) + int((gaps >> r).sum())
        if best_bits is None or total < best_bits:
            best, best_bits = r, total
    return best


def rice_encode(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Delta-code strictly increasing indices with a Rice code split into two streams.

    Why split: the unary quotients go to one bit stream (a 1 terminates each quotient) and the
    fixed-width remainders to another, so decoding is a vectorised ``flatnonzero`` + unpack
    instead of a sequential bit parser. Returns (unary bytes, remainder bytes, r).
    """
    gaps = _gaps(indices)
    r = best_rice_r(gaps)
    q = gaps >> r
    low = gaps & ((1 << r) - 1)
    if gaps.size == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint8), r
    terminators = np.cumsum(q + 1) - 1
    bits = np.zeros(int(terminators[-1]) + 1, dtype=np.uint8)
    bits[terminators] = 1
    return np.packbits(bits, bitorder="little"), pack_bits(low, r), r


def rice_decode(unary: np.ndarray, low: np.ndarray, r: int, k: int, numel: int) -> np.ndarray:
    """Inverse of :func:`rice_encode` with validation; ``low`` must already be length-checked."""
    if not 0 <= r <= MAX_RICE_R:
        raise MetadataError(f"metadata field 'rice_r'={r} is outside [0, {MAX_RICE_R}]")
    ones = np.flatnonzero(np.unpackbits(unary, bitorder="little"))
    if ones.size < k:
        raise TruncatedPayloadError(
            f"payload array 'index_unary' is truncated: it encodes {ones.size} indices, metadata says k={k}"
        )
    if ones.size > k:
        raise PayloadLengthError(
            f"payload array 'index_unary' encodes {ones.size} indices, more than metadata k={k}"
        )
    if k == 0:
        if unary.size:
            raise PayloadLengthError("payload array 'index_unary' has trailing bytes although k=0")
        return np.zeros(0, dtype=np.int64)
    expected = (int(ones[-1]) + 8) // 8
    if unary.size != expected:
        raise PayloadLengthError(
            f"payload array 'index_unary' has {unary.size - expected} trailing bytes after the last index"
        )
    q = np.diff(ones, prepend=np.int64(-1)) - 1
    if int(q.max()) > (numel >> r):
        raise IndexRangeError(f"delta-coded indices point past the end of the update (numel={numel})")
    gaps = (q << r) | unpack_bits(low, r, k).astype(np.int64)
    indices = np.cumsum(gaps + 1) - 1
    if int(indices[-1]) >= numel:
        raise IndexRangeError(
            f"delta-coded index {int(indices[-1])} is outside [0, {numel}) (numel={numel})"
        )
    return indices
