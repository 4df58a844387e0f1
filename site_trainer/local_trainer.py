"""The built-in training loop: runs a declarative `Task` on one rank of a site, through the session.

The framework's part of a task: the model built for the site's parallelism (ddp, or meta-device
construction and sharding under ZeRO, with rank 0's real build streamed into every shard when
some weights do not travel), the optimizer and learning-rate schedule, batch sampling, gradient
accumulation, bf16, evaluation, and local checkpoints. It answers the coordinator through
`session.Session.rounds()`, exactly as a user's own script does: one machinery for both.

Every method that takes part in a collective says so; all ranks must call it. Tests and
benchmarks drive it directly (load_global / train / gather) without the endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import default_collate

from site_trainer import data_digest, host_memory, layout, strategies, workload_loader
from site_trainer.config import TrainerConfig
from site_trainer.pii import transform as pii_transform
from site_trainer.rank0_build import stream_rank0_build
from site_trainer.session import RequestRejected, Session
from site_trainer.step_tracking import step_tracking
from site_trainer.workload import Batch, TaskContext

log = logging.getLogger("sovfl.trainer")

EVAL_CHUNK = 256  # validation examples per forward pass
SLOW_STEP_S = 5.0  # the start-up step timing takes one pass, not two, when a pass is slower than this


def fetch(dataset: Any, indices: torch.Tensor, collate: Callable | None) -> Batch:
    """The batch of `indices`: a dataset's `take` (whole batch at once) when it has one, else its
    examples one by one through `collate` (torch's default_collate when the task gives none)."""
    take = getattr(dataset, "take", None)
    if take is not None:
        return take(indices)
    items = [dataset[i] for i in indices.tolist()]
    return (collate or default_collate)(items)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of a batch (nested tuples, lists, dicts) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        out = [to_device(v, device) for v in batch]
        return type(batch)(*out) if hasattr(batch, "_fields") else type(batch)(out)  # namedtuples too
    return batch


def _empty_like(data, train_idx: torch.Tensor) -> Batch:
    """A batch of no examples, shaped like the task's (a Poisson sample may draw none on a rank)."""
    one = fetch(data.train, train_idx[:1], data.collate)
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)


