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
    """One sovereign site: a local trainer pool of `ranks` processes joined as one client."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    ranks: int = Field(1, ge=1, le=64)
    backend: Literal["gloo", "nccl"] = "gloo"
    partition: int = Field(ge=0, description="index of this site's data partition")
    local_steps: int = Field(10, ge=1)
    batch_size: int = Field(32, ge=1, description="per rank, per micro-batch")
    lr: float = Field(0.05, gt=0)
    grad_accum: int = Field(1, ge=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    dump_updates: bool = Field(False, description="keep each returned update on disk (tests, audits)")


class TrainerConfig(StrictModel):
    """Everything one site trainer service needs: written by the launcher, read by every rank."""

    site: SiteConfig
    workload: WorkloadConfig
    num_partitions: int = Field(ge=1, description="how many sites share the data (one partition each)")
    seed: int = 0
    socket: str = Field(description="Unix socket path rank 0 serves on")
    workdir: str
