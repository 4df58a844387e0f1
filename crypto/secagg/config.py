"""`SecAggConfig`: the validated settings of secure aggregation, and their resolution per round.

Static checks run when the model is built (types, ranges); the checks that need the number of
clients n (threshold <= shares <= n, enough quantization levels) run in `SecAggConfig.resolve`,
which the server calls once the roster of a round is known and clients repeat from the same
inputs, so both sides derive identical `RoundParams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import ring
from .encoding import FixedPointCodec
from .graph import choose_degree

MiB = 1 << 20


class SecAggConfig(BaseModel):
    """Secure aggregation settings (one per federation, the same at every site).

    threshold: shares needed to rebuild a secret: an int t >= 2, or a fraction in (0, 1] of the
      k + 1 shares each secret is split into (rounded up, at least 2).
    neighbours: "auto" (sized from the security target, see graph.py) or a degree k.
    clip: inputs are clipped to [-clip, clip] before encoding (the same at every site).
    bits: ring Z_{2^bits}, 8..32; at most 4 bytes per parameter travel.
    max_weight: largest integer weight (sample count) a site may give its update.
    chunk_bytes: size of a masked chunk on the wire (multiple of 16 bytes, 16 B .. 64 MiB).
    security_bits / correctness_bits: sigma and eta of the degree rule.
    corrupt_fraction / dropout_fraction: gamma and delta of the degree rule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    threshold: int | float = 0.5
    neighbours: Literal["auto"] | int = "auto"
    clip: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    bits: int = Field(default=32, ge=ring.MIN_BITS, le=ring.MAX_BITS)
    max_weight: int = Field(default=1000, ge=1)
    chunk_bytes: int = Field(default=4 * MiB, ge=16, le=64 * MiB, multiple_of=16)
    security_bits: int = Field(default=40, ge=1, le=128)
    correctness_bits: int = Field(default=20, ge=1, le=128)
    corrupt_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    dropout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)

    @field_validator("threshold")
    @classmethod
    def _threshold(cls, v: int | float) -> int | float:
        if isinstance(v, bool):
            raise ValueError("threshold must be an int or a float")
        if isinstance(v, int) and v < 2:
            raise ValueError("an integer threshold must be >= 2")
        if isinstance(v, float) and not 0.0 < v <= 1.0:
            raise ValueError("a fractional threshold must be in (0, 1]")
        return v

    @field_validator("neighbours")
    @classmethod
    def _neighbours(cls, v: str | int) -> str | int:
        if isinstance(v, int) and (isinstance(v, bool) or v < 1):
            raise ValueError("neighbours must be 'auto' or an int >= 1")
        return v

    @property
    def chunk_words(self) -> int:
        """uint32 words per masked chunk."""
        return self.chunk_bytes // 4

    def resolve(self, n_clients: int) -> RoundParams:
        """Round parameters for a roster of n_clients; raises SecAggConfigError if impossible."""
        degree, threshold = choose_degree(
            n_clients,
            self.neighbours,
            self.threshold,
            self.security_bits,
            self.correctness_bits,
            self.corrupt_fraction,
            self.dropout_fraction,
        )
        codec = FixedPointCodec.for_round(self.clip, self.bits, self.max_weight, n_clients)
        return RoundParams(n_clients, degree, threshold, codec, self.chunk_words)


@dataclass(frozen=True)
class RoundParams:
    """What a round runs with: n, degree k, threshold t, the codec and the chunk size in words."""

    n_clients: int
    degree: int
    threshold: int
    codec: FixedPointCodec
    chunk_words: int
