"""MLflow: one MLflow run per party, through `MlflowClient` (no global active run). The store is
a SQLite file in the party's workdir unless `tracking_uri` names another (a server's URL)."""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, ConfigDict, Field

from tracking.tracker import Tracker

BATCH = 1000  # MLflow's most metrics in one log_batch


class MlflowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(None, description="an MLflow tracking URI; default: sqlite:///<workdir>/mlflow.db")
    experiment: str | None = Field(None, description="the experiment's name; default: the federation's name")
    run_name: str | None = Field(None, description="the run's name; default: the party (coordinator, site-<id>)")
    tags: dict[str, str] = Field(default_factory=dict, description="tags set on the run when it starts")
    http_retries: int = Field(2, ge=0, description="retries of a call to a server (MLFLOW_HTTP_REQUEST_MAX_RETRIES, "
                                                   "unless set in the environment)")
    http_timeout_s: int = Field(10, ge=1, description="seconds per call to a server (MLFLOW_HTTP_REQUEST_TIMEOUT, "
                                                      "unless set in the environment)")


class MlflowTracker(Tracker):
    """Metrics, parameters and tags of one MLflow run."""

    Options = MlflowOptions

    def uri(self) -> str:
        return self.options.tracking_uri or f"sqlite:///{(self.run.workdir / 'mlflow.db').resolve()}"

    def open(self) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.options.http_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(self.options.http_timeout_s))
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.run.workdir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri())
        name = self.options.experiment or self.run.experiment
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=self.options.run_name or self.run.party,
                                             tags={"sovfl.party": self.run.party, **self.options.tags}).info.run_id

    def log_metrics(self, metrics: dict[str, float], step: int, axis: str) -> None:
        self.log_rows([(step, metrics)], axis)

    def log_rows(self, rows: list[tuple[int, dict[str, float]]], axis: str) -> None:
        """Every row in as few calls as MLflow allows (one per 1000 figures)."""
        ms = int(time.time() * 1000)
        items = [self._metric(k, v, ms, step) for step, metrics in rows for k, v in metrics.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + BATCH])

    def log_params(self, params: dict[str, str]) -> None:
        items = [self._param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's most params in one log_batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[self._tag(k, v) for k, v in tags.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def where(self) -> str:
        return f"{self.uri()} run {getattr(self, 'run_id', '(not started)')}"
