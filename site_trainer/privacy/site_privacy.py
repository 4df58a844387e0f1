"""A site's DP-SGD and its budget: calibration, the ledger of spent steps, refusal of a round.

The budget is enforced here, on the site, from the site's own `sites[].privacy`: nothing the
coordinator sends changes it. Every round's steps are written to the ledger
(`<workdir>/privacy/ledger.json`, atomically, by rank 0) BEFORE they are trained: a step that ran
is spent, whatever happens next (a crash, a coordinator resume that runs the round again, a
trainer restart from an older local checkpoint). The ledger also travels in the local checkpoint
(the loop's state); restoring a checkpoint never lowers it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from crypto.durable import write_atomic
from site_trainer.privacy import accountant
from site_trainer.privacy.config import PrivacyConfig
from site_trainer.privacy.dp_sgd import (LossFn, NoisyReducer, PerSampleClipper, batch_len, incompatible_layers,
                                         poisson_sample, sample_rate)

log = logging.getLogger("sovfl.trainer")
LEDGER = Path("privacy") / "ledger.json"


class PrivacyRefused(ValueError):
    """A privacy configuration the site cannot run; the message names the field and the fix."""


@dataclass
class Ledger:
    """Spent steps as (q, sigma, steps) runs, and the rounds that spent them."""

    history: list[list] = field(default_factory=list)
    rounds: list[list[int]] = field(default_factory=list)  # [round, steps] in the order trained

    @property
    def steps(self) -> int:
        return sum(int(s) for _, _, s in self.history)

    def with_steps(self, q: float, sigma: float, steps: int) -> list[tuple[float, float, int]]:
        """The history as the accountant takes it, with `steps` more at (q, sigma) (runs merged)."""
        out = [(float(a), float(b), int(c)) for a, b, c in self.history]
        if steps:
            if out and out[-1][:2] == (q, sigma):
                out[-1] = (q, sigma, out[-1][2] + steps)
            else:
                out.append((q, sigma, steps))
        return out

    def add(self, q: float, sigma: float, steps: int, round_no: int) -> None:
        self.history = [list(t) for t in self.with_steps(q, sigma, steps)]
        self.rounds.append([int(round_no), int(steps)])

    def to_json(self) -> dict:
        return {"version": 1, "history": self.history, "rounds": self.rounds}

    @classmethod
    def from_json(cls, raw: dict) -> "Ledger":
        return cls([[float(q), float(s), int(n)] for q, s, n in raw.get("history", [])],
                   [[int(r), int(n)] for r, n in raw.get("rounds", [])])

    @classmethod
    def read(cls, workdir: str | Path) -> "Ledger":
        path = Path(workdir) / LEDGER
        if not path.is_file():
            return cls()
        return cls.from_json(json.loads(path.read_text()))

    def write(self, workdir: str | Path) -> None:
        write_atomic(Path(workdir) / LEDGER, json.dumps(self.to_json()))


class SitePrivacy:
    """DP-SGD for `LocalTrainer` on one site: every rank holds one (the same ledger on each)."""

    def __init__(self, cfg: PrivacyConfig, *, site: str, module: nn.Module, loss_fn: LossFn, records: int,
                 batch_size: int, grad_accum: int, world: int, rounds: int | None, local_steps: int,
                 workdir: str | Path, device: torch.device):
        self.cfg, self.site, self.workdir = cfg, site, Path(workdir)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        bad = incompatible_layers(module)
        if bad:
            raise PrivacyRefused(f"site {site}: sites[].privacy: the model has layers whose output for one record "
                                 f"depends on the batch ({', '.join(bad[:5])}: batch normalisation); per-record "
                                 "gradients do not exist for them. Replace them with GroupNorm or LayerNorm, or "
                                 "set privacy.enabled: false")
        self.records = records
        self.q = sample_rate(batch_size, grad_accum, world, records)
        if self.q > 1:
            raise PrivacyRefused(f"site {site}: sites[].privacy: the expected batch batch_size x grad_accum x ranks "
                                 f"= {batch_size * grad_accum * world} exceeds the site's {records} training "
                                 "records; lower batch_size or grad_accum")
        self.planned = rounds * local_steps if rounds else None
        if cfg.noise_multiplier is not None:
            self.sigma = float(cfg.noise_multiplier)
        else:
            assert cfg.epsilon is not None
            if self.planned is None:
                raise PrivacyRefused(f"site {site}: sites[].privacy.epsilon is calibrated over the run's planned "
                                     "rounds x local_steps, but the trainer config has no rounds; set "
                                     "privacy.noise_multiplier instead, or give the run's rounds")
            sigma = accountant.calibrate(cfg.epsilon, cfg.delta, self.q, self.planned, cfg.accountant,
                                         cfg.max_noise_multiplier)
            if sigma is None:
                raise PrivacyRefused(
                    f"site {site}: sites[].privacy.epsilon {cfg.epsilon} (delta {cfg.delta}) cannot be met over "
                    f"{self.planned} steps (rounds x local_steps) at sampling rate {self.q:.4g}: it needs a noise "
                    f"multiplier above privacy.max_noise_multiplier {cfg.max_noise_multiplier}. Raise epsilon, "
                    "or plan fewer rounds or local_steps, or lower batch_size x grad_accum")
            self.sigma = sigma
        self.clipper = PerSampleClipper(module, loss_fn, cfg.max_grad_norm, cfg.per_sample)
        self.reducer = NoisyReducer(self.sigma, cfg.max_grad_norm, device, cfg.noise_seed)
        if cfg.noise_seed is not None and self.rank == 0:  # for tests: whoever knows the seed can remove the noise
            log.warning("site %s: sites[].privacy.noise_seed is set: the DP noise is reproducible from it, so the "
                        "reported epsilon holds only against parties who do not know the seed; unset it outside "
                        "tests (the noise then comes from OS entropy)", site)
        self.ledger = self._read_ledger()
        self.spent = accountant.epsilon(self.ledger.history, cfg.delta, cfg.accountant)
        if self.rank == 0:
            planned = (accountant.epsilon([(self.q, self.sigma, self.planned)], cfg.delta, cfg.accountant)
                       if self.planned else None)
            log.info("site %s: DP-SGD on: noise multiplier %.4g, max_grad_norm %g, Poisson sampling rate %.4g "
                     "(expected batch %.1f of %d records), %s accountant, delta %g; epsilon spent %.4g%s%s",
                     site, self.sigma, cfg.max_grad_norm, self.q, self.q * records, records, cfg.accountant,
                     cfg.delta, self.spent, f", {planned:.4g} after the planned {self.planned} steps" if planned
                     else "", f", budget {cfg.epsilon}" if cfg.epsilon is not None else "")

    # ---- the budget -------------------------------------------------------------------------
    def _read_ledger(self) -> Ledger:
        """Collective: rank 0's ledger file, on every rank."""
        box: list[Any] = [Ledger.read(self.workdir).to_json() if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return Ledger.from_json(box[0])

    def refusal(self, round_no: int, steps: int) -> str | None:
        """Why round `round_no` (`steps` steps) must not train: it would exceed the budget; else None."""
        budget = self.cfg.epsilon
        if budget is None:
            return None
        after = accountant.epsilon(self.ledger.with_steps(self.q, self.sigma, steps), self.cfg.delta,
                                   self.cfg.accountant)
        if after <= budget * (1 + 1e-9):
            return None
        return (f"privacy budget: round {round_no} ({steps} DP-SGD steps) would spend epsilon {after:.4g} > the "
                f"site's budget {budget:g} at delta {self.cfg.delta:g} (spent so far {self.spent:.4g} over "
                f"{self.ledger.steps} steps; sites[].privacy.epsilon in the site's own configuration); this site "
                "trains no further round")

    def spend(self, round_no: int, steps: int) -> None:
        """Collective: record `steps` steps of round `round_no` as spent, on disk before they run."""
        self.ledger.add(self.q, self.sigma, steps, round_no)
        if self.rank == 0:
            self.ledger.write(self.workdir)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank trains a step the ledger does not hold yet
        self.spent = accountant.epsilon(self.ledger.history, self.cfg.delta, self.cfg.accountant)

    def figures(self) -> dict[str, float]:
        """The round's privacy figures for the metrics line (the same on every rank)."""
        out = {"dp_epsilon": self.spent, "dp_delta": self.cfg.delta, "dp_noise_multiplier": self.sigma,
               "dp_steps": float(self.ledger.steps), "dp_sample_rate": self.q,
               "dp_max_grad_norm": self.cfg.max_grad_norm}
        if self.cfg.epsilon is not None:
            out["dp_epsilon_budget"] = self.cfg.epsilon
        return out

    # ---- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.ledger.to_json()

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's ledger, unless the one held has more steps (spent budget never goes down)."""
        if state:
            other = Ledger.from_json(state)
            if other.steps > self.ledger.steps:
                self.ledger = other
                self.spent = accountant.epsilon(self.ledger.history, self.cfg.delta, self.cfg.accountant)

    # ---- one step ---------------------------------------------------------------------------
    def sample(self, indices: torch.Tensor, gen: torch.Generator, grad_accum: int) -> list[torch.Tensor]:
        """This rank's part of one logical batch (Poisson at rate q over its shard), in micro-batches."""
        return list(poisson_sample(indices, self.q, gen).tensor_split(grad_accum))

    def gradients(self, micro_batches: list, autocast) -> tuple[torch.Tensor, int]:
        """Collective: put the logical batch's noisy clipped mean gradient into `.grad` of every
        trainable parameter; returns (this rank's summed loss, its records)."""
        clip = self.clipper
        sums, loss_sum, n = clip.zeros(), torch.zeros((), dtype=torch.float64, device=clip.params[0].device), 0
        for batch in micro_batches:
            with autocast():
                part, losses = clip.clipped_sum(batch)
            for acc, g in zip(sums, part):
                acc.add_(g)
            loss_sum += losses
            n += batch_len(batch)
        for p, g in zip(clip.params, self.reducer.reduce(sums, self.q * self.records)):
            p.grad = g.to(p.dtype)
        return loss_sum, n

