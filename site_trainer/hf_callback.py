"""A Hugging Face `Trainer` (or TRL's `SFTTrainer`, a `Trainer`) joins the federation: two lines.

    trainer = Trainer(model=peft_model, args=args, train_dataset=train, eval_dataset=val)
    hf_callback.federate(trainer)        # every rank, after building the Trainer
    trainer.train()                      # runs until the coordinator stops the site

`federate` adds a `FederatedCallback` built on `site_trainer.session`: every rank makes the same
calls, the framework does the rank-divergent parts. Round by round:

- before a round's first step the session has loaded the global weights (the exchanged tensors:
  the adapters with peft) into the Trainer's model on every rank;
- the Trainer runs `local_steps` optimizer steps (the round's, from the coordinator), then the
  callback reports (the mean training loss, this rank's share of the training set as its weight)
  and the session gathers the update; the next request is awaited inside the same step hook;
- an evaluation request runs `trainer.evaluate()` (every rank, the Trainer's own evaluation loop
  over `eval_dataset`) and reports its `eval_loss`;
- a stop (the coordinator's, or SIGTERM on the site) ends `trainer.train()` on every rank.

Distributed training stays the Trainer's: DDP and FSDP2 through its accelerate integration, the
process group the TrainingArguments formed (torchrun's) is the session's, which loads the global
weights into FSDP2's shards (DTensors) and gathers the whole update from them. accelerate shards only
on accelerators: on CPU ranks (gloo) a `fsdp` request runs DDP, and the callback says so
(`fsdp_note`; tests/test_hf_callback_fsdp.py). Trainer arguments that conflict with federation are
adjusted or refused when `federate` is called, with the reason:

- `max_steps` / `num_train_epochs`: the coordinator decides how long a site trains. The Trainer's
  loop is made endless (`max_steps` very large) and ends when the federation stops; a value the
  script set is replaced, with a warning.
- learning-rate schedule (`lr_scheduler_type`, `warmup_steps`/`warmup_ratio`): its horizon is the
  federation's rounds x local_steps (as the built-in loop's cosine), and at the start of round r the
  schedule is placed at step (r - 1) x local_steps, so that a site not sampled in some rounds is
  where the others are. `reduce_lr_on_plateau` (driven by the Trainer's own evaluations) is refused.
- `load_best_model_at_end`, which would swap the weights for a local checkpoint's, is refused.
- the model's KV cache (`config.use_cache`) is turned off for training: with packed sequences
  transformers separates documents by their position ids only when no cache is made.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from site_trainer import session as session_mod
from site_trainer.config import TrainerConfig

log = logging.getLogger("sovfl.hf_callback")

ENDLESS_STEPS = 1 << 40  # the Trainer's loop never ends on its own: the federation ends it


class FederationArgsError(ValueError):
    """A Trainer argument that cannot work in a federation; the message says what to change."""


def check_args(args, cfg: TrainerConfig) -> list[str]:
    """Adjust (in place) or refuse the TrainingArguments that conflict with federation; returns the
    adjustments made, each a sentence."""
    notes = []
    if getattr(args, "load_best_model_at_end", False):
        raise FederationArgsError("load_best_model_at_end=True would replace the federated weights with a local "
                                  "checkpoint's at the end; set it to False (the coordinator keeps the global model)")
    sched = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if sched == "reduce_lr_on_plateau":
        raise FederationArgsError("lr_scheduler_type='reduce_lr_on_plateau' follows the Trainer's own evaluations, "
                                  "which differ from site to site; use a step-based schedule (constant, linear, "
                                  "cosine): the callback places it by round number")
    if args.max_steps > 0 and args.max_steps != ENDLESS_STEPS:
        notes.append(f"max_steps={args.max_steps} is replaced: the coordinator decides how many steps a site trains "
                     "(local_steps per round, until the federation stops)")
    args.max_steps = ENDLESS_STEPS
    if sched not in ("constant", "constant_with_warmup"):
        notes.append(f"lr_scheduler_type={sched!r} runs over the federation's {planned_steps(cfg)} steps (rounds x "
                     "local_steps), placed at each round's start by its number")
    return notes


def fsdp_note(trainer: Trainer) -> str | None:
    """A sentence when the script asked for FSDP (`TrainingArguments.fsdp`) and the Trainer's
    accelerate will not shard: accelerate enables FSDP only on accelerators (its `DistributedType.FSDP`
    is chosen for MULTI_GPU/XPU/NPU/... only, accelerate/state.py), so on CPU ranks (gloo) the Trainer
    runs DDP (MULTI_CPU) and every rank holds the whole model. Training and the exchange stay correct."""
    if not getattr(trainer.args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        return None
    kind = getattr(getattr(trainer.accelerator, "state", None), "distributed_type", "?")
    return (f"TrainingArguments.fsdp is set but accelerate runs {getattr(kind, 'value', kind)}, not FSDP: accelerate "
            "shards only on GPUs (and other accelerators), so these CPU ranks train with DDP, each holding the whole "
            "model; drop `fsdp` on CPU, or run the site on GPUs (backend: nccl) to shard")


def planned_steps(cfg: TrainerConfig) -> int:
    """The schedule's horizon: the federation's rounds x this site's local_steps."""
    return max(1, (cfg.rounds or 1) * cfg.site.local_steps)


