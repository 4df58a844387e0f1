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


# ---- words on the wire at the ring's width ----------------------------------------------------
#
# A masked word is uniform over Z_{2^b}, so no coder can shrink it: b bits per word is the floor.
# Words are packed little-endian at bit level, word i in bits [i*b, (i+1)*b) of the buffer; the
# last byte's unused high bits are zero (and checked so: one word vector has one encoding).
# Eight words always fill exactly b bytes, so word k of every group of eight sits at the same bit
# offset k*b of its group: packing and unpacking are 8 vectorised steps over the groups (a few shifts,
# ORs and masks on 64-bit words each), whatever b.


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` words take at `bits` bits each."""
    check_bits(bits)
    return (count * bits + 7) // 8


def pack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """uint8 buffer of the words (each < 2^bits) at `bits` bits each."""
    check_bits(bits)
    w = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)
    n = w.shape[0]
    if bits % 8 == 0:  # whole bytes: the low bits/8 bytes of each little-endian word
        nb = bits // 8
        return np.ascontiguousarray(w.astype("<u4", copy=False).view(np.uint8).reshape(n, 4)[:, :nb]).reshape(-1)
    groups = -(-n // 8)
    padded = np.zeros(groups * 8, dtype=np.uint64)
    padded[:n] = w
    lanes = padded.reshape(groups, 8)
    # a group's `bits` bytes as little-endian 64-bit words: word k's bits land in output word
    # k*bits // 64 and, if they cross it, the next one; 8-11 vectorised shifts and ORs in all (the
    # same bytes as OR-ing 5 shifted bytes per word, about 3.5x faster; every site packs its masked
    # vector)
    out = np.zeros((groups, -(-bits // 8)), dtype="<u8")  # ceil(8 * bits / 64) words per group
    tmp = np.empty(groups, dtype=np.uint64)
    for k in range(8):
        j, shift = divmod(k * bits, 64)
        np.left_shift(lanes[:, k], np.uint64(shift), out=tmp)
        out[:, j] |= tmp
        if shift + bits > 64:
            np.right_shift(lanes[:, k], np.uint64(64 - shift), out=tmp)
            out[:, j + 1] |= tmp
    packed = out.view(np.uint8).reshape(groups, out.shape[1] * 8)[:, :bits]
    return np.ascontiguousarray(packed).reshape(-1)[: packed_nbytes(n, bits)]


def unpack_words(buf: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The `count` uint32 words of a buffer `pack_words` made; ValueError if its length or its
    padding bits are not those of `count` words at `bits` bits."""
    check_bits(bits)
    b = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    if b.shape[0] != packed_nbytes(count, bits):
        raise ValueError(f"{b.shape[0]} bytes cannot hold exactly {count} words of {bits} bits")
    if bits % 8 == 0:
        nb = bits // 8
        wide = np.zeros((count, 4), dtype=np.uint8)
        wide[:, :nb] = b.reshape(count, nb)
        return wide.view("<u4").reshape(-1).astype(np.uint32, copy=False)
    spare = count * bits % 8
    if spare and int(b[-1]) >> spare:
        raise ValueError("the padding bits after the last word are not zero")
    groups = -(-count // 8)
    if groups == 0:
        return np.empty(0, dtype=np.uint32)
    # word k of group g starts at bit k*bits of the group's `bits` bytes: one unaligned 8-byte read
    # per word (a strided little-endian uint64 view; numpy reads unaligned views bytewise), shifted
    # and masked, 8 vectorised steps in all (the same words as gathering their 5 bytes one by one,
    # about 5x faster; the coordinator unpacks every site's masked vector)
    full = np.zeros(groups * bits + 8, dtype=np.uint8)  # 8 spare bytes: every 8-byte read stays inside
    full[: b.shape[0]] = b
    out = np.empty((groups, 8), dtype=np.uint32)
    mask = np.uint64((1 << bits) - 1)
    tmp = np.empty(groups, dtype=np.uint64)
    for k in range(8):
        start, shift = divmod(k * bits, 8)  # shift + bits <= 7 + 31: inside the 64 bits read
        v = np.ndarray((groups,), dtype="<u8", buffer=full, offset=start, strides=(bits,))
        np.right_shift(v, np.uint64(shift), out=tmp)
        np.bitwise_and(tmp, mask, out=tmp)
        out[:, k] = tmp
    return out.reshape(-1)[:count]
