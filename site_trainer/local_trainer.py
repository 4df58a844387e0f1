"""One rank of a site's local distributed trainer: model, optimizer, data and the round's work.

No endpoint, no commands: `service.TrainerService` drives it in lock-step on every rank, and tests
drive it directly. Every method that takes part in a collective says so; all ranks must call it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from site_trainer import host_memory, local_checkpoint, strategies, workloads
from site_trainer.config import TrainerConfig

log = logging.getLogger("sovfl.trainer")

Batch = tuple[torch.Tensor, torch.Tensor]


class LocalTrainer:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        s = cfg.site
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.strategy = s.strategy
        self.device = strategies.device_for(s.backend)
        if s.strategy in strategies.SHARDED and self.device.type == "cpu":  # ZeRO saving host memory
            host_memory.return_freed_memory_eagerly()
        strategies.check_supported(s.strategy, s.backend, self.device)
        self.dtype = strategies.compute_dtype(s.mixed_precision, self.device)
        torch.manual_seed(cfg.seed)
        self.data = workloads.build_data(cfg.workload, s.partition, cfg.num_partitions, cfg.seed)
        self.loss_fn = workloads.loss_fn(cfg.workload)
        sharded = s.strategy in strategies.SHARDED
        # Under ZeRO no rank materializes the full model: built on the meta device, sharded, then
        # given storage for its own shards only; the real weights arrive with every round request.
        module = workloads.make_model(cfg.workload, cfg.seed, device="meta" if sharded else None)
        self.names = list(module.state_dict().keys())
        self.spec = {n: ("<f4", tuple(t.shape)) for n, t in module.state_dict().items()}
        if not sharded:
            module.to(self.device)
        self.model = strategies.wrap(module, s.strategy, self.dtype, s.activation_checkpointing, self.device)
        if sharded:
            with host_memory.long_lived():
                strategies.materialize_shards(module, self.device)
        self.optimizer = strategies.make_optimizer(self.model.parameters(), s.optimizer, s.lr, host_memory.long_lived)
        self.module = module
        self.train_idx = torch.arange(len(self.data.train_y))[self.rank :: self.world]
        self.val_idx = torch.arange(len(self.data.val_y))[self.rank :: self.world]
        if len(self.train_idx) == 0:
            raise RuntimeError(f"site {s.id}: rank {self.rank} has no training data; use fewer ranks")
        self.gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s.partition * 1009 + self.rank)
        self.rounds_trained = 0
        if self.rank == 0:
            log.info("site %s: strategy %s on %d rank(s) (%d node(s)), %s compute, grad_accum %d%s", s.id, s.strategy,
                     self.world, s.nnodes, "bf16" if self.dtype else "fp32", s.grad_accum,
                     ", activation checkpointing" if s.activation_checkpointing else "")

    # ---- the round ------------------------------------------------------------------------
    def load_global(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """Collective: rank 0 holds the validated global model in `arrays`; every rank gets it."""
        strategies.load_full_state(self.module, self.device, arrays)

    def sample(self, size: int) -> Batch:
        pick = self.train_idx[torch.randint(len(self.train_idx), (size,), generator=self.gen)]
        return self.data.train_x[pick], self.data.train_y[pick]

    def step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Collective: one optimizer step over `micro_batches`, syncing gradients only on the last.

        Each micro-batch loss is divided by the number of micro-batches, so k equal micro-batches
        give the gradient of one batch k times larger. Returns [sum of loss x samples, samples] on
        the training device: reading it back is left to the caller, once per round, so that a GPU
        never waits for the host between steps.
        """
        k = len(micro_batches)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device), y.to(self.device)
            with strategies.gradient_sync(self.model, self.strategy, sync=i == k - 1):
                with strategies.autocast(self.strategy, self.device, self.dtype):
                    loss, _ = self.loss_fn(self.model, x, y)
                (loss.float() / k).backward()
            total[0] += loss.detach().double() * len(y)
            total[1] += len(y)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def train(self, steps: int) -> dict:
        """Collective: `steps` optimizer steps of `grad_accum` sampled micro-batches each."""
        s = self.cfg.site
        self.model.train()
        total, t0 = torch.zeros(2, dtype=torch.float64, device=self.device), time.perf_counter()
        for _ in range(steps):
            total += self.step([self.sample(s.batch_size) for _ in range(s.grad_accum)])
        total = self._summed(total)  # waits for the device: train_s covers the work, not just its queuing
        seconds = time.perf_counter() - t0
        self.rounds_trained += 1
        out = {"loss": float(total[0] / total[1]), "steps": steps, "samples_seen": int(total[1]), "train_s": seconds}
        if self.device.type == "cuda":
            out["cuda_peak_bytes"] = self._peak_cuda_bytes()
        return out

    def _summed(self, t: torch.Tensor) -> torch.Tensor:
        """Collective: `t` summed over all ranks, returned on the CPU (NCCL reduces device tensors only)."""
        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def _peak_cuda_bytes(self) -> int:
        """Collective: the largest `max_memory_allocated` of any rank since the last call (then reset)."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], dtype=torch.float64, device=self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Collective: every rank runs the same number of forward passes (ZeRO gathers in each).

        Uses the bare module: under DDP that skips the wrapper, under ZeRO it is the sharded model.
        """
        self.model.eval()
        d = self.data
        acc = torch.zeros(3, dtype=torch.float64)
        longest = -(-len(d.val_y) // self.world)
        for chunk in self.val_idx.tensor_split(max(1, -(-longest // 256))):
            real = len(chunk) > 0
            chunk = chunk if real else torch.zeros(1, dtype=torch.long)  # keep in step with the others
            with strategies.autocast(self.strategy, self.device, self.dtype):
                loss, correct = self.loss_fn(self.module, d.val_x[chunk].to(self.device), d.val_y[chunk].to(self.device))
            if real:
                acc += torch.tensor([loss.item() * len(chunk), len(chunk), max(correct, 0)], dtype=torch.float64)
        strategies.after_forward_only(self.model, self.strategy)
        acc = self._summed(acc)
        out = {"eval_loss": float(acc[0] / max(acc[1], 1)), "num_val_examples": int(acc[1])}
        if d.val_y.dtype == torch.long and d.val_y.dim() == 1:
            out["eval_accuracy"] = float(acc[2] / max(acc[1], 1))
        return out

    @torch.no_grad()
    def gather(self, visit: Callable[[str, torch.Tensor], None] | None = None) -> list[str]:
        """Collective: walk the full weights (rank 0 passes `visit` to pack them) and return every
        rank's digest. See `strategies.visit_full_state` for what a digest covers."""
        mine = strategies.visit_full_state(self.module, visit)
        if self.world == 1:
            return [mine]
        out: list = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def full_state(self) -> dict[str, np.ndarray]:
        """Collective: the full fp32 weights on rank 0 ({} elsewhere); for tests and tools."""
        out: dict[str, np.ndarray] = {}
        keep = (lambda n, t: out.__setitem__(n, t.numpy().copy())) if self.rank == 0 else None
        self.gather(keep)
        return out

    # ---- local checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, round_no: int, site_state: dict[str, np.ndarray]) -> Path:
        """Collective: a sharded checkpoint of everything a resumed rank needs."""
        t0 = time.perf_counter()
        path = local_checkpoint.save(self.cfg.workdir, round_no, self.rounds_trained, self.model, self.optimizer, self.gen, site_state,
                                     self.strategy, self.cfg.site.checkpoint_keep)
        if self.rank == 0:
            log.info("site %s: local checkpoint of round %d in %s (%.2fs)", self.cfg.site.id, round_no, path,
                     time.perf_counter() - t0)
        return path

    def resume(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """Collective: restore the newest local checkpoint if there is one; returns (round, site_state)."""
        path = local_checkpoint.find_latest(self.cfg.workdir)
        if path is None:
            return None
        extras = local_checkpoint.load(path, self.model, self.optimizer, self.strategy)
        round_no = -1
        site_state: dict[str, np.ndarray] = {}
        if extras is not None:
            self.gen.set_state(extras.generator)
            torch.set_rng_state(extras.torch_rng)
            round_no, site_state = extras.round, extras.site_state
            self.rounds_trained = extras.rounds_trained
        if self.rank == 0:
            log.info("site %s: resumed from local checkpoint %s (round %d: model, optimizer, RNG, %d site-state "
                     "array(s))", self.cfg.site.id, path, round_no, len(site_state))
        return round_no, site_state