class FederatedCallback(TrainerCallback):
    """Runs the site's rounds inside `trainer.train()` (see the module docstring). Every rank."""

    def __init__(self, trainer: Trainer, *, config: TrainerConfig | None = None, exchanged=None,
                 data_digest: str | None = None):
        self.trainer = trainer
        self.cfg = config or session_mod.site_config()
        notes = check_args(trainer.args, self.cfg)
        notes += [n for n in (fsdp_note(trainer),) if n]
        for note in notes:
            log.warning("site %s: %s", self.cfg.site.id, note)
        model = trainer.model
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.session = session_mod.connect(model, exchanged=exchanged, num_examples=self._site_examples(),
                                           config=self.cfg, data_digest=data_digest or self._dataset_fingerprint())
        self._rounds = None
        self.round: session_mod.Round | None = None
        self.steps = 0
        self.losses: list[torch.Tensor] = []
        self.stopped = False
        self.rounds_trained = 0
        self._wrap_trainer()

    def _dataset_fingerprint(self) -> str | None:
        """The site's data for its audit log when the script names none: a Hugging Face `datasets`
        Dataset's own fingerprint (a hash of its source files and every transform applied), train
        and eval together; None for other datasets."""
        parts = [getattr(d, "_fingerprint", None) for d in (self.trainer.train_dataset, self.trainer.eval_dataset)
                 if d is not None]
        if not parts or not all(isinstance(p, str) and p for p in parts):
            return None
        return "datasets:" + "+".join(parts)

    # ---- what the Trainer is made to do --------------------------------------------------------
    def _wrap_trainer(self) -> None:
        """Record each micro-batch's loss (as the Trainer accounts it: the micro-batch losses of one
        optimizer step add up to that step's mean loss), and give the schedule its horizon."""
        trainer, losses = self.trainer, self.losses
        step_fn, sched_fn = trainer.training_step, trainer.create_scheduler

        def training_step(*a, **kw):
            loss = step_fn(*a, **kw)
            losses.append(loss.detach())
            return loss

        def create_scheduler(num_training_steps: int, optimizer=None):  # noqa: ARG001 - the federation's horizon
            return sched_fn(planned_steps(self.cfg), optimizer)

        trainer.training_step = training_step
        trainer.create_scheduler = create_scheduler

    def _site_examples(self) -> int | None:
        ds = self.trainer.train_dataset
        return len(ds) if ds is not None and hasattr(ds, "__len__") else None

    def _rank_examples(self) -> int:
        n = self._site_examples() or 0
        return len(range(self.rank, n, self.world))

    def _place_schedule(self, round_no: int) -> None:
        """Set the learning rate for the first step of round `round_no` ((r - 1) x local_steps)."""
        sched = self.trainer.lr_scheduler
        inner = getattr(sched, "scheduler", sched)  # accelerate wraps it
        if inner is None or round_no < 1:
            return
        if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):  # every schedule of transformers' get_scheduler is
            if not getattr(self, "_warned_schedule", False):
                log.warning("site %s: the learning-rate scheduler %s is not placed by round number (only LambdaLR "
                            "schedules are); it goes on step by step", self.cfg.site.id, type(inner).__name__)
                self._warned_schedule = True
            return
        pos = (round_no - 1) * self.cfg.site.local_steps
        inner.last_epoch = pos
        values = [base * fn(pos) for base, fn in zip(inner.base_lrs, inner.lr_lambdas)]
        for group, lr in zip(inner.optimizer.param_groups, values):
            group["lr"] = lr
        inner._last_lr = values

    # ---- the rounds ----------------------------------------------------------------------------
    def _next_training_round(self, control) -> None:
        """Collective: answer evaluations until a training request comes (its global weights are
        then in the model) or the federation stops (the Trainer is told to stop)."""
        self.round = None
        for rnd in self._rounds:
            if rnd.evaluating:
                self._evaluate(rnd)
                continue
            self.round, self.steps = rnd, 0
            self.losses.clear()
            self._place_schedule(rnd.number)
            control.should_training_stop = False
            return
        self.stopped = True
        control.should_training_stop = True

    def _evaluate(self, rnd) -> None:
        """Collective: the Trainer's evaluation of the global model on every rank; its eval_loss is the
        site's (the Trainer already averaged it over ranks), weighted by the validation set's size
        (its completion tokens for `site_data()`'s chat rows, as the built-in loop counts them)."""
        if self.trainer.eval_dataset is None:
            rnd.report(num_examples=0, loss=0.0)
            return
        metrics = self.trainer.evaluate()
        n = self._eval_weight()
        rnd.report(num_examples=n if self.rank == 0 else 0, loss=float(metrics.get("eval_loss", float("nan"))))

    def _eval_weight(self) -> int:
        """The validation set's completion tokens (as the built-in loop weighs chat data): `targets` of
        `site_data()`'s rows, the labels not -100 of `sft_datasets()`'s (after SFTTrainer packed them);
        its length for other data."""
        if getattr(self, "_eval_n", None) is None:
            ds = self.trainer.eval_dataset
            n = int(getattr(ds, "targets", 0) or 0)
            if not n and "labels" in (getattr(ds, "column_names", None) or ()):
                n = sum(int(np.count_nonzero(np.asarray(lab) != -100)) for lab in ds["labels"])
            self._eval_n = n or len(ds)
        return self._eval_n

    def _report(self, state) -> None:
        steps = max(self.steps, 1)
        loss = torch.stack(self.losses).float().sum() / steps if self.losses else 0.0
        lr = self.trainer._get_learning_rate() if self.trainer.lr_scheduler is not None else 0.0
        self.round.report(num_examples=self._rank_examples(), loss=loss, steps=self.steps,
                          global_step=state.global_step, lr=float(lr))
        self.rounds_trained += 1

    # ---- TrainerCallback ------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self._rounds is None:
            self._rounds = self.session.rounds()
        self._next_training_round(control)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.round is None:  # stopped: the Trainer is leaving its loop
            control.should_training_stop = True
            return control
        self.steps += 1
        if self.steps >= self.round.local_steps:
            self._report(state)
            self._next_training_round(control)
        else:
            control.should_training_stop = False  # never the Trainer's own end (max_steps): the federation's
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not self.stopped and self._rounds is not None:
            self._rounds.close()  # answers a round in flight with an error, shuts the endpoint
            print(f"site {self.cfg.site.id}: the Trainer ended before the federation did (its data or "
                  "max_steps ran out?); the session is closed", file=sys.stderr)
        return control


