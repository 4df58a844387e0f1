"""A rank's digest of the weights it holds, computed at memory speed.

Every rank digests the exchanged tensors as they travel, so that equal digests show every rank
holds the model rank 0 sent. The check is against accidents (a shard layout bug, a rank that
diverged), not against an adversary: the ranks are one site's own processes. Hashing every byte
with SHA-256 runs far below memory speed on a CPU, and it sits between every two rounds, so the
bytes are first folded: each 4 KiB block becomes the wrapping sum of its 512 little-endian 64-bit
words (one reduction at memory speed, on the tensor's own device), and SHA-256 hashes those sums,
the bytes of a tensor's last partial block and each tensor's length. Any change confined to one
block changes that block's sum unless it cancels exactly mod 2^64; a reordering of blocks, of
tensors or of their bytes across blocks changes the sequence. Equal bytes give an equal digest
whatever the device, the thread count or how a tensor is cut into block-aligned pieces.
"""

from __future__ import annotations

import hashlib

import torch

BLOCK_BYTES = 4096
_WORD = torch.int64


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def block_sums(raw: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sums of each whole 4 KiB block of the flat uint8 tensor `raw` (on its device)."""
    whole = raw.numel() // BLOCK_BYTES * BLOCK_BYTES
    if whole == 0:
        return torch.empty(0, dtype=_WORD, device=raw.device)
    body = raw[:whole]
    if body.data_ptr() % 8:  # int64 words need 8-byte alignment: copy the rare misaligned view
        body = body.clone()
    return body.view(_WORD).view(-1, BLOCK_BYTES // 8).sum(dim=1, dtype=_WORD)


def fold(raw: torch.Tensor) -> tuple[bytes, bytes]:
    """What the digest takes of the flat uint8 tensor `raw`: its block sums and its last partial
    block's bytes (a worker thread computes these; `WeightsDigest.add` takes them in order)."""
    sums = block_sums(raw)
    tail = raw[sums.numel() * BLOCK_BYTES:]
    return (sums.cpu().numpy().tobytes() if sums.numel() else b"",
            tail.cpu().numpy().tobytes() if tail.numel() else b"")


class WeightsDigest:
    """Fed tensor by tensor (each whole, or in pieces whose sizes are multiples of 4 KiB but the last)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._open = 0  # bytes of the tensor being fed so far

    def update(self, t: torch.Tensor, last: bool = True) -> None:
        """Fold `t`'s bytes in; `last=False`: more pieces of the same tensor follow (then the piece
        must be a whole number of 4 KiB blocks)."""
        raw = _flat_bytes(t)
        self.add(*fold(raw), raw.numel(), last)

    def add(self, sums: bytes, tail: bytes, nbytes: int, last: bool = True) -> None:
        """Take a piece's `fold` (of `nbytes` bytes), in the order of the pieces."""
        if not last and nbytes % BLOCK_BYTES:
            raise ValueError(f"a digest piece followed by more must be whole 4 KiB blocks, got {nbytes} bytes")
        if sums:
            self._h.update(sums)
        if tail:
            self._h.update(tail)
        self._open += nbytes
        if last:
            self._h.update(b"|%d|" % self._open)
            self._open = 0

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:16]
