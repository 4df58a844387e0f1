"""The two stage kinds a codec chains: an optional sparsifier, then a value coder.

Stages only see flat float32 vectors and produce named payload arrays; the ``Codec`` in
``chain.py`` owns metadata, error feedback and validation of the overall payload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np

from .base import Arrays, CodecRound, MetaValue, meta_int
from .codec_errors import MetadataError


class ValueCoder(ABC):
    """Encodes a dense float32 vector of ``m`` values (the whole update, or the kept values)."""

    #: canonical spec token, e.g. ``"int8:clip=0.05"``
    token: str
    #: names of the payload arrays this coder emits
    array_names: tuple[str, ...]
    #: payloads of different sites can be added element-wise and decode to the sum
    linear: bool = False
    #: integer payloads: largest |value| one site can send; ``None`` for float payloads
    qmax: int | None = None

    @abstractmethod
    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[Arrays, np.ndarray]:
        """Return (payload arrays, float32 reconstruction the receiver will decode)."""

    @abstractmethod
    def decode(self, arrays: Mapping[str, np.ndarray], m: int, summed: int) -> np.ndarray:
        """Validate the payload and return ``m`` float32 values (the sum, if ``summed`` > 1)."""


class Sparsifier(ABC):
    """Chooses which coordinates travel."""

    token: str
    array_names: tuple[str, ...]
    #: all sites pick the same coordinates (so payloads line up and can be summed)
    shared_support: bool = False

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def k(self, numel: int) -> int:
        """Number of coordinates kept: round(fraction * numel), at least 1, at most numel."""
        if numel == 0:
            return 0
        return min(numel, max(1, int(round(self.fraction * numel))))

    def checked_k(self, meta: Mapping[str, MetaValue], numel: int) -> int:
        """``k`` for ``numel``, after checking that the payload's metadata says the same."""
        k = self.k(numel)
        if meta_int(meta, "k") != k:
            raise MetadataError(f"metadata k={meta['k']} but {self.token} keeps k={k} of numel={numel}")
        return k

    @abstractmethod
    def select(self, x: np.ndarray, ctx: CodecRound) -> tuple[np.ndarray, Arrays, dict[str, MetaValue]]:
        """Return (sorted int64 indices, index payload arrays, metadata)."""

    @abstractmethod
    def support(
        self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, MetaValue], numel: int, ctx: CodecRound | None
    ) -> np.ndarray:
        """Validate and return the sorted int64 indices a payload refers to."""
