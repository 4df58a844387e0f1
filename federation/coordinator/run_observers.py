"""What keeps a record of a run beside its checkpoints and metrics.jsonl, wired to the run log.

The signed audit log (audit_hook.py: a round hook that also records each checkpoint once it is on
disk) and the experiment trackers (run_tracking.py: each metrics line as written). Either is off
when its configuration says so: the audit log needs the coordinator's provisioned bundle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from crypto.pki import CoordinatorBundle
from federation.config.schema import ExperimentConfig
from federation.coordinator.audit_hook import audit_hook
from federation.coordinator.roster import Roster
from federation.coordinator.round_hooks import RoundHook
from federation.coordinator.run_log import RunLog
from federation.coordinator.run_tracking import RunTracking, run_tracking
from federation.protocol.codecs import Arrays


def run_observers(cfg: ExperimentConfig, workdir: Path, bundle: CoordinatorBundle | None, roster: Roster,
                  run_id: int, model: Callable[[], Arrays], log: RunLog,
                  progress: Callable[[str], None]) -> tuple[list[RoundHook], RunTracking | None]:
    """The round hooks to add (the audit log's) and the trackers, each listening to `log`'s writes."""
    hooks: list[RoundHook] = []
    if cfg.federation.audit and bundle is not None:
        audit = audit_hook(workdir, cfg, bundle, roster, run_id, model)
        hooks.append(audit)
        log.listeners.append(audit.checkpointed)
    tracking = run_tracking(cfg, workdir, run_id, progress)  # federation.tracking
    if tracking is not None:
        log.listeners.append(tracking.line)
    return hooks, tracking
