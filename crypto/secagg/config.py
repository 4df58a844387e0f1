"""`SecAggConfig`: the validated settings of secure aggregation, and their resolution per round.

Static checks run when the model is built (types, ranges). What needs the number of clients n
runs later, from the same inputs on both sides: the neighbour graph's degree and the threshold
(`graph`, once a round's plan is known) and the ring (`codec`, once the coordinator knows who takes
part and with which weights; it announces the result and sites check it, see client.py).

The ring width (`bits`) is chosen for the round when unset: with values already quantized by a
clip-and-scale integer codec to L levels (int8: 254 steps over [-clip, clip]), the ring is the
narrowest that cannot wrap: b = bit length of n * W * L, W the round's largest weight (the sum of n
inputs, each at most W * L, stays below 2^b; see encoding.py); float values get 32 bits. Masked
words travel packed at b bits (ring.pack_words), so b is also the upload's bits per value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import ring
from .encoding import FixedPointCodec
from .errors import SecAggConfigError
from .graph import choose_degree

MiB = 1 << 20


class SecAggConfig(BaseModel):
    """Secure aggregation settings (one per federation, the same at every site).

    threshold: shares needed to rebuild a secret: an int t >= 2, or a fraction in (0, 1] of the
      k + 1 shares each secret is split into (rounded up, at least 2).
    neighbours: "auto" (sized from the security target, see graph.py) or a degree k.
    clip: inputs are clipped to [-clip, clip] before encoding (the same at every site).
    bits: ring Z_{2^bits}, 8..32; None (default): chosen per round (module docstring). Masked
      values travel packed at `bits` bits each.
    max_weight: largest integer weight (sample count) a site may give its update.
    chunk_bytes: about the size of a masked chunk on the wire (16 B .. 64 MiB; a chunk holds
      chunk_bytes * 8 / bits values, a multiple of 16).
    security_bits / correctness_bits: sigma and eta of the degree rule.
    corrupt_fraction / dropout_fraction: gamma and delta of the degree rule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="mask every update with SecAgg+")
    threshold: int | float = Field(default=0.5, description="shares needed to rebuild a secret: an int t >= 2, or a "
                                   "fraction in (0, 1] of the k + 1 shares each secret is split into (rounded up, "
                                   "at least 2)")
    neighbours: Literal["auto"] | int = Field(default="auto", description="each site's degree k in the masking graph; "
                                              "auto: sized from the security target")
    clip: float = Field(default=1.0, gt=0.0, allow_inf_nan=False, description="inputs are clipped to [-clip, clip] "
                        "before encoding (the same at every site)")
    bits: int | None = Field(default=None, ge=ring.MIN_BITS, le=ring.MAX_BITS, description="ring Z_{2^bits}; masked "
                             "values travel packed at bits bits each; unset: chosen per round")
    max_weight: int = Field(default=1000, ge=1, description="largest integer weight (sample count) a site may give "
                            "its update; a smaller bound narrows the ring")
    chunk_bytes: int = Field(default=4 * MiB, ge=16, le=64 * MiB, multiple_of=16, description="about the size of a "
                             "masked chunk on the wire")
    security_bits: int = Field(default=40, ge=1, le=128, description="sigma of the degree rule (statistical security)")
    correctness_bits: int = Field(default=20, ge=1, le=128, description="eta of the degree rule (failure "
                                  "probability 2^-eta)")
    corrupt_fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="gamma of the degree rule: the share "
                                    "of sites assumed to collude with the coordinator")
    dropout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="delta of the degree rule: the share of "
                                    "sites that may drop out")

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

    def chunk_words(self, bits: int) -> int:
        """Words per masked chunk in a `bits`-bit ring: chunk_bytes on the wire, a multiple of 16."""
        return max(16, (self.chunk_bytes * 8 // bits) // 16 * 16)

    def graph(self, n_clients: int) -> tuple[int, int]:
        """(degree k, threshold t) of a round of n_clients; SecAggConfigError if impossible."""
        return choose_degree(
            n_clients,
            self.neighbours,
            self.threshold,
            self.security_bits,
            self.correctness_bits,
            self.corrupt_fraction,
            self.dropout_fraction,
        )

    def codec(self, n_clients: int, weight_bound: int | None = None, value_levels: int | None = None) -> FixedPointCodec:
        """The ring of a round where at most n_clients inputs of weight <= weight_bound (default
        max_weight) are summed; `value_levels`: the levels of an integer codec the values are
        already quantized to (module docstring). SecAggConfigError if none fits."""
        w = self.max_weight if weight_bound is None else int(weight_bound)
        if not 1 <= w <= self.max_weight:
            raise SecAggConfigError(f"weight bound {w} outside [1, max_weight={self.max_weight}]")
        if self.bits is None and value_levels is not None:
            return FixedPointCodec.for_levels(self.clip, value_levels, w, n_clients)
        return FixedPointCodec.for_round(self.clip, 32 if self.bits is None else self.bits, w, n_clients)

    def resolve(self, n_clients: int, weight_bound: int | None = None, value_levels: int | None = None) -> RoundParams:
        """Round parameters for n_clients (graph and ring); raises SecAggConfigError if impossible."""
        degree, threshold = self.graph(n_clients)
        codec = self.codec(n_clients, weight_bound, value_levels)
        return RoundParams(n_clients, degree, threshold, codec, self.chunk_words(codec.bits))


@dataclass(frozen=True)
class RoundParams:
    """What a round runs with: n, degree k, threshold t, the codec and the chunk size in words."""

    n_clients: int
    degree: int
    threshold: int
    codec: FixedPointCodec
    chunk_words: int
