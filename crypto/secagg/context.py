"""The public facts that pin one SecAgg+ round: run, round number and the graph seed.

Everything derived in a round (pairwise keys, AEAD associated data, message headers) is bound to
this context, so keys, shares and messages of one round are useless in any other round or run.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

PROTOCOL_TAG = b"sovfl-secagg+/v1"


@dataclass(frozen=True)
class RoundContext:
    """run_id: the federation run; round: the FL round; graph_seed: 32 public random bytes.

    The server draws `graph_seed` (see `new_context`) and sends it with the stage-1 request; server
    and clients derive the same neighbour graph from it.
    """

    run_id: str
    round: int
    graph_seed: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or len(self.run_id.encode()) > 255:
            raise ValueError("run_id must be a string of at most 255 UTF-8 bytes")
        if not 0 <= self.round < 1 << 64:
            raise ValueError("round must fit in 64 unsigned bits")
        if len(self.graph_seed) != 32:
            raise ValueError("graph_seed must be 32 bytes")

    def encode(self) -> bytes:
        """Canonical bytes (length-prefixed run id, round, seed)."""
        rid = self.run_id.encode()
        return PROTOCOL_TAG + struct.pack(">B", len(rid)) + rid + struct.pack(">Q", self.round) + self.graph_seed

    def digest(self) -> bytes:
        """SHA-256 of `encode()`: the HKDF salt of every key of this round."""
        return hashlib.sha256(self.encode()).digest()


def new_context(run_id: str | int, round: int, graph_seed: bytes | None = None) -> RoundContext:
    """Server side: a context with a fresh random graph seed."""
    return RoundContext(str(run_id), round, graph_seed if graph_seed is not None else os.urandom(32))