def federate(trainer: Trainer, *, config: TrainerConfig | None = None, exchanged=None,
             site_metrics: dict[str, float] | None = None) -> FederatedCallback:
    """Collective: join the federation with `trainer` (every rank, after building it, before
    `trainer.train()`). `config` defaults to $SOVFL_TRAINER_CONFIG's (set when sovfl starts the
    script); `exchanged` names the tensors that travel (default: the trainable parameters);
    `site_metrics` are added to every train reply (`SiteData.site_metrics`: the PII counts)."""
    cb = FederatedCallback(trainer, config=config, exchanged=exchanged)
    if site_metrics:
        cb.session.site_metrics = {str(k): float(v) for k, v in site_metrics.items()}
    trainer.add_callback(cb)
    return cb


@dataclass
class SiteData:
    """The site's data as the workload's task builds it, for a script's Trainer."""

    train: Any
    val: Any | None
    site_metrics: dict[str, float]  # the PII scrubber's counts per entity type (numbers, never text)
    task: Any

    def sft_datasets(self) -> tuple[Any, Any | None]:
        """(train, val) as `datasets.Dataset`s for TRL's `SFTTrainer`: one row per conversation, its
        `input_ids` and `labels` (-100 off the completion tokens), already rendered with the template,
        PII-scrubbed and truncated to `seq_len`, so `SFTTrainer` only packs them (`packing=True`,
        `max_length=seq_len`). Needs the `trl` extra (`pip install 'sovereign-fl[trl]'`)."""
        try:
            import datasets
        except ImportError as err:
            raise ImportError("SiteData.sft_datasets() needs Hugging Face `datasets` (with TRL): "
                              "pip install 'sovereign-fl[trl]'") from err
        if not hasattr(self.train, "conversations"):
            raise session_mod.SessionError("sft_datasets() is for chat data (workload option format: chat); "
                                           f"this task's training set is a {type(self.train).__name__}")
        out = [datasets.Dataset.from_dict(split.conversations()) if split is not None else None
               for split in (self.train, self.val)]
        return out[0], out[1]


