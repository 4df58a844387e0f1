"""What a run's trackers wrote, read back with each library's own reader (tests of tracking/)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, through TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_run(db: Path) -> tuple[dict[str, dict[int, float]], dict[str, str], dict[str, str]]:
    """The one run in the SQLite store `db`: (metric -> step -> value, params, tags), through MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    metrics = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}
    return metrics, dict(run.data.params), dict(run.data.tags)


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb transaction log (LevelDB's log format behind W&B's 7-byte header:
    32 KiB blocks of records, each a CRC, a length, a type: full, first, middle or last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, part, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        part += chunk
        if kind in (1, 4):  # full, last
            out.append(part)
            part = b""
    return out


def wandb_run(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """An offline run directory: (history rows, config, summary), parsed with W&B's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("run-*.wandb")
    rows, config, summary = [], {}, {}
    for raw in _wandb_records(log):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.summary.update})
    return rows, config, summary
