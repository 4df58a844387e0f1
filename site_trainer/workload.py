"""The workload interface: the user's model, data and loss, run by every rank of a site.

A workload is user code. The framework finds it by import path (`"mypkg.tasks:Legal"`) or by
entry point (group `sovereign_fl.workloads`: the built-ins `digits`, `slm` and `hf-causal-lm` are
registered there exactly like a user's), validates its options with the task's own pydantic
model, and runs it on every rank of a site, on the coordinator (to make the initial global model
and the manifest sites are checked against) and in `sovfl export`.

Two ways in, one machinery (site_trainer/session.py):
- a declarative `Task` (this module): the framework owns the loop, ddp/zero2/zero3, bf16, grad
  accumulation, checkpoints and the hand-off; the task says how to build the model and the data,
  the loss of a batch and what evaluation measures;
- a session for an existing torchrun script: every rank calls the same collective calls
  (`for rnd in session.rounds(): ...; rnd.report(...)`); the framework broadcasts the stop flag
  and the global weights and gathers the update. The built-in loop is itself a session user.

What travels between a site and the coordinator is explicit: `Task.exchanged(model)` names the
tensors (by default the trainable parameters, tied ones once; LoRA: the adapters). Everything
else stays on the site and is fingerprinted, so that sites with different frozen base weights
are refused before any update is averaged.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict

Batch = Any  # whatever the task's collate function returns (a tensor tuple, a dict of tensors, ...)
Role = Literal["site", "coordinator", "export"]


class NoOptions(BaseModel):
    """The options model of a task that takes none: any key given is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class TaskContext:
    """Where a task runs. The same on every rank of a site except `rank`."""

    role: Role
    seed: int = 0
    site: str | None = None  # the site id (None on the coordinator and in export)
    partition: int = 0  # this site's index among `num_partitions` (built-in data splits use it)
    num_partitions: int = 1
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    workdir: Path | None = None  # the site's own directory: caches (tokenized data), never shared
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("sovfl.task"))
    # Text tasks (`Task.reads_text`) on a site: what the framework runs on every raw document before
    # tokenization, in order (the site's PII scrubber from `sites[].pii`). Pass them first to
    # `text_data.Corpus(files, transforms=[*ctx.document_transforms, *yours])`. Empty elsewhere.
    document_transforms: tuple = ()


class Dataset(ABC):
    """Map-style and random access, so that each rank reads only the examples it samples.

    Back it by files (e.g. a memory-mapped token array) rather than by memory: a site's corpus is
    never loaded whole. torch's map-style datasets (TensorDataset, ...) fit this already.
    """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: int) -> Any: ...