def site_data(config: TrainerConfig | None = None) -> SiteData:
    """Collective (every rank, after the process group exists, e.g. after TrainingArguments): the
    site's train and validation sets built by the federation's task (`workload.task`) exactly as the
    built-in loop builds them, with the site's PII scrubber (`sites[].pii`) run first. For
    `hf-causal-lm` with `format: chat`: packed conversations as dicts of `input_ids`, `labels` (-100
    outside completions) and `position_ids`, which the Trainer's default collator stacks and the
    model's own loss reads."""
    import logging as logging_mod
    from pathlib import Path

    from site_trainer import strategies, workload_loader
    from site_trainer.pii import transform as pii_transform
    from site_trainer.workload import TaskContext

    cfg = config or session_mod.site_config()
    if cfg.workload.task is None:
        raise session_mod.SessionError("site_data() builds the data of a task workload (workload.task); this "
                                       "workload is a script: read your data in the script")
    s = cfg.site
    transforms = pii_transform.site_transforms(s.pii, workload_loader.task_class(cfg.workload.task),
                                               Path(cfg.workdir), s.id)
    ctx = TaskContext(role="site", seed=cfg.seed, site=s.id, partition=s.partition,
                      num_partitions=cfg.num_partitions, rank=dist.get_rank() if dist.is_initialized() else 0,
                      world_size=dist.get_world_size() if dist.is_initialized() else 1,
                      device=strategies.device_for(s.backend), workdir=Path(cfg.workdir),
                      log=logging_mod.getLogger(f"sovfl.task.{s.id}"), document_transforms=transforms)
    task = workload_loader.build_task(cfg.workload, ctx, cfg.options)
    data = task.build_data()
    metrics = pii_transform.round_metrics(transforms, f"task {cfg.workload.name!r}")
    return SiteData(data.train, data.val, metrics, task)

