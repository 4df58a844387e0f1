"""`sovfl export RUN_DIR --out DIR [--merge]`: a run's global model as files other tools load.

The coordinator's checkpoints hold only what travels (for LoRA: the adapters). Export rebuilds the
model as the coordinator did (the run's `workload.json`, or `--config`; torch seeded with the
federation's seed, so the pretrained base comes from the task's model directory), loads the
checkpoint's tensors into it, and lets the task write its artefact (`Task.export`): for
`hf-causal-lm` a `save_pretrained` directory (the adapter; with `--merge` the merged full model)
that `AutoModelForCausalLM.from_pretrained` loads; for other tasks and script workloads
`model.safetensors` with the state dict.

A run with an audit log (`federation.audit`) records each export in it when given the
coordinator's bundle (`--bundle`): the round, the checkpoint's digest and each file written with
its sha256, signed with the coordinator's key like every other entry. Without `--bundle` the
export is made and the missing record is said on stderr: anyone who can read the checkpoint can
copy it, so the log records the exports its operator makes, not every copy.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

from crypto.audit import LOG_NAME, AuditLog, AuditLogError, Head, log_path
from crypto.pki import CoordinatorBundle
from federation.config.schema import ConfigError, load_config
from federation.coordinator.checkpoint import CheckpointError, CheckpointStore, load_checkpoint
from federation.coordinator.run_record import RECORD, WorkloadRecord, read_workload


class ExportError(RuntimeError):
    """The run cannot be exported; the message names the file and the fix."""


def find_checkpoint(run_dir: Path, rnd: int | None) -> Path:
    """The checkpoint of round `rnd` in `run_dir`; None: the checkpoints folder (its newest good
    checkpoint is read, a damaged newest one passed over with a message)."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory; give the --workdir of a `sovfl simulate` or "
                          "`sovfl coordinator` run")
    store = CheckpointStore(run_dir / "checkpoints")
    have = store.rounds()
    if not have:
        raise ExportError(f"{run_dir}: no checkpoint ({store.directory}/round_*): the run completed no round yet; "
                          "see its metrics.jsonl and progress.log")
    if rnd is None:
        return store.directory
    if rnd not in have:
        raise ExportError(f"{store.path(rnd)}: no such checkpoint; this run has rounds "
                          f"{', '.join(str(r) for r in sorted(have)[-5:])}")
    return store.path(rnd)


def run_workload(run_dir: Path, config: str | None) -> WorkloadRecord:
    """The run's workload: from `--config` when given, else from the run's own record."""
    if config is not None:
        cfg = load_config(config)
        return WorkloadRecord(cfg.workload, cfg.federation.seed, Path.cwd())
    try:
        return read_workload(run_dir)
    except FileNotFoundError:
        raise ExportError(f"{run_dir}: no {RECORD} (the coordinator writes it when a run starts); pass the run's "
                          "configuration file with --config FILE") from None
    except ValueError as err:
        raise ExportError(f"{run_dir / RECORD}: unusable ({err}); pass the run's configuration with --config FILE") \
            from None


def load_global(model, weights: dict[str, np.ndarray], exchanged: list[str]) -> None:
    """Write the checkpoint's tensors into `model` (bf16 tensors from float32 or raw words)."""
    import torch

    from site_trainer import layout

    tensors = layout.named_tensors(model)
    names = layout.Layout.of(model, exchanged).names
    missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
    if missing or extra:
        raise ExportError(f"the checkpoint does not belong to this workload: missing {missing[:3]}, unexpected "
                          f"{extra[:3]}; export with the run's own configuration")
    with torch.no_grad():
        for name in names:
            t, arr = tensors[name], weights[name]
            if tuple(arr.shape) != tuple(t.shape):
                raise ExportError(f"checkpoint tensor {name} has shape {tuple(arr.shape)}, the model {tuple(t.shape)}; "
                                  "export with the run's own configuration")
            t.copy_(layout.from_wire(np.array(arr, order="C"), t.dtype))  # (ascontiguousarray makes 0-dim 1-dim)


def export_log(run_dir: Path, bundle_dir: str | Path) -> AuditLog:
    """The run's audit log, continued with the coordinator's key from `bundle_dir`; checked before
    anything is written, so a wrong bundle fails the export instead of leaving it unrecorded."""
    path = log_path(run_dir / LOG_NAME)
    if not path.is_file():
        raise ExportError(f"{run_dir}: no audit log ({LOG_NAME}; the run had federation.audit off): export "
                          "without --bundle")
    try:
        bundle = CoordinatorBundle.load(bundle_dir)
        return AuditLog(path, bundle.sign_key, bundle.name, "coordinator")
    except (OSError, ValueError, KeyError, AuditLogError) as err:
        raise ExportError(f"--bundle {bundle_dir}: cannot continue {path} with it ({err}); give the "
                          "coordinator's provisioned bundle of this run") from None


