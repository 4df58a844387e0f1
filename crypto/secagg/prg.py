"""Mask expansion: AES-CTR keystreams written straight into preallocated uint32 buffers.

A mask is the keystream of AES-128-CTR under a 16-byte mask key (keys.py; 128-bit security like
the X25519 agreement it comes from, and ~15% faster than AES-256 here), read as little-endian uint32
words; word i lies in AES block i // 4, so a stream can be opened at any word offset by starting
the counter at block offset // 4. Client and server expand masks chunk by chunk with O(chunk)
memory, in any order. The counter starts at 0 for every key, which is safe because every mask
key is used for exactly one mask. AES-CTR is a PRF-based PRG, so masks are computationally
indistinguishable from uniform words; uniform 32-bit words reduced mod 2^b (b <= 32) stay uniform.

Speed: keystreams are produced in pieces of `piece_words` words into one reused scratch buffer,
and all masks are applied to one piece before moving on (`OpenMasks.apply`), so each output word
is read and written while cache-hot. Streams are opened once and read sequentially; each piece
costs one AES call and one in-place uint32 add or subtract (wrapping mod 2^32) per mask, nothing
else. Pieces of 512 KiB measured fastest here (AMD EPYC, 512 KiB L2): smaller ones fit L2 better
but pay numpy's and the AES binding's per-call overhead more often.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

WORDS_PER_BLOCK = 4  # one 16-byte AES block holds four uint32 words
PIECE_WORDS = 1 << 17  # 512 KiB pieces (see the module docstring)
_WORD = np.dtype("<u4")  # masks are little-endian words on every host
_ZEROS = memoryview(b"")  # shared read-only plaintext of zeros, grown on demand


def _zeros(nbytes: int) -> memoryview:
    global _ZEROS
    if len(_ZEROS) < nbytes:
        _ZEROS = memoryview(bytes(nbytes))
    return _ZEROS[:nbytes]


class MaskExpander:
    """Scratch space for keystream pieces of at most `piece_words` words (reuse it)."""

    def __init__(self, piece_words: int = PIECE_WORDS) -> None:
        if piece_words <= 0 or piece_words % WORDS_PER_BLOCK:
            raise ValueError("piece_words must be a positive multiple of 4")
        self.piece_words = piece_words
        self._zeros = _zeros(piece_words * 4)
        self._words = np.empty(piece_words, dtype=_WORD)
        self._bytes = memoryview(self._words.view(np.uint8))

    def open(self, key: bytes, offset: int) -> Any:
        """A keystream positioned at word `offset` of the mask of `key`."""
        block, skip = divmod(offset, WORDS_PER_BLOCK)
        stream = Cipher(algorithms.AES(key), modes.CTR(block.to_bytes(16, "big"))).encryptor()
        if skip:
            stream.update_into(self._zeros[: skip * 4], self._bytes[: skip * 4])
        return stream

    def next(self, stream: Any, n: int) -> np.ndarray:
        """The next n (<= piece_words) words of `stream`; a view valid until the next call."""
        stream.update_into(self._zeros[: n * 4], self._bytes[: n * 4])
        return self._words[:n]

    def open_masks(self, masks: Sequence[tuple[bytes, int]], offset: int) -> OpenMasks:
        """Open every (key, sign) mask at word `offset`, to be applied piece by piece."""
        plus = [self.open(key, offset) for key, sign in masks if sign > 0]
        minus = [self.open(key, offset) for key, sign in masks if sign <= 0]
        return OpenMasks(self, plus, minus)

    def apply_masks(self, out: np.ndarray, masks: Sequence[tuple[bytes, int]], offset: int) -> None:
        """out += sum of sign * mask[offset : offset + len(out)] over (key, sign) in masks."""
        opened = self.open_masks(masks, offset)
        for s in range(0, out.shape[0], self.piece_words):
            opened.apply(out[s : s + self.piece_words])

    def keystream(self, key: bytes, offset: int, n: int) -> np.ndarray:
        """A fresh copy of mask words [offset, offset + n) of `key`."""
        out = np.zeros(n, dtype=np.uint32)
        self.apply_masks(out, [(key, 1)], offset)
        return out


class OpenMasks:
    """Masks opened at one position; `apply` adds their next words to a piece and moves on."""

    def __init__(self, expander: MaskExpander, plus: list[Any], minus: list[Any]) -> None:
        self._ex, self._plus, self._minus = expander, plus, minus

    def apply(self, piece: np.ndarray) -> None:
        """piece += (next len(piece) words of each + mask) - (those of each - mask), mod 2^32."""
        n = piece.shape[0]
        zeros, dst, ks = self._ex._zeros[: 4 * n], self._ex._bytes[: 4 * n], self._ex._words[:n]
        for stream in self._plus:
            stream.update_into(zeros, dst)
            np.add(piece, ks, out=piece)
        for stream in self._minus:
            stream.update_into(zeros, dst)
            np.subtract(piece, ks, out=piece)


def expand(key: bytes, n: int, offset: int = 0) -> np.ndarray:
    """Mask words [offset, offset + n) of `key` as a new array (tests, small vectors)."""
    return MaskExpander().keystream(key, offset, n)
