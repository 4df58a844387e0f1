"""The coordinator's experiment trackers (tracking/): each round's metrics line as written to
metrics.jsonl, the run's configuration (secrets left out) as parameters, the final model's digest
and the checkpoint `sovfl export` reads as tags.

Fed from the run log's write (run_log.RunLog.listeners), so a tracker holds exactly metrics.jsonl's
figures, at the moment the line is on disk; the trackers' own threads do the writing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from federation.config.schema import ExperimentConfig
from federation.coordinator.checkpoint import CheckpointStore
from federation.protocol.codecs import Arrays
from federation.protocol.downlink_steps import model_digest
from tracking.flatten import flat_metrics, flat_params
from tracking.tracker import RunInfo
from tracking.writer import TrackingSession, open_session

PARTY = "coordinator"


class RunTracking:
    """The coordinator's tracking session of one run."""

    def __init__(self, session: TrackingSession, cfg: ExperimentConfig, run_id: int):
        self.session = session
        session.params({"run_id": str(run_id), **flat_params(cfg.model_dump(mode="json"))})

    def line(self, record: dict) -> None:
        """A metrics line as written: its numbers at step = its round."""
        self.session.metrics(flat_metrics(record), int(record["round"]), "round")

    def finish(self, model: Arrays, checkpoints: CheckpointStore, history: list[dict]) -> None:
        """The run is over: its tags (the final model's digest, the checkpoint `sovfl export` reads,
        the last round's status), then every tracker closed (what is queued written, within
        `close_timeout_s`)."""
        rounds = checkpoints.rounds()
        tags = {"status": history[-1]["status"] if history else "no round",
                "checkpoint": str(checkpoints.path(rounds[0])) if rounds else ""}  # newest first
        try:
            tags["model_digest"] = model_digest(model)
        except Exception as err:  # noqa: BLE001 - a run that failed mid-round may hold no whole model
            tags["model_digest"] = f"unavailable ({type(err).__name__})"
        self.session.tags(tags)
        self.session.close()


def run_tracking(cfg: ExperimentConfig, workdir: Path, run_id: int,
                 progress: Callable[[str], None]) -> RunTracking | None:
    """The coordinator's tracking (federation.tracking), or None when it names no tracker."""
    session = open_session(cfg.federation.tracking, RunInfo(PARTY, Path(workdir), cfg.federation.name), progress)
    return RunTracking(session, cfg, run_id) if session is not None else None
