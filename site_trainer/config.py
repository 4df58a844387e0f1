"""Site-side configuration: the workload every site trains and one site's trainer pool.

Pydantic only at import (no torch): the federation's schema and the torch-free Flower relay
import this module. Validating a `WorkloadConfig` does import the task it names (and so torch):
a task path that does not import or options that its `Options` model refuses are errors of the
configuration file, reported before anything starts (site_trainer/workload_loader.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from site_trainer.pii.config import PiiConfig
from site_trainer.policy_config import SitePolicy
from site_trainer.privacy.config import PrivacyConfig
from tracking.config import TrackingConfig
from site_trainer.workload_loader import check_site, check_workload, merge_options


class StrictModel(BaseModel):
    """Unknown fields are errors (typos must not be silently ignored); values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _flat_form_hint(data: dict) -> str:
    """How to rewrite a workload in the flat form of earlier versions (`name:` plus options)."""
    options = {k: v for k, v in data.items() if k != "name"}
    inner = ", ".join(f"{k}: {v}" for k, v in options.items())
    return (f"the flat workload form (`workload: {{name: {data['name']}, ...}}`) is no longer supported; write "
            f"`workload: {{task: {data['name']}, options: {{{inner}}}}}` (task: an entry point name such as "
            "digits or slm, or an import path 'pkg.module:Class'; options: that task's own settings)")


class WorkloadConfig(StrictModel):
    """The user's model, data and loop, the same at every site (site_trainer/workload.py).

    Two forms:
    - a declarative task: `{task: NAME_OR_PATH, options: {...}}` where the task is an entry point
      name of group `sovereign_fl.workloads` (`digits`, `slm`, `hf-causal-lm`, or a user's) or an
      import path `pkg.module:Class` of a `site_trainer.workload.Task` subclass; `options` are
      validated by that class's own `Options` model;
    - an existing torchrun script that uses `site_trainer.session`: `{script: PATH, args: [...],
      model: "pkg.module:factory", options: {...}}`. `model` names a factory
      `factory(options: dict) -> torch.nn.Module` that the coordinator calls (after seeding torch
      with the federation's seed) for the initial global model and the manifest sites are checked
      against; its trainable parameters are what travels, as in the script's session.
    Per-site settings (e.g. data paths) go in `sites[].workload_options`, merged over `options`.
    """

    task: str | None = Field(None, description="entry point name or 'pkg.module:Class' of a Task")
    options: dict[str, Any] = Field(default_factory=dict, description="the task's (or script's) own settings")
    script: str | None = Field(None, description="a torchrun script using site_trainer.session")
    args: list[str] = Field(default_factory=list, description="the script's command-line arguments")
    model: str | None = Field(None, description="script workloads: 'pkg.module:factory' of the initial model")

    @model_validator(mode="wrap")
    @classmethod
    def _form_and_task(cls, data: Any, handler, info: ValidationInfo) -> "WorkloadConfig":
        """The flat form of earlier versions is refused with its rewrite; a relative script path is
        made absolute (relative to `context["config_dir"]` when the caller gives one, else to the
        working directory); then the task (or the script's model factory) is imported and checked."""
        if not isinstance(data, dict):
            return handler(data)  # an instance: checked when it was made
        if "name" in data:
            raise ValueError(_flat_form_hint(data))
        data = dict(data)
        # The bare default (no workload section) is built when federation.config is imported; checking
        # it there would import torch into every `sovfl` command. Its task is checked when a site starts.
        defaulted = not data
        if data.get("task") is None and data.get("script") is None:
            data["task"] = "digits"  # the default workload: sklearn's bundled digits
        script = data.get("script")
        if isinstance(script, str) and script and not Path(script).is_absolute():
            base = Path((info.context or {}).get("config_dir") or Path.cwd())
            data["script"] = str((base / script).resolve())
        cfg = handler(data)
        cfg._check_form()
        if not defaulted:
            check_workload(cfg)
        return cfg

    def _check_form(self) -> None:
        if self.task is not None and self.script is not None:
            raise ValueError("give either task (a declarative Task) or script (a torchrun script using the "
                             "session), not both")
        if self.script is not None and not self.model:
            raise ValueError("a script workload needs model: 'pkg.module:factory' (factory(options) -> nn.Module), "
                             "the initial global model the coordinator builds")
        if self.task is not None and (self.args or self.model):
            raise ValueError("args and model apply to script workloads only; a task builds its own model")

    @property
    def name(self) -> str:
        """A short label for progress lines: the task's name or the script's file name."""
        return self.task if self.task is not None else Path(self.script or "").name


