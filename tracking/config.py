"""`tracking:` in the coordinator's and in each site's configuration: which trackers a party writes to.

Pydantic only (the ClientApp's import path reads the site schema): a backend's options are
checked against its plug-in's own `Options` model, found by entry point, without importing the
tracker's library.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class BackendSpec(BaseModel):
    """One tracker: its plug-in name and that plug-in's own options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(description="the tracker's entry point name in group sovereign_fl.trackers: tensorboard, "
                                  "mlflow, wandb, or a user's plug-in")
    options: dict[str, Any] = Field(default_factory=dict, description="the tracker's own options (its plug-in's "
                                                                      "Options model)")

    @model_validator(mode="after")
    def _options_fit(self) -> "BackendSpec":
        from tracking.registry import options_model  # entry points: no tracker library is imported

        options_model(self.kind).model_validate(self.options)
        return self


class TrackingConfig(BaseModel):
    """The trackers one party writes its figures to (none by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backends: list[BackendSpec] = Field(default_factory=list, description="the trackers written to, each with its "
                                                                          "options; empty: tracking off")
    queue_records: int = Field(1000, ge=1, description="records waiting per tracker; past it new records are dropped "
                                                       "and counted (a slow tracker never slows a round)")
    flush_every_steps: int = Field(10, ge=1, description="a site's step-level figures are read and queued at least "
                                                         "every this many optimizer steps")
    flush_every_s: float = Field(5.0, gt=0, description="... or at least every this many seconds, whichever is first")
    process: bool = Field(True, description="run each tracker in a helper process of its own (its work never competes "
                                           "with training for the interpreter); false: a thread in the party's process")
    close_timeout_s: float = Field(60.0, ge=0, description="at the end of the run, how long the trackers may take "
                                                           "to write what is queued (a first MLflow SQLite store "
                                                           "creates its tables then); past it a tracker's records "
                                                           "are counted as dropped and its helper process killed")

    @property
    def enabled(self) -> bool:
        return bool(self.backends)
