"""Sharded local checkpoints of a site trainer (torch.distributed.checkpoint), for crash resume.

Layout under `<workdir>/checkpoints/`:
  round_000007-<t>/  DCP files: model and optimizer state, each rank writing only its own shards
                     (ZeRO) or one copy of replicated tensors (DDP);
                     rank_00000.pt ...  per-rank state DCP does not cover (the session's extras:
                     torch RNG, rounds reported, and the loop's own state such as batch-sampling
                     generators and the lr schedule's position); the codec's residuals are not
                     here: they live in the relay's site store (federation/site/site_store.py);
                     meta.json  round, parallelism, world size; written last.
  latest             name of the newest complete checkpoint (replaced atomically).

A crash while saving leaves `latest` on the previous checkpoint. Multi-node sites need `workdir`
on storage every node can read (each rank reads the shared metadata on resume).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from crypto.durable import write_atomic

log = logging.getLogger("sovfl.trainer")


def _root(workdir: str | Path) -> Path:
    return Path(workdir) / "checkpoints"


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save(workdir: str | Path, round_no: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         extras: dict, parallelism: str, keep: int) -> Path:
    """Collective: every rank writes its part; rank 0 publishes it as `latest` once all are done."""
    rank = dist.get_rank()
    root = _root(workdir)
    name: list = [None]
    if rank == 0:  # a fresh directory, never the one `latest` names (a round can be trained twice)
        name[0] = f"round_{round_no:06d}-{time.time_ns():x}"
        (root / name[0]).mkdir(parents=True)
    dist.broadcast_object_list(name, src=0)
    path = root / name[0]
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(path))
    torch.save({"round": round_no, "extras": extras}, _rank_file(path, rank))
    dist.barrier()
    if rank == 0:
        meta = {"round": round_no, "parallelism": parallelism, "world_size": dist.get_world_size()}
        (path / "meta.json").write_text(json.dumps(meta))
        write_atomic(root / "latest", path.name)
        done = sorted(p for p in root.glob("round_*") if p.is_dir() and p != path)
        for old in done[: max(0, len(done) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def find_latest(workdir: str | Path) -> Path | None:
    """Rank 0's view of the newest complete checkpoint, shared with every rank (collective)."""
    found: list = [None]
    if dist.get_rank() == 0:
        root = _root(workdir)
        try:
            path = root / (root / "latest").read_text().strip()
            found[0] = str(path) if (path / "meta.json").exists() else None
        except OSError:
            pass
    dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def find_before(workdir: str | Path, round_no: int) -> Path | None:
    """Collective: the newest complete checkpoint of a round before `round_no` (the state a round
    trained again starts from), shared with every rank; None when there is none."""
    found: list = [None]
    if dist.get_rank() == 0:
        best: tuple[int, str] | None = None
        for path in _root(workdir).glob("round_*"):
            try:
                rnd = int(json.loads((path / "meta.json").read_text())["round"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # incomplete (no meta.json yet) or damaged
            if rnd < round_no and (best is None or (rnd, path.name) > best):
                best = (rnd, path.name)
        found[0] = str(_root(workdir) / best[1]) if best else None
    dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, parallelism: str
         ) -> tuple[int, dict] | None:
    """Collective: restore model and optimizer in place (resharded if the layout changed); return
    (round, this rank's extras), or None when the world size changed (RNG streams cannot be matched)."""
    meta = json.loads((path / "meta.json").read_text())
    state = _state_dicts(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if meta["world_size"] != dist.get_world_size():
        log.warning("checkpoint %s was written by %d rank(s), this site has %d: model and optimizer restored, "
                    "data-sampling streams start afresh", path, meta["world_size"], dist.get_world_size())
        return None
    if meta["parallelism"] != parallelism:
        log.info("checkpoint %s was written under %s, resharded for %s", path, meta["parallelism"], parallelism)
    raw = torch.load(_rank_file(path, dist.get_rank()), weights_only=True)
    return int(raw["round"]), raw["extras"]
