"""`sites[].privacy`: record-level DP-SGD on one site, read from the site's own configuration.

Pydantic only (no torch): the federation's schema and the torch-free relay import this module.
The coordinator never sends any of it: a site's budget is what its own file says.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class PrivacyConfig(BaseModel):
    """DP-SGD of the site's trainer: per-record clipping to `max_grad_norm`, Gaussian noise of
    std `noise_multiplier` x `max_grad_norm` per logical batch, Poisson sampling of each batch.

    Give `epsilon` (the noise multiplier is calibrated so that the run's planned rounds x
    local_steps spend exactly it) or `noise_multiplier` (fixed; with `epsilon` as well, epsilon is
    a cap: the site trains until its next round would exceed it, then refuses rounds).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="DP-SGD on this site's records (off by default)")
    epsilon: float | None = Field(None, gt=0, description="the site's budget for the whole run, at `delta`")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) guarantee; below 1/records")
    noise_multiplier: float | None = Field(None, gt=0, description="sigma, fixed instead of calibrated")
    max_grad_norm: float = Field(1.0, description="C: every record's gradient is clipped to this L2 norm")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="rdp: Renyi DP (ours); prv: Opacus's PRV accountant")
    max_noise_multiplier: float = Field(
        50.0, gt=0, description="a calibrated sigma above this is refused: the budget cannot be met usefully")
    per_sample: Literal["auto", "vmap", "loop"] = Field(
        "auto", description="per-record gradients by torch.func.vmap, or one record at a time (any model); auto: "
                            "vmap, but one at a time where vmap would hold over 2^27 gradient values (records x "
                            "trainable parameters) or cannot run the model")
    noise_seed: int | None = Field(None, description="tests only: a fixed noise stream (default: OS entropy)")

    @field_validator("max_grad_norm")
    @classmethod
    def _positive_norm(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"max_grad_norm is {v}: it must be > 0 (the clipping bound C of one record's "
                             "gradient; 1.0 is a usual start, 0 would discard every gradient)")
        return v

    @model_validator(mode="after")
    def _budget_given(self) -> "PrivacyConfig":
        if self.enabled and self.epsilon is None and self.noise_multiplier is None:
            raise ValueError("privacy.enabled needs privacy.epsilon (the budget; the noise is calibrated to it) "
                             "or privacy.noise_multiplier (fixed noise)")
        return self