class LocalTrainer:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        s = cfg.site
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.parallelism = s.parallelism
        self.device = strategies.device_for(s.backend)
        sharded = s.parallelism in strategies.SHARDED
        if sharded and self.device.type == "cpu":  # ZeRO saving host memory
            host_memory.return_freed_memory_eagerly()
        strategies.check_supported(s.parallelism, s.backend, self.device)
        self.dtype = strategies.compute_dtype(s.mixed_precision, self.device)
        transforms = pii_transform.site_transforms(s.pii, workload_loader.task_class(cfg.workload.task),
                                                   Path(cfg.workdir), s.id)
        ctx = TaskContext(role="site", seed=cfg.seed, site=s.id, partition=s.partition,
                          num_partitions=cfg.num_partitions, rank=self.rank, world_size=self.world, device=self.device,
                          workdir=Path(cfg.workdir), log=logging.getLogger(f"sovfl.task.{s.id}"),
                          document_transforms=transforms)
        self.task = workload_loader.build_task(cfg.workload, ctx, cfg.options)
        torch.manual_seed(cfg.seed)
        self.data = self.task.build_data()
        # counts per PII entity type (never text): in every train reply, hence the round's metrics line
        site_metrics = pii_transform.round_metrics(transforms, f"task {cfg.workload.name!r}")
        if transforms and self.rank == 0:
            found = pii_transform.counts_from_metrics(site_metrics)
            log.info("site %s: PII scrubbed before tokenization: %s", s.id,
                     ", ".join(f"{k} {n}" for k, n in found.items()) or "no entity configured")
        self.module, self.model, exchanged, frozen = self._build_model(sharded)
        self.replicated = strategies.replicated_params(self.module) if sharded else []
        groups = strategies.param_groups(self.module.named_parameters(), s.weight_decay)
        self.optimizer = strategies.make_optimizer(groups, s.optimizer, s.lr, host_memory.long_lived)
        n_val = len(self.data.val) if self.data.val is not None else 0
        self.train_idx = torch.arange(len(self.data.train))[self.rank :: self.world]
        self.val_idx = torch.arange(n_val)[self.rank :: self.world]
        if len(self.train_idx) == 0:
            raise RuntimeError(f"site {s.id}: rank {self.rank} has no training data; use fewer ranks")
        self.gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s.partition * 1009 + self.rank)
        self.rounds_trained = 0
        self.sched_step = 0  # optimizer steps into the learning-rate schedule
        self.total_steps = cfg.rounds * s.local_steps if cfg.rounds else None
        self.dp = self._privacy() if s.privacy.enabled else None
        # DP-SGD's per-record clipping costs more than a plain step: no estimate rather than a low one
        step_s = self._time_step() if self.dp is None else None
        snapshot = data_digest.task_snapshot(self.task, self.data) if self.rank == 0 else None  # its audit log's
        self.session = Session(self.model, cfg, exchanged=exchanged, optimizer=self.optimizer, state=self,
                               frozen=frozen, num_examples=len(self.data.train), num_val_examples=n_val,
                               site_metrics=site_metrics, data_snapshot=snapshot, device=self.device,
                               describe={"compute": "bf16" if self.dtype else "fp32", "loop": "task",
                                         **({"step_s_estimate": step_s} if step_s else {})})
        self._background_total: torch.Tensor | None = None  # [loss x samples, samples] of background steps
        self._background_last = 0  # the schedule position background steps stop advancing at
        self._answered_steps = self.cfg.site.local_steps  # local_steps of the last train round answered
        self.tracking = step_tracking(cfg, self.rank, self.device)  # sites[].tracking, rank 0 only
        if self.tracking is not None:
            self.session.reply_listeners.append(self.tracking.reply)
        if self.dp is None:  # DP-SGD spends budget per round before its steps: no steps ahead of a request
            self.session.keep_training(self.background_step)
        if self.rank == 0:
            lay = self.session.layout
            log.info("site %s: task %s, parallelism %s on %d rank(s) (%d node(s)), %s compute, grad_accum %d%s; "
                     "%d tensor(s) (%d values) exchanged, %d frozen", s.id, cfg.workload.name, s.parallelism,
                     self.world, s.nnodes, "bf16" if self.dtype else "fp32", s.grad_accum,
                     ", activation checkpointing" if s.activation_checkpointing else "", len(lay.exchanged),
                     sum(x.numel for x in lay.exchanged), len(lay.frozen))

    def _time_step(self) -> float:
        """Collective: about how long one optimizer step takes here, measured before any round: the
        round planner's figure for round 1 (federation.round_target_s; later rounds use the steps
        the sites really ran). Two forward and backward passes over one batch of the site's data,
        the second timed (the slowest rank's), x grad_accum; in eval mode (no dropout draws, no batch-norm statistics),
        the gradients dropped and the random streams put back, so nothing a round sees changes. The
        optimizer's step is left out (it would change the weights): under ZeRO-2 it also gathers
        the parameters, and the estimate comes out low (benchmarks/step_estimate.py)."""
        s = self.cfg.site
        pick = self.train_idx[torch.arange(s.batch_size) % len(self.train_idx)]
        batch = to_device(fetch(self.data.train, pick, self.data.collate), self.device)
        cpu_rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        was_training = self.model.training
        self.model.eval()
        took = 0.0
        try:
            for _ in range(2):  # the first pays for lazy initialisation and allocator warm-up
                t0 = time.perf_counter()
                with strategies.autocast(self.parallelism, self.device, self.dtype):
                    loss = self.task.loss(self.model, batch)
                loss.float().backward()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                took = time.perf_counter() - t0
                self.optimizer.zero_grad(set_to_none=True)
                if self.world > 1:  # the slowest rank sets the pace, and every rank takes the same branch
                    slowest = torch.tensor([took], dtype=torch.float64, device=self.device)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    took = float(slowest.item())
                if took > SLOW_STEP_S:  # warm-up is small beside a pass this long: one is enough
                    break
        finally:
            self.model.train(was_training)
            torch.random.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        return round(took * s.grad_accum, 6)

    def _privacy(self):
        """Collective: the site's DP-SGD (site_trainer/privacy), refused with the field to fix."""
        from site_trainer.privacy.site_privacy import SitePrivacy

        s = self.cfg.site
        return SitePrivacy(s.privacy, site=s.id, module=self.module, loss_fn=self.task.loss,
                           records=len(self.data.train), batch_size=s.batch_size, grad_accum=s.grad_accum,
                           world=self.world, rounds=self.cfg.rounds, local_steps=s.local_steps,
                           workdir=self.cfg.workdir, device=self.device)

    # ---- the model ----------------------------------------------------------------------------
    def _build_model(self, sharded: bool) -> tuple[nn.Module, nn.Module, list[str], layout.FrozenDigest]:
        """Collective: (module, model to train, exchanged names, frozen digest).

        ddp: every rank builds the real model; DDP's construction broadcasts rank 0's parameters
        and buffers, and rank 0 fingerprints the frozen ones. ZeRO: every rank builds parameters
        on the meta device (buffers real) and allocates only its shards; when some tensors do not
        travel, rank 0 also builds the real model and streams it, tensor by tensor, into every
        rank's shards, fingerprinting the frozen tensors on the way.
        """
        s = self.cfg.site
        torch.manual_seed(self.cfg.seed)
        with strategies.parameters_on_meta() if sharded else contextlib.nullcontext():
            module = self.task.build_model()
        exchanged = list(self.task.exchanged(module))
        lay = layout.Layout.of(module, exchanged)
        blocks = list(self.task.blocks(module))
        if not sharded:
            module.to(self.device)
        model = strategies.wrap(module, s.parallelism, self.dtype, s.activation_checkpointing, self.device, blocks)
        frozen = layout.FrozenDigest()
        if sharded:
            with host_memory.long_lived():
                strategies.materialize_shards(module, self.device)
            if lay.frozen:
                stream_rank0_build(module, self.task.build_model, lay, frozen, seed=self.cfg.seed,
                                   rank=self.rank, device=self.device)
        elif self.rank == 0:
            tensors = layout.named_tensors(module)
            for name in lay.frozen:
                frozen.update(name, tensors[name])
        return module, model, lay.names, frozen

    # ---- the round ------------------------------------------------------------------------
    def load_global(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """Collective: rank 0 holds the global model in `arrays`; every rank gets it."""
        refused = self.session.load(arrays)
        if refused:
            raise RequestRejected("; ".join(f"global tensor {n} {why}" for n, why in refused.items()))

    def sample(self, size: int) -> Batch:
        pick = self.train_idx[torch.randint(len(self.train_idx), (size,), generator=self.gen)]
        return fetch(self.data.train, pick, self.data.collate)

    def _set_lr(self) -> None:
        s = self.cfg.site
        lr = strategies.lr_at(self.sched_step, s.lr, s.warmup_steps, s.lr_schedule, self.total_steps, s.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def dp_step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Collective: one DP-SGD step over this rank's part of a Poisson-sampled logical batch
        (site_trainer/privacy/dp_sgd.py): per-record clipping, one noise draw for the whole batch."""
        assert self.dp is not None
        t0 = time.perf_counter()
        batches = [to_device(b, self.device) for b in micro_batches]
        loss_sum, n = self.dp.gradients(batches, lambda: strategies.autocast(self.parallelism, self.device, self.dtype))
        self._set_lr()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sched_step += 1
        total = torch.stack([loss_sum.to(self.device, torch.float64),
                             torch.tensor(float(n), dtype=torch.float64, device=self.device)])
        self._track(total, t0)
        return total

    def _track(self, total: torch.Tensor, t0: float) -> None:
        """The step just taken (begun at `t0`), to the site's own trackers (rank 0, when sites[].tracking
        names any)."""
        if self.tracking is not None:
            self.tracking.step(self.sched_step, total, self.optimizer.param_groups[0]["lr"], time.perf_counter() - t0)

    def dp_sample(self) -> list[Batch]:
        """This rank's micro-batches of one Poisson-sampled logical batch."""
        assert self.dp is not None
        picks = self.dp.sample(self.train_idx, self.gen, self.cfg.site.grad_accum)
        return [fetch(self.data.train, p, self.data.collate) if len(p) else _empty_like(self.data, self.train_idx)
                for p in picks]

    def step(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Collective: one optimizer step over `micro_batches`, syncing gradients only on the last.

        Each micro-batch loss is divided by the number of micro-batches, so k equal micro-batches
        give the gradient of one batch k times larger. Returns [sum of loss x samples, samples] on
        the training device: reading it back is left to the caller, once per round, so that a GPU
        never waits for the host between steps.
        """
        t0, k = time.perf_counter(), len(micro_batches)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            n = self.task.batch_size(batch)
            batch = to_device(batch, self.device)
            with strategies.gradient_sync(self.model, self.parallelism, sync=i == k - 1):
                with strategies.autocast(self.parallelism, self.device, self.dtype):
                    loss = self.task.loss(self.model, batch)
                (loss.float() / k if k > 1 else loss.float()).backward()  # no divide op for one micro-batch
            total[0] += loss.detach().double() * n
            total[1] += n
        if self.replicated:
            strategies.average_grads(self.replicated)
        self._set_lr()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sched_step += 1
        self._track(total, t0)
        return total

    def background_step(self, round_no: int, first: bool) -> None:
        """Collective: one step of round `round_no` taken before its request arrived (federation.
        overlap, site_trainer/overlap.py); the first places the schedule and the batch stream at
        that round's start, as `train` would. Its loss counts in that round's report.

        Steps past the answered round's `local_steps` L (federation.overlap_max_steps_factor above
        1) keep the learning rate of the L-th, the position of round `round_no`'s last step if it
        has L steps too: the schedule does not run ahead into rounds the federation has not
        reached (with a factor of 1 no step is past it: the schedule is as before)."""
        s = self.cfg.site
        if first:
            self.sched_step = (round_no - 1) * s.local_steps
            self._background_last = self.sched_step + max(1, self._answered_steps) - 1
            self.gen.manual_seed(self._stream_seed(round_no))
            self._background_total = torch.zeros(2, dtype=torch.float64, device=self.device)
            self.model.train()
        self.sched_step = min(self.sched_step, self._background_last)
        self._background_total += self.step([self.sample(s.batch_size) for _ in range(s.grad_accum)])

    def train(self, steps: int, round_no: int | None = None, background: int = 0) -> dict:
        """Collective: `steps` optimizer steps of `grad_accum` sampled micro-batches each; returns this
        rank's report (the site's loss and samples, already summed over ranks).

        `round_no` (from the request) places the learning-rate schedule: round r starts at step
        (r - 1) x local_steps, so a site that was not sampled in some rounds is where the others are;
        and it seeds the round's batch sampling, so that a round run again (after a coordinator
        restart, federation/coordinator/resume.py) or by a restarted trainer draws the same batches.
        `background`: that many of the round's steps were already taken (`background_step`) and
        folded in; the schedule and batch stream go on from them and `steps - background` remain.
        """
        s = self.cfg.site
        carried, self._background_total = self._background_total, None
        if not background:
            carried = None
            if round_no is not None and round_no >= 1:
                self.sched_step = (round_no - 1) * s.local_steps
                self.gen.manual_seed(self._stream_seed(round_no))
        self.model.train()
        t0 = time.perf_counter()
        total = carried if carried is not None else torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.dp is not None:
            self.dp.spend(round_no if round_no is not None else self.rounds_trained + 1, steps)  # before they run
        remaining = max(steps - background, 0)
        for _ in range(remaining):
            if self.dp is not None:
                total += self.dp_step(self.dp_sample())
            else:
                total += self.step([self.sample(s.batch_size) for _ in range(s.grad_accum)])
        total = self._summed(total)  # waits for the device: train_s covers the work, not just its queuing
        seconds = time.perf_counter() - t0
        self.rounds_trained += 1
        out = {"num_examples": len(self.train_idx), "loss": float(total[0] / max(total[1], 1)),
               "steps": background + remaining,
               "samples_seen": int(total[1]), "train_s": seconds}
        if self.device.type == "cuda":
            out["cuda_peak_bytes"] = self._peak_cuda_bytes()
        return out

    def _stream_seed(self, round_no: int) -> int:
        """The seed of this rank's batch sampling in round `round_no`."""
        key = [self.cfg.seed % 2**63, self.cfg.site.partition, self.rank, round_no]
        return int(np.random.default_rng(key).integers(0, 2**62))

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
        """Collective: this rank's report of the task's `evaluate` over its share of the validation set.

        Every rank runs the same number of forward passes (ZeRO gathers in each): a rank whose share
        is exhausted evaluates a stand-in batch and discards it. Uses the bare module: under DDP that
        skips the wrapper, under ZeRO it is the sharded model.
        """
        val = self.data.val
        n_val = len(val) if val is not None else 0
        if n_val == 0:
            return {"num_examples": 0, "loss": 0.0}
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        longest = -(-n_val // self.world)
        for chunk in self.val_idx.tensor_split(max(1, -(-longest // EVAL_CHUNK))):
            real = len(chunk) > 0
            batch = fetch(val, chunk if real else torch.zeros(1, dtype=torch.long), self.data.collate)
            with strategies.autocast(self.parallelism, self.device, self.dtype):
                out = self.task.evaluate(self.module, to_device(batch, self.device))
            for k, v in out.items():
                v = torch.as_tensor(v, dtype=torch.float64, device=self.device) if not isinstance(v, torch.Tensor) \
                    else v.detach().to(self.device, torch.float64)
                sums[k] = sums.get(k, 0) + (v if real else torch.zeros_like(v))
        strategies.after_forward_only(self.model, self.parallelism)
        if "loss" not in sums or "examples" not in sums:
            raise ValueError(f"{type(self.task).__name__}.evaluate must return 'loss' (summed) and 'examples'; "
                             f"got {sorted(sums)}")
        n = int(sums.pop("examples").item())
        report: dict[str, Any] = {"num_examples": n, "loss": sums.pop("loss") / max(n, 1)}
        if "correct" in sums:
            report["accuracy"] = sums.pop("correct") / max(n, 1)
        report.update({k: v / max(n, 1) for k, v in sums.items()})
        return report

    def serve(self) -> None:
        """Collective: answer the coordinator's rounds until the trainer is stopped (then the site's
        trackers write what they hold)."""
        try:
            for rnd in self.session.rounds():
                self.run_round(rnd)
        finally:
            if self.tracking is not None:
                self.tracking.close()

    def run_round(self, rnd) -> None:
        """Collective: the built-in loop's part of one round (the global model is already loaded)."""
        if rnd.evaluating:
            rnd.report(**self.evaluate())
            return
        if self.dp is not None:
            refused = self.dp.refusal(rnd.number, rnd.local_steps)
            if refused:
                if self.rank == 0:
                    log.warning("site %s: %s", self.cfg.site.id, refused)
                rnd.refuse(refused)
                return
            report = self.train(rnd.local_steps, rnd.number)
            rnd.figures.update(self.dp.figures())
            rnd.report(**report)
            return
        self._answered_steps = rnd.local_steps  # background steps after this reply clamp their schedule at it
        rnd.report(**self.train(rnd.local_steps, rnd.number, background=rnd.background_steps))

    def run_request(self, method: str, request: dict) -> dict:
        """Collective: one Train or Evaluate request in-process, through the same code as a served
        one (benchmarks measure rounds this way); the reply on rank 0, {} elsewhere."""
        return self.session.serve_one(method, request, self.run_round)

    # ---- tools and tests --------------------------------------------------------------------
    def gather(self, visit: Callable[[str, torch.Tensor], None] | None = None) -> list[str]:
        """Collective: walk the full exchanged tensors (rank 0 passes `visit`); every rank's digest."""
        return self.session.gather(visit)

    def full_state(self) -> dict[str, np.ndarray]:
        """Collective: the exchanged tensors on rank 0 ({} elsewhere); for tests and tools."""
        return self.session.full_state()

    # ---- local checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a local checkpoint keeps of this loop: sampling stream, schedule position, rounds."""
        state = {"generator": self.gen.get_state(), "sched_step": self.sched_step, "rounds_trained": self.rounds_trained}
        if self.dp is not None:
            state["privacy_ledger"] = self.dp.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.dp is not None:  # never lowers the spent budget (the ledger on disk is ahead of any checkpoint)
            self.dp.load_state_dict(state.get("privacy_ledger"))
        self.gen.set_state(state["generator"])
        self.sched_step = int(state["sched_step"])
        self.rounds_trained = int(state["rounds_trained"])

    def save_checkpoint(self, round_no: int) -> Path:
        """Collective: a sharded checkpoint of everything a resumed rank needs."""
        return self.session.save_checkpoint(round_no)

    def resume(self) -> int | None:
        """Collective: restore the newest local checkpoint if there is one; returns its round."""
        return self.session.resume()
