"""A session's local checkpoints: save, resume after a restart, and rewind before a rerun round.

The files themselves are `local_checkpoint`'s (torch.distributed.checkpoint, sharded); this is
what a session keeps in them besides model and optimizer (its report count, the torch RNG, the
loop's own state) and when a rerun round restores the state of the round before it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from site_trainer import local_checkpoint

log = logging.getLogger("sovfl.trainer")


class LocalCheckpoints:
    """The local checkpoints of `session` (the `Session` that owns it): its model, optimizer,
    state hook, `rounds_reported` and `trained_round` are what they save and restore."""

    def __init__(self, session: Any):
        self.session = session

    def save(self, round_no: int) -> Path:
        """Collective: a sharded checkpoint of everything a resumed rank needs."""
        s = self.session
        t0 = time.perf_counter()
        extras = {"rounds_reported": s.rounds_reported, "torch_rng": torch.get_rng_state(),
                  "user": s.state.state_dict() if s.state is not None else {}}
        path = local_checkpoint.save(s.config.workdir, round_no, s.model, s.optimizer, extras,
                                     s.config.site.parallelism, s.config.site.checkpoint_keep)
        if s.rank == 0:
            log.info("site %s: local checkpoint of round %d in %s (%.2fs)", s.site, round_no, path,
                     time.perf_counter() - t0)
        return path

    def resume(self) -> int | None:
        """Collective: restore the newest local checkpoint if there is one; returns its round (-1: a
        checkpoint of another world size, model and optimizer only), None without one."""
        s = self.session
        path = local_checkpoint.find_latest(s.config.workdir)
        if path is None:
            return None
        round_no = self._restore(path)
        s.trained_round = max(round_no, 0)
        if s.rank == 0:
            log.info("site %s: resumed from local checkpoint %s (round %d: model, optimizer, RNG)", s.site, path,
                     round_no)
        return round_no

    def rewind(self, round_no: int) -> None:
        """Collective: before training `round_no` again (it is not after the newest round trained),
        restore the local checkpoint of the round before it: the optimizer's state (AdamW moments,
        step count), the RNG and the loop's state then are what the first attempt started from, so
        the rerun sends what that attempt sent. Exact with `checkpoint_every: 1` (and
        `checkpoint_keep` >= 2); without one the state goes on from the dead attempt, with a warning
        (no difference for plain SGD, which keeps none)."""
        s = self.session
        if round_no <= 0 or round_no > s.trained_round:
            return
        path = local_checkpoint.find_before(s.config.workdir, round_no) if s.config.site.checkpoint_every else None
        if path is None:
            if s.rank == 0:
                log.warning("site %s: round %d is trained again, but no local checkpoint of an earlier round is "
                            "there (checkpoint_every: 1 keeps one): the local optimizer state goes on from round %d",
                            s.site, round_no, s.trained_round)
            return
        restored = self._restore(path)
        if s.rank == 0:
            log.info("site %s: round %d is trained again (the coordinator resumed): local state of round %d "
                     "restored from %s", s.site, round_no, restored, path)

    def _restore(self, path: Path) -> int:
        """Collective: model, optimizer, RNG and loop state from the local checkpoint at `path`; its
        round (-1: another world size, model and optimizer only)."""
        s = self.session
        saved = local_checkpoint.load(path, s.model, s.optimizer, s.config.site.parallelism)
        if saved is None:
            return -1
        round_no, extras = saved
        torch.set_rng_state(extras["torch_rng"])
        s.rounds_reported = int(extras["rounds_reported"])
        if s.state is not None:
            s.state.load_state_dict(extras["user"])
        return round_no
