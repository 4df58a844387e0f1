"""How a site brings back its own processes (trainer pool, SuperNode) after they die.

A killed trainer rank or SuperNode is restarted by the site's supervisor
(federation/ops/site_supervisor.py) under `sovfl site` and `sovfl simulate`. The budget is
bounded so a process that cannot start (a broken installation, a full disk) does not restart
forever: once `max_restarts` restarts happened within `window_s`, the supervisor gives up on it
and says so.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from federation.config.strict import StrictModel


class SiteRestarts(StrictModel):
    """`federation.site_restarts`: the restart budget of each supervised site process."""

    enabled: bool = Field(True, description="restart a site's trainer pool and SuperNode when they die")
    max_restarts: int = Field(10, ge=0, description="restarts of one process allowed within window_s; "
                              "one more death and the supervisor gives up on it")
    window_s: float = Field(3600.0, gt=0, description="the sliding window the budget counts restarts in")
    backoff_s: float = Field(1.0, ge=0, description="wait before the first restart; doubles with each "
                             "restart still in the window")
    backoff_max_s: float = Field(20.0, ge=0, description="the longest wait between restarts")
    link_watch: bool = Field(True, description="restart the SuperNode when its SuperLink comes back after being "
                             "unreachable (a restarted coordinator): flwr 1.41 SuperNodes that stay connected "
                             "across a SuperLink restart do not run the new run's messages")

    @model_validator(mode="after")
    def _backoff_order(self) -> "SiteRestarts":
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) is below backoff_s ({self.backoff_s})")
        return self

    def delay(self, recent: int) -> float:
        """Seconds to wait before a restart when `recent` restarts are already in the window."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** recent)
