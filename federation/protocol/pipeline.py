"""The update pipeline: update → codec → protection → wire on the site, and back on the coordinator.

A `Payload` is named numpy arrays plus small scalar metadata: exactly what maps onto a Flower
ArrayRecord + ConfigRecord without pickle (payload_records.py). Stages are small objects with
`encode` (site) and `decode` (coordinator): the codec (update_codec.py) and the envelope
(site/protection_mod.py signs and seals, coordinator/envelope_opener.py opens) plug in as stages
without touching the round logic. Secure aggregation is not a stage: the sum is what opens, so the
site's SecAgg mod masks the codec's values and the coordinator's SecAgg round unmasks the sum.
This module imports neither torch nor flwr.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from federation.protocol.codecs import Arrays, CodecRound

Scalar = int | float | str | bool | bytes


@dataclass
class Payload:
    """What one stage hands the next: named arrays and the scalar metadata that travels with them."""

    arrays: Arrays
    meta: dict[str, Scalar] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of array data (what a stage's output costs on the wire, headers aside)."""
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class RoundContext:
    """The one round identity of federation/: what every stage may bind to. Replay protection keys on
    (federation, run, round, site); `seed` is the round's public seed (shared-seed codecs)."""

    federation: str
    run_id: int
    round: int
    site: str
    seed: int = 0

    def for_site(self, site: str) -> "RoundContext":
        """The same round as seen for one site's update."""
        return replace(self, site=site)

    def codec_round(self, site_seed: int | None = None) -> CodecRound:
        """What a codec needs of this round; `site_seed` makes stochastic rounding reproducible
        (simulations and tests), None draws it from OS entropy."""
        return CodecRound(self.round, self.seed, site_seed)


class UpdateRejected(ValueError):
    """An update is unusable; `reason` is a short stable code counted in the round's metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Stage(Protocol):
    """One reversible step of the update pipeline (a codec, an envelope)."""

    name: str

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Site side: transform the outgoing update."""

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Coordinator side: undo `encode`, or raise UpdateRejected."""


@dataclass(frozen=True)
class Pipeline:
    """Stages in site order; the coordinator runs them in reverse."""

    stages: tuple[Stage, ...] = ()

    def encode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Site: every stage in order."""
        for stage in self.stages:
            payload = stage.encode(payload, ctx)
        return payload

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        """Coordinator: every stage in reverse order."""
        for stage in reversed(self.stages):
            payload = stage.decode(payload, ctx)
        return payload


def check_update(arrays: Arrays, spec: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Reject updates with unknown/missing tensors, wrong shapes or dtypes, NaN or Inf."""
    if set(arrays) != set(spec):
        missing = sorted(set(spec) - set(arrays))
        extra = sorted(set(arrays) - set(spec))
        raise UpdateRejected("wrong_tensors", f"missing {missing[:5]}, unexpected {extra[:5]}")
    for name, arr in arrays.items():
        dtype, shape = spec[name]
        if arr.dtype != np.dtype(dtype):
            raise UpdateRejected("wrong_dtype", f"{name} is {arr.dtype}, expected {np.dtype(dtype)}")
        if tuple(arr.shape) != tuple(shape):
            raise UpdateRejected("wrong_shape", f"{name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        if not np.isfinite(arr).all():
            raise UpdateRejected("non_finite", f"{name} contains NaN or Inf")
