"""What keeps a record of a run beside its checkpoints and metrics.jsonl, wired to the run log.

The signed audit log (audit_hook.py: a round hook that also records each checkpoint once it is on
disk) and the experiment trackers (run_tracking.py: each metrics line as written). Either is off
when its configuration says so: the audit log needs the coordinator's provisioned bundle. With the
audit log on, the rounds carry their terms and the sites' policies judge them: the forecast of
the announced ones (policy_forecast.py) goes first, so the log counts who sat out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from crypto.pki import CoordinatorBundle
from federation.config.schema import ExperimentConfig
from federation.coordinator.audit_hook import audit_hook
from federation.coordinator.policy_forecast import PolicyForecastHook, coordinator_identity
from federation.coordinator.roster import Roster
from federation.coordinator.round_hooks import RoundHook
from federation.coordinator.run_log import RunLog
from federation.coordinator.run_state import RunState
from federation.coordinator.run_tracking import RunTracking, run_tracking


def run_observers(cfg: ExperimentConfig, workdir: Path, bundle: CoordinatorBundle | None, roster: Roster,
                  run_id: int, state: Callable[[], RunState], codec: Callable[[int], str], log: RunLog,
                  progress: Callable[[str], None]) -> tuple[list[RoundHook], RunTracking | None]:
    """The round hooks to add (the policy forecast's and the audit log's) and the trackers, each
    listening to `log`'s writes; `codec(rnd)`: round `rnd`'s update codec."""
    hooks: list[RoundHook] = []
    if cfg.federation.audit and bundle is not None:
        def sent(site: str) -> int:
            return sum(site in sites for sites in state().aggregated.values())
        hooks.append(PolicyForecastHook(cfg, roster, run_id, coordinator_identity(bundle), codec, sent, progress))
        audit = audit_hook(workdir, cfg, bundle, roster, run_id, lambda: state().model)
        hooks.append(audit)
        log.listeners.append(audit.checkpointed)
    tracking = run_tracking(cfg, workdir, run_id, progress)  # federation.tracking
    if tracking is not None:
        log.listeners.append(tracking.line)
    return hooks, tracking
