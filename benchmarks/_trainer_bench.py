"""Shared by the trainer benchmarks: a site's trainer config, the plain torchrun anchor, and a driver
that talks to a real trainer service exactly as the Flower relay does.

The relay's part of a round, which `Service.round` times: write the global model into a shared-
memory hand-off file, send Train over the Unix socket, read every byte of the update the trainer
wrote back. The coordinator's part (adding the delta to its model) is left out of the timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from federation.ops.launcher import Supervisor, wait_trainers  # noqa: E402
from site_trainer import endpoint, handoff, workloads  # noqa: E402
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig  # noqa: E402

PLAIN = ROOT / "benchmarks" / "_plain_torchrun.py"


def trainer_config(tmp: Path, name: str, workload: WorkloadConfig, ranks: int, steps: int, **site) -> Path:
    """Write a TrainerConfig JSON (AdamW, batch 16 per rank unless `site` says otherwise); return its path."""
    tmp.mkdir(parents=True, exist_ok=True)
    fields = {"id": name, "ranks": ranks, "partition": 0, "local_steps": steps, "batch_size": 16, "lr": 1e-3,
              "optimizer": "adamw", **site}
    cfg = TrainerConfig(site=SiteConfig(**fields), workload=workload, num_partitions=1, seed=0,
                        socket=str(tmp / f"{name}.sock"), workdir=str(tmp / name))
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


def _child_env() -> dict[str, str]:
    """This checkout's packages first, whatever is installed; one intra-op thread per rank."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def plain(cfg_path: Path, steps: int, warmup: int = 0, timeout_s: float = 900) -> dict:
    """Run the plain torchrun loop on the config's model, data, batch and optimizer; its JSON result."""
    ranks = TrainerConfig.model_validate_json(cfg_path.read_text()).site.ranks
    out = subprocess.run([*torchrun(ranks), str(PLAIN), str(cfg_path), str(steps), str(warmup)],
                         capture_output=True, text=True, cwd=ROOT, timeout=timeout_s, env={**os.environ, **_child_env()})
    if out.returncode != 0:
        raise SystemExit(f"plain torchrun loop failed (exit {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Service:
    """A real trainer service (torchrun, K ranks, `python -m site_trainer`) plus a relay-side driver."""

    def __init__(self, tmp: Path, cfg_path: Path, start_timeout_s: float = 300):
        self.cfg = TrainerConfig.model_validate_json(cfg_path.read_text())
        self.sup = Supervisor(tmp)
        try:
            proc = self.sup.start(f"trainer-{self.cfg.site.id}",
                                  [*torchrun(self.cfg.site.ranks), "-m", "site_trainer", "--config", str(cfg_path)],
                                  _child_env())
            wait_trainers({self.cfg.site.id: proc}, {self.cfg.site.id: self.cfg.socket}, start_timeout_s, lambda s: None)
            self.info = endpoint.call(self.cfg.socket, "Info", {}, timeout_s=30)
        except BaseException:
            self.sup.close()
            raise
        self.log = proc.log
        self.model = workloads.initial_weights(self.cfg.workload, 0)

    def round(self, rnd: int, timeout_s: float = 600) -> tuple[float, dict]:
        """One Train request as the relay sends it; (relay seconds, the trainer's metrics plus
        `update_bytes`, the bytes of the update handed off). The
        relay's own parts are left in `self.phases`: write_s (global model into shared memory),
        call_s (the Train call, the trainer's whole part) and read_s (every byte of the update)."""
        t0 = time.perf_counter()
        h = handoff.write_arrays(self.model, "bench-global")
        t1 = time.perf_counter()
        try:
            reply = endpoint.call(self.cfg.socket, "Train", {"round": rnd, "global": h.to_json(),
                                  "config": {"update_kind": "delta"}, "timeout_s": timeout_s}, timeout_s=timeout_s)
        finally:
            handoff.release(h.path)
        t2 = time.perf_counter()
        upd = handoff.Handle.from_json(reply["update"])
        delta = {k: np.array(v) for k, v in handoff.map_arrays(upd).items()}  # the relay reads every byte
        handoff.release(upd.path)
        seconds = time.perf_counter() - t0
        self.phases = {"write_s": t1 - t0, "call_s": t2 - t1, "read_s": seconds - (t2 - t0)}
        for k, d in delta.items():  # the coordinator's part, not timed
            self.model[k] += d
        return seconds, {**reply["metrics"], "update_bytes": sum(e.nbytes for e in upd.entries)}

    def close(self) -> None:
        self.sup.close()
