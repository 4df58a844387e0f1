"""The base of every federation config model: unknown fields are errors, values are immutable.

The federation's own (not site_trainer's): the config schema must not change when the trainer's
does, and the trainer must not change when the federation's does.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are errors (a typo must not be silently ignored); values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
