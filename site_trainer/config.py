"""Site-side configuration: the workload every site trains and one site's trainer pool.

Pydantic only (no torch): the federation's schema and the torch-free Flower relay import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """Unknown fields are errors (typos must not be silently ignored); values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkloadConfig(StrictModel):
    """The model and data every site trains; sites differ only in their partition."""

    name: Literal["digits", "slm"] = "digits"
    hidden: int = Field(64, ge=1, description="digits: hidden width")
    # slm (byte-level GPT)
    n_layer: int = Field(2, ge=1)
    n_head: int = Field(2, ge=1)
    n_embd: int = Field(64, ge=8)
    block_size: int = Field(64, ge=8)
    corpus_bytes_per_site: int = Field(400_000, ge=10_000)
    val_fraction: float = Field(0.2, gt=0, lt=1)
    partition: Literal["iid", "dirichlet", "module"] = "iid"
    dirichlet_alpha: float = Field(0.5, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> "WorkloadConfig":
        if self.name == "slm" and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return self


class SiteConfig(StrictModel):
    """One sovereign site: a local trainer pool of `ranks` processes per node joined as one client."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    ranks: int = Field(1, ge=1, le=64, description="trainer processes per node (one per GPU)")
    backend: Literal["gloo", "nccl"] = "gloo"
    partition: int = Field(ge=0, description="index of this site's data partition")
    local_steps: int = Field(10, ge=1)
    batch_size: int = Field(32, ge=1, description="per rank, per micro-batch")
    lr: float = Field(0.05, gt=0)
    grad_accum: int = Field(1, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    dump_updates: bool = Field(False, description="keep each returned update on disk (tests, audits)")
    # How the site's ranks share the work (see site_trainer/README.md).
    strategy: Literal["ddp", "zero2", "zero3"] = Field(
        "ddp", description="ddp: replicate everything; zero2: shard gradients and optimizer state (FSDP2, "
                           "parameters kept after forward); zero3: shard parameters too")
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: bf16 compute and gradient reduction, fp32 master weights and optimizer state")
    activation_checkpointing: bool = Field(False, description="recompute each transformer block in backward")
    checkpoint_every: int = Field(0, ge=0, description="sharded local checkpoint every N trained rounds; 0 = off")
    checkpoint_keep: int = Field(2, ge=1, description="local checkpoints kept on disk")
    # Multi-node sites: one torchrun per node, joined by torchrun's c10d rendezvous.
    nnodes: int = Field(1, ge=1, le=64, description="nodes of this site; each runs `ranks` processes")
    rdzv_endpoint: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.\[\]:-]+:[0-9]{1,5}$",
        description="host:port of the rendezvous store on node 0; required when nnodes > 1")

    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> "SiteConfig":
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"nnodes is {self.nnodes}: set rdzv_endpoint to node 0's host:port for the rendezvous")
        return self

    @property
    def world_size(self) -> int:
        return self.ranks * self.nnodes


class TrainerConfig(StrictModel):
    """Everything one site trainer service needs: written by the launcher, read by every rank."""

    site: SiteConfig
    workload: WorkloadConfig
    num_partitions: int = Field(ge=1, description="how many sites share the data (one partition each)")
    seed: int = 0
    socket: str = Field(description="Unix socket path rank 0 serves on")
    workdir: str