def record_export(audit: AuditLog, done: int, checkpoint_digest: str | None, files: list[Path],
                  merge: bool) -> Head:
    """Append the `exported` entry: which round, the checkpoint's digest, each file and its digest."""
    from site_trainer.text_data import file_digest  # streamed: a merged model is gigabytes

    return audit.append("exported", round=done, checkpoint_digest=checkpoint_digest, merge=merge,
                        files={str(f): "sha256:" + file_digest(Path(f)) for f in files if Path(f).is_file()})


def export_run(run_dir: Path, out: Path, merge: bool = False, rnd: int | None = None,
               config: str | None = None, bundle: str | Path | None = None) -> tuple[int, list[Path]]:
    """Export `run_dir`'s checkpoint of round `rnd` (latest) into `out`; returns (round, files
    written). With `bundle` (the coordinator's) the export is recorded in the run's audit log."""
    import torch

    from site_trainer import workload_loader
    from site_trainer.workload import TaskContext, save_state_dict

    path = find_checkpoint(run_dir, rnd)
    record = run_workload(run_dir, config)
    audit = export_log(run_dir, bundle) if bundle else None
    try:
        done, weights, _ = load_checkpoint(path)
    except CheckpointError as err:
        raise ExportError(f"{path}: {err}") from None
    out = Path(out).absolute()
    # relative paths in the options (a model directory) are where the coordinator ran
    where = contextlib.chdir(record.cwd) if record.cwd.is_dir() else contextlib.nullcontext()
    with where:
        torch.manual_seed(record.seed)
        wl = record.workload
        if wl.task is None:
            model = workload_loader.model_factory(wl.model or "")(dict(wl.options))
            exchanged = [n for n, p in model.named_parameters() if p.requires_grad]
            load_global(model, weights, exchanged)
            files = [save_state_dict(model, out)]
        else:
            task = workload_loader.build_task(wl, TaskContext(role="export", seed=record.seed))
            model = task.build_model()
            load_global(model, weights, list(task.exchanged(model)))
            files = task.export(model, out, merge=merge)
    if audit is not None:
        from federation.coordinator.audit_hook import arrays_digest

        record_export(audit, done, arrays_digest(weights), files, merge)
    return done, files


def cmd_export(args: argparse.Namespace) -> int:
    """`sovfl export`: write the run's global model; the files written, one a line."""
    try:
        done, files = export_run(Path(args.run_dir), Path(args.out), args.merge, args.round, args.config,
                                 args.bundle)
    except (ExportError, FileExistsError, AuditLogError) as err:
        print(f"sovfl export: {err}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError) as err:  # the workload no longer builds (a moved model directory, ...)
        print(f"sovfl export: {args.run_dir}: cannot rebuild the run's model: {err}", file=sys.stderr)
        return 1
    print(f"exported the global model of round {done} from {args.run_dir} to {args.out} ({len(files)} file(s)):")
    for f in files:
        print(f"  {f}")
    if args.bundle:
        print(f"recorded in {log_path(Path(args.run_dir) / LOG_NAME)}")
    elif log_path(Path(args.run_dir) / LOG_NAME).is_file():
        print(f"sovfl export: not recorded in the run's audit log ({LOG_NAME}): pass --bundle with the "
              "coordinator's bundle to record exports", file=sys.stderr)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `sovfl export` on the CLI's subparsers."""
    p = sub.add_parser("export", help="write a run's global model as files Hugging Face or safetensors load")
    p.add_argument("run_dir", help="the run's directory (its --workdir): checkpoints/ and workload.json")
    p.add_argument("--out", required=True, help="a new or empty directory to write into")
    p.add_argument("--merge", action="store_true", help="LoRA: write the merged full model (the adapter goes to "
                                                        "OUT/adapter)")
    p.add_argument("--round", type=int, help="export this round's checkpoint (default: the latest)")
    p.add_argument("--config", help="the run's configuration file, for a run directory without workload.json")
    p.add_argument("--bundle", help="the coordinator's provisioned bundle: record the export in the run's audit log")
    p.set_defaults(fn=cmd_export)
    return p