class SiteConfig(StrictModel):
    """One sovereign site: a local trainer pool of `ranks` processes per node joined as one client."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="the site's name: its PKI bundle, `sovfl site --site`, "
                    "the metrics")
    ranks: int = Field(1, ge=1, le=64, description="trainer processes per node (one per GPU)")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend: gloo (CPU) or nccl (GPUs)")
    partition: int = Field(ge=0, description="index of this site's data partition")
    workload_options: dict[str, Any] = Field(
        default_factory=dict, description="this site's workload options (e.g. its data paths), merged over "
                                          "workload.options (nested mappings merged key by key)")
    local_steps: int = Field(10, ge=1, description="optimizer steps per round (round_target_s may choose others)")
    batch_size: int = Field(32, ge=1, description="per rank, per micro-batch")
    lr: float = Field(0.05, gt=0, description="the local (inner) optimizer's learning rate")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step")
    optimizer: Literal["sgd", "adamw"] = Field("sgd", description="the local (inner) optimizer")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW) or L2 (SGD)")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after warm-up: constant lr, or cosine decay to min_lr over the run's total "
                                "steps (the federation's rounds x local_steps)")
    min_lr: float = Field(0.0, ge=0, description="where the cosine schedule ends")
    dump_updates: bool = Field(False, description="keep each returned update on disk (tests, audits)")
    # How the site's ranks share the work (see site_trainer/README.md).
    parallelism: Literal["ddp", "zero2", "zero3"] = Field(
        "ddp", description="ddp: replicate everything; zero2: shard gradients and optimizer state (FSDP2, "
                           "parameters kept after forward); zero3: shard parameters too")
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: bf16 compute and gradient reduction, fp32 master weights and optimizer state")
    activation_checkpointing: bool = Field(False, description="recompute each transformer block in backward")
    checkpoint_every: int = Field(0, ge=0, description="sharded local checkpoint every N trained rounds; 0 = off")
    checkpoint_keep: int = Field(2, ge=1, description="local checkpoints kept on disk")
    pii: PiiConfig = Field(
        default_factory=PiiConfig,
        description="PII scrubbing of the site's raw text before tokenization (tasks that read text, e.g. "
                    "hf-causal-lm); default: on, every pattern entity, masked. Ignored by other tasks")
    # A site that joins with its own torchrun script (a Hugging Face Trainer with
    # site_trainer.hf_callback, or any session user) while the federation's workload is a task: the
    # script must build the task's model (the manifest is checked) and reads the same options.
    script: str | None = Field(None, description="this site's own torchrun script instead of the workload's task "
                                                 "or script (absolute, or relative to the config file)")
    script_args: list[str] = Field(default_factory=list, description="the site script's command-line arguments")
    privacy: PrivacyConfig = Field(
        default_factory=PrivacyConfig,
        description="record-level DP-SGD on this site (off by default): the site's own budget, never the "
                    "coordinator's (site_trainer/privacy)")
    policy: SitePolicy | None = Field(
        None, description="what this site takes part in, checked by the site on every message before any "
                          "training (site_trainer/policy_config.py); None: every round the coordinator asks")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig,
        description="this site's own experiment trackers: its loss per step, learning rate, samples/s, memory and "
                    "each round's reply figures (PII counts, epsilon), written by rank 0 and never sent anywhere")
    # Multi-node sites: one torchrun per node, joined by torchrun's c10d rendezvous.
    nnodes: int = Field(1, ge=1, le=64, description="nodes of this site; each runs `ranks` processes")
    rdzv_endpoint: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.\[\]:-]+:[0-9]{1,5}$",
        description="host:port of the rendezvous store on node 0; required when nnodes > 1")

    @field_validator("script")
    @classmethod
    def _script_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value and not Path(value).is_absolute():
            return str((Path((info.context or {}).get("config_dir") or Path.cwd()) / value).resolve())
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed_strategy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "strategy" in data:
            raise ValueError(f"strategy: {data['strategy']!r} on a site was renamed parallelism (ddp | zero2 | "
                             "zero3); write `parallelism: ...` (`strategy` is the federation's aggregation, "
                             "federation.strategy)")
        return data

    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> "SiteConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes is {self.nnodes}: set rdzv_endpoint to node 0's host:port for the rendezvous")
        if self.privacy.enabled and self.parallelism != "ddp":
            raise ValueError(f"site {self.id}: privacy.enabled with parallelism {self.parallelism!r}: per-record "
                             "gradient clipping is implemented for ddp only (ZeRO shards the gradients it would "
                             "clip); set parallelism: ddp, or privacy.enabled: false")
        if self.privacy.enabled and self.activation_checkpointing and self.privacy.per_sample != "loop":
            raise ValueError(f"site {self.id}: privacy.per_sample {self.privacy.per_sample!r} (torch.func.vmap) does "
                             "not run through activation checkpointing; set privacy.per_sample: loop, or "
                             "activation_checkpointing: false")
        if self.lr_schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) is above lr ({self.lr}); the cosine schedule decays lr to min_lr")
        return self

    @property
    def world_size(self) -> int:
        return self.ranks * self.nnodes


def check_privacy_workload(workload: WorkloadConfig, site: SiteConfig) -> None:
    """DP-SGD needs the framework's own loop: a script's training steps are its own (the workload's
    script, or a site's own `sites[].script` where the schema has it)."""
    own = getattr(site, "script", None)
    if site.privacy.enabled and (workload.script is not None or own is not None):
        where = "sites[].script" if own is not None else "workload.script"
        raise ValueError(f"site {site.id}: privacy.enabled with a script ({where}): DP-SGD runs in "
                         "the framework's loop for declarative tasks only (the session API cannot clip the "
                         "script's per-record gradients nor add the noise); use a declarative task "
                         "(workload.task) on this site, or set privacy.enabled: false")


class TrainerConfig(StrictModel):
    """Everything one site trainer service needs: written by the launcher, read by every rank."""

    site: SiteConfig
    workload: WorkloadConfig
    num_partitions: int = Field(ge=1, description="how many sites share the data (one partition each)")
    seed: int = 0
    rounds: int | None = Field(None, ge=1, description="the federation's number of rounds: the length of the "
                                                       "cosine schedule (rounds x local_steps optimizer steps)")
    socket: str = Field(description="Unix socket path rank 0 serves on")
    workdir: str

    @model_validator(mode="after")
    def _site_fits_workload(self) -> "TrainerConfig":
        if self.site.lr_schedule == "cosine" and self.rounds is None:
            raise ValueError(f"site {self.site.id}: lr_schedule 'cosine' needs the run's length: set the trainer "
                             "config's rounds (the launcher passes federation.rounds)")
        if self.site.privacy.enabled:
            check_privacy_workload(self.workload, self.site)
        check_site(self.workload, self.site)
        return self

    @property
    def script(self) -> tuple[str, list[str]] | None:
        """The script this site runs with its arguments (the site's own, else the workload's), or None."""
        if self.site.script is not None:
            return self.site.script, list(self.site.script_args)
        if self.workload.script is not None:
            return self.workload.script, list(self.workload.args)
        return None

    @property
    def options(self) -> dict[str, Any]:
        """This site's workload options: `workload.options` with `site.workload_options` merged over them."""
        return merge_options(self.workload.options, self.site.workload_options)