class TensorRows(Dataset):
    """Examples as the rows of equally long tensors (features, labels, ...), already in memory.

    For data that is small enough to hold (the built-in toys); `take` gathers a whole batch with
    one index per tensor instead of collating examples one by one. A site's real corpus belongs
    in a file-backed Dataset instead.
    """

    def __init__(self, *tensors: torch.Tensor):
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise ValueError(f"TensorRows needs tensors of one length, got {[len(t) for t in tensors]}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The batch of examples `indices` (what collating them one by one would give)."""
        return tuple(t[indices] for t in self.tensors)


@dataclass
class TaskData:
    """A site's local examples. They never leave the site."""

    train: Dataset | torch.utils.data.Dataset
    val: Dataset | torch.utils.data.Dataset | None = None
    collate: Callable[[list], Batch] | None = None  # None: torch.utils.data.default_collate


class Task(ABC):
    """A declarative workload: subclass it, set `Options`, implement the three abstract methods.

    The framework calls `build_model` and `build_data` once per rank when the site trainer starts
    (and `build_model` on the coordinator and in export), then `loss` for every micro-batch and
    `evaluate` for every validation batch. Everything else has a default that fits most models.
    """

    Options: ClassVar[type[BaseModel]] = NoOptions
    # A task whose data is site text declares it: the framework then builds the site's PII scrubber
    # (`sites[].pii`, on by default) and hands it over as `ctx.document_transforms`, which the task
    # must run through `site_trainer.text_data.prepare` before its own transforms; the site trainer
    # refuses to start if the scrubber never ran. `sovfl scrub` finds the files with `text_files`.
    # Other tasks (the default) never load the scrubber.
    reads_text: ClassVar[bool] = False

    def __init__(self, options: BaseModel, ctx: TaskContext):
        self.options = options
        self.ctx = ctx

    # ---- required ------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """The model, with its initial weights, in float32 on the CPU (the framework moves it).

        Under ZeRO the framework may call this inside a context that puts parameters on the meta
        device (buffers stay real): build the structure the same way whatever the device, and
        load pretrained weights through the usual constructors (the framework streams rank 0's
        real weights into every rank's shards). Seed-dependent initialisation must use the
        torch RNG, which the framework seeds with `ctx.seed` before calling.
        """

    @abstractmethod
    def build_data(self) -> TaskData:
        """This site's train (and validation) examples, from site-local files; called on sites only."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of one micro-batch (a scalar tensor the framework calls backward on)."""

    # ---- optional ------------------------------------------------------------------------
    @classmethod
    def text_files(cls, options: BaseModel, ctx: TaskContext) -> list[tuple[Path, str | None]]:
        """Text tasks: the site's raw files as (path, "train" | "val" | None), from validated options
        and the site's context (no model is loaded). `sovfl scrub` scrubs exactly these."""
        raise NotImplementedError(f"{cls.__name__} reads text but does not say where: define the classmethod "
                                  "text_files(options, ctx)")

    def data_digest(self, data: TaskData) -> str | None:
        """A digest of the examples this site trains and evaluates on, for the site's audit log
        (its data snapshot; it never leaves the site). Default None: the framework digests what it
        can read itself, the text files of a task that reads text or `TensorRows` tensors
        (site_trainer/data_digest.py), and records other data as undeclared. Override for a
        file-backed dataset, e.g. with the digest of the files or of the table snapshot it reads."""
        return None

    def evaluate(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor | float]:
        """Sums over one validation batch; the framework adds them over batches and ranks.

        Must hold `loss` (the summed per-example loss) and `examples`; an optional `correct` is
        reported as `eval_accuracy`; any other key K is reported as `eval_K` (K / examples).
        """
        n = self.batch_size(batch)
        return {"loss": self.loss(model, batch).detach() * n, "examples": n}

    def batch_size(self, batch: Batch) -> int:
        """Examples in a batch (weights the loss in the round's metrics): the first tensor's length."""
        first = batch
        while isinstance(first, (tuple, list, dict)):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        return int(len(first))

    def exchanged(self, model: nn.Module) -> Sequence[str]:
        """Names (as in `model.state_dict()`) of the tensors that travel to and from the coordinator.

        Default: the trainable parameters, a tied parameter once under its first name. Integer
        buffers never travel. Override to send more (e.g. float buffers such as batch-norm
        statistics) or less.
        """
        return [name for name, p in model.named_parameters() if p.requires_grad]

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The repeated layers, each one a ZeRO sharding unit and an activation-checkpointing unit.

        Default: found generically (site_trainer.strategies.find_blocks): Hugging Face's
        `_no_split_modules` classes when the model declares them, else the longest ModuleList
        of modules of one class.
        """
        from site_trainer.strategies import find_blocks

        return find_blocks(model)

    def export(self, model: nn.Module, out_dir: Path, merge: bool = False) -> list[Path]:
        """Write the trained model in a form other tools load; returns the files written.

        Default: `model.safetensors` holding the model's state dict (`merge` does not apply).
        """
        return [save_state_dict(model, out_dir)]


def save_state_dict(model: nn.Module, out_dir: Path) -> Path:
    """`out_dir/model.safetensors`: the model's state dict, a tied tensor once (under its first name)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.safetensors"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(_untied(state), str(path))
    return path


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage: keep the first name of each storage."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1 - len(out)
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = t
    return out
