"""Sparsifiers: top-k by magnitude (indices on the wire) and shared-seed random-k (no indices).

Neither is unbiased on its own; both are meant to run with error feedback, which keeps every
coordinate that was not sent in the site's residual until a later round sends it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Mapping

import numpy as np

from .base import Arrays, CodecRound, MetaValue, meta_int, payload_array
from .bitpack import MAX_RICE_R, packed_nbytes, rice_decode, rice_encode
from .codec_errors import DuplicateIndexError, IndexOrderError, IndexRangeError, MetadataError
from .coders import Sparsifier

_RANDK_DOMAIN = 0x72616E646B  # "randk": separates this stream from any other use of the seed
_INT32_MAX = 2**31 - 1


class TopK(Sparsifier):
    """Keep the k largest |values|. Indices travel as int32 or Rice delta-coded (``index=delta``).

    Not linear under masks: every site picks different coordinates.
    """

    def __init__(self, fraction: float, index_coding: Literal["int32", "delta"] = "delta") -> None:
        super().__init__(fraction)
        self.index_coding = index_coding
        self.token = f"topk:{fraction!r}:index={index_coding}"
        self.array_names = ("indices",) if index_coding == "int32" else ("index_unary", "index_low")

    def select(self, x: np.ndarray, ctx: CodecRound) -> tuple[np.ndarray, Arrays, dict[str, MetaValue]]:
        """The k largest |values|, their indices coded as configured."""
        n = x.size
        k = self.k(n)
        if k == n:
            idx = np.arange(n, dtype=np.int64)
        else:
            idx = np.argpartition(np.abs(x), n - k)[n - k :].astype(np.int64)
            idx.sort()
        meta: dict[str, MetaValue] = {"k": k}
        if self.index_coding == "int32":
            dtype = np.int32 if n - 1 <= _INT32_MAX else np.int64
            return idx, {"indices": idx.astype(dtype)}, meta
        unary, low, r = rice_encode(idx)
        meta["rice_r"] = r
        return idx, {"index_unary": unary, "index_low": low}, meta

    def support(
        self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, MetaValue], numel: int, ctx: CodecRound | None
    ) -> np.ndarray:
        """Decode and check the indices: in range, ascending, no duplicates."""
        k = self.checked_k(meta, numel)
        if self.index_coding == "delta":
            r = meta_int(meta, "rice_r", 0, MAX_RICE_R)
            unary = payload_array(arrays, "index_unary", np.uint8, None)
            low = payload_array(arrays, "index_low", np.uint8, packed_nbytes(k, r))
            return rice_decode(unary, low, r, k, numel)
        idx = payload_array(arrays, "indices", (np.int32, np.int64), k).astype(np.int64)
        if k == 0:
            return idx
        out = (idx < 0) | (idx >= numel)
        if out.any():
            i = int(np.argmax(out))
            raise IndexRangeError(f"index {int(idx[i])} at position {i} is outside [0, {numel})")
        step = np.diff(idx)
        if (step < 0).any():
            i = int(np.argmax(step < 0))
            raise IndexOrderError(
                f"indices are not sorted ascending ({int(idx[i])} then {int(idx[i + 1])} at position {i})"
            )
        if (step == 0).any():
            i = int(np.argmax(step == 0))
            raise DuplicateIndexError(f"index {int(idx[i])} appears more than once (position {i})")
        return idx


@lru_cache(maxsize=8)
def shared_indices(seed: int, server_round: int, numel: int, k: int) -> np.ndarray:
    """The k sorted coordinates every site keeps this round, derived only from public values.

    Why not ``Generator.choice``: numpy may change how Generator methods consume the stream
    between versions, and sites on different numpy versions would then disagree on coordinates.
    Raw Philox output is stable, so we rank ``numel`` raw 64-bit keys and keep the k smallest
    (ties broken by lowest index), which is a uniform k-subset.
    """
    if k >= numel:
        out = np.arange(numel, dtype=np.int64)
    else:
        bitgen = np.random.Philox(np.random.SeedSequence([_RANDK_DOMAIN, seed, server_round, numel, k]))
        keys = bitgen.random_raw(numel)
        threshold = np.partition(keys, k - 1)[k - 1]
        mask = keys < threshold
        ties = np.flatnonzero(keys == threshold)[: k - int(mask.sum())]
        mask[ties] = True
        out = np.flatnonzero(mask).astype(np.int64)
    out.setflags(write=False)
    return out


class RandK(Sparsifier):
    """Keep k coordinates drawn from the coordinator's round seed: identical on every site, so
    no indices travel and payloads line up for summing under secure aggregation."""

    shared_support = True
    array_names = ()

    def __init__(self, fraction: float) -> None:
        super().__init__(fraction)
        self.token = f"randk:{fraction!r}"

    def select(self, x: np.ndarray, ctx: CodecRound) -> tuple[np.ndarray, Arrays, dict[str, MetaValue]]:
        """The round's shared k coordinates: nothing about them travels but k and the seed."""
        k = self.k(x.size)
        idx = shared_indices(ctx.seed, ctx.server_round, x.size, k)
        return idx, {}, {"k": k, "seed": ctx.seed, "server_round": ctx.server_round}

    def support(
        self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, MetaValue], numel: int, ctx: CodecRound | None
    ) -> np.ndarray:
        """Rebuild the shared coordinates from the payload's seed and round (checked against this round's)."""
        k = self.checked_k(meta, numel)
        seed = meta_int(meta, "seed", 0, 2**63 - 1)
        server_round = meta_int(meta, "server_round", 0, 2**63 - 1)
        if ctx is not None and (seed, server_round) != (ctx.seed, ctx.server_round):
            raise MetadataError(
                f"payload was encoded for round {server_round} with seed {seed}, but this is round "
                f"{ctx.server_round} with seed {ctx.seed} (stale or replayed update)"
            )
        return shared_indices(seed, server_round, numel, k)
