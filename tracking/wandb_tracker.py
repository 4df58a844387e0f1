"""Weights & Biases: offline by default (the run directory is written locally; `wandb sync` sends
it later, if the site allows); online when `mode: online`. Each key is plotted against its own
axis (`round` or `step`), so a site's per-step and per-round figures share one run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tracking.tracker import Tracker


class WandbOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline: write the run directory "
                                                                                  "only; online: send to W&B")
    dir: str = Field(".", description="where the wandb/ run directories go (relative: under the party's workdir)")
    project: str | None = Field(None, description="the W&B project; default: the federation's name")
    name: str | None = Field(None, description="the run's name; default: the party (coordinator, site-<id>)")
    entity: str | None = Field(None, description="the W&B entity (online)")
    tags: list[str] = Field(default_factory=list, description="the run's tags")


class WandbTracker(Tracker):
    """One W&B run per party."""

    Options = WandbOptions

    def open(self) -> None:
        import wandb

        o = self.options
        root = self.run.workdir / Path(o.dir)
        root.mkdir(parents=True, exist_ok=True)
        self.wb = wandb.init(mode=o.mode, dir=str(root), project=o.project or self.run.experiment,
                             name=o.name or self.run.party, entity=o.entity, tags=o.tags or None,
                             group=self.run.experiment, job_type=self.run.party, reinit="create_new",
                             settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        self.axes: dict[str, str] = {}

    def log_metrics(self, metrics: dict[str, float], step: int, axis: str) -> None:
        for k in metrics:
            if k not in self.axes and k != axis:
                if axis not in self.axes.values():
                    self.wb.define_metric(axis, hidden=True)
                self.wb.define_metric(k, step_metric=axis)
                self.axes[k] = axis
        self.wb.log({**metrics, axis: step})

    def log_params(self, params: dict[str, str]) -> None:
        self.wb.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.wb.summary.update({f"tag/{k}": v for k, v in tags.items()})

    def close(self) -> None:
        self.wb.finish()

    def where(self) -> str:
        wb = getattr(self, "wb", None)
        return str(Path(wb.dir).parent) if wb is not None else "(not started)"
