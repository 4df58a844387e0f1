"""A site's own experiment trackers (sites[].tracking), fed on rank 0: what stays on the site.

Per optimizer step: rank 0's training loss, the learning rate; per flush: rank 0's samples per
second over the steps flushed (their own seconds and the flush's wait for the device), peak host memory and (on a GPU) allocated device memory. Per round: every figure of the
train reply the site just sent (its loss, PII counts, epsilon where DP is on, idle fraction under
overlap). Step losses stay on the device until a flush (every `flush_every_steps` steps or
`flush_every_s` seconds), so a GPU waits for the host no more often than that; the trackers write
on their own threads (tracking/writer.py). Nothing here goes into any message.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from site_trainer.config import TrainerConfig
from tracking.flatten import flat_metrics, flat_params
from tracking.tracker import RunInfo
from tracking.writer import TrackingSession, open_session


EXPERIMENT = "sovereign-fl"  # a site does not know the federation's name; options name another


class StepTracking:
    """Rank 0's tracking session of one site trainer."""

    def __init__(self, session: TrackingSession, cfg: TrainerConfig, device: torch.device):
        self.session, self.device = session, device
        self.every_steps, self.every_s = cfg.site.tracking.flush_every_steps, cfg.site.tracking.flush_every_s
        self.pending: list[tuple[int, torch.Tensor, float]] = []  # (step, [loss x samples, samples], lr)
        self.pending_s = 0.0  # the pending steps' own seconds
        self.last_flush = time.perf_counter()
        session.params(flat_params(cfg.site.model_dump(mode="json", exclude={"tracking"}), "site.")
                       | {"workload": cfg.workload.name, "rounds": str(cfg.rounds), "seed": str(cfg.seed)})

    def step(self, step: int, total: torch.Tensor, lr: float, seconds: float) -> None:
        """Optimizer step `step` took `seconds`: `total` is its [loss x samples, samples] (left on the device)."""
        self.pending.append((step, total.detach().clone(), lr))
        self.pending_s += seconds
        if len(self.pending) >= self.every_steps or time.perf_counter() - self.last_flush >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Read the pending steps' losses (one device sync) and queue them."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        t0 = time.perf_counter()
        values = torch.stack([t for _, t, _ in pending]).cpu().tolist()
        self.last_flush = time.perf_counter()
        seconds, self.pending_s = self.pending_s + self.last_flush - t0, 0.0
        rate = sum(n for _, n in values) / max(seconds, 1e-9)
        memory = {"memory/host_peak_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
        if self.device.type == "cuda":
            memory["memory/cuda_allocated_bytes"] = float(torch.cuda.memory_allocated(self.device))
        rows = [(step, {"step/loss": loss_sum / max(n, 1), "step/lr": lr, "step/samples": n})
                for (step, _, lr), (loss_sum, n) in zip(pending, values)]
        rows.append((pending[-1][0], {"step/samples_per_s": rate, **memory}))
        self.session.rows(rows, "step")

    def reply(self, rnd: int, metrics: dict) -> None:
        """A train reply of round `rnd` was sent: its figures, as sent, at step = the round."""
        self.flush()
        self.session.metrics(flat_metrics(metrics, "round/"), rnd, "round")

    def close(self) -> None:
        """The trainer stops: the last steps, then the trackers closed."""
        self.flush()
        self.session.close()


def step_tracking(cfg: TrainerConfig, rank: int, device: torch.device) -> StepTracking | None:
    """Rank 0's tracking of this site (sites[].tracking), or None when it names no tracker or on
    other ranks."""
    if rank != 0:
        return None
    session = open_session(cfg.site.tracking, RunInfo(f"site-{cfg.site.id}", Path(cfg.workdir), EXPERIMENT))
    return StepTracking(session, cfg, device) if session is not None else None
