"""The update pipeline: update → codec → protection → wire on the site, and back on the coordinator.

A `Payload` is named numpy arrays plus small scalar metadata: exactly what maps onto a Flower
ArrayRecord + ConfigRecord without pickle. Stages are small objects with `encode` (site) and
`decode` (coordinator); compression, secure aggregation and sealing plug in as stages without
touching the round logic. This module imports neither torch nor flwr (the relay imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

Scalar = int | float | str | bool | bytes


@dataclass
class Payload:
    arrays: dict[str, np.ndarray]
    meta: dict[str, Scalar] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class RoundContext:
    """What every stage may bind to: replay protection keys on (federation, run, round, site)."""

    federation: str
    run_id: int
    round: int
    site: str
    seed: int = 0


class UpdateRejected(ValueError):
    """An update is unusable; `reason` is a short stable code counted in the round's metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Stage(Protocol):
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
        for stage in self.stages:
            payload = stage.encode(payload, ctx)
        return payload

    def decode(self, payload: Payload, ctx: RoundContext) -> Payload:
        for stage in reversed(self.stages):
            payload = stage.decode(payload, ctx)
        return payload


def check_update(arrays: dict[str, np.ndarray], spec: dict[str, tuple[str, tuple[int, ...]]]) -> None:
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
