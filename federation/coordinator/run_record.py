"""What a run directory keeps of its workload, so that its checkpoints can be turned into a model later.

The ServerApp writes `workload.json` beside the checkpoints when the run starts: the workload
section of the configuration, the federation's seed (LoRA adapters and other seed-dependent
weights are initialised from it) and the working directory relative paths in the options were
read from. `sovfl export` (federation/ops/export_cmd.py) rebuilds the model from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from crypto.durable import write_atomic
from federation.config.schema import ExperimentConfig
from site_trainer.config import WorkloadConfig

RECORD = "workload.json"


@dataclass(frozen=True)
class WorkloadRecord:
    """The workload of a finished (or running) run, its seed and where its relative paths start."""

    workload: WorkloadConfig
    seed: int
    cwd: Path


def record_workload(workdir: Path, cfg: ExperimentConfig) -> Path:
    """Write the run's workload record (atomically)."""
    return write_atomic(Path(workdir) / RECORD, json.dumps({
        "workload": cfg.workload.model_dump(mode="json"), "seed": cfg.federation.seed, "cwd": os.getcwd()}, indent=1))


def read_workload(run_dir: Path) -> WorkloadRecord:
    """The record of `run_dir`; FileNotFoundError / ValueError say what is missing or wrong."""
    path = Path(run_dir) / RECORD
    raw = json.loads(path.read_text())  # FileNotFoundError, json.JSONDecodeError (a ValueError)
    if not isinstance(raw, dict) or not isinstance(raw.get("workload"), dict):
        raise ValueError(f"{path}: no workload section")
    return WorkloadRecord(WorkloadConfig.model_validate(raw["workload"]), int(raw.get("seed", 0)),
                          Path(raw.get("cwd") or "."))
