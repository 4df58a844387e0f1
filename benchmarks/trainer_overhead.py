"""Site trainer service vs a plain torchrun DDP script: same model, data and steps, one run.

Ours is driven exactly as the Flower relay drives it (global model into shared memory, a Train
call over the Unix socket, the update read back), so its samples/s include every per-round cost.
The hand-off time is measured on a ~10M-parameter model: relay wall time minus training time.

Last line: RESULT throughput_ratio=<ours/plain> handoff_s=<seconds>   (target: ratio >= 0.97)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from federation.launcher import Supervisor, wait_trainers  # noqa: E402
from site_trainer import endpoint, handoff, workloads  # noqa: E402
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig  # noqa: E402


def trainer_config(tmp: Path, name: str, workload: WorkloadConfig, ranks: int, steps: int, **site) -> Path:
    """A trainer's config file; `site` overrides SiteConfig fields (backend, strategy, batch_size, ...)."""
    tmp.mkdir(parents=True, exist_ok=True)
    site = {"batch_size": 16, "lr": 1e-3, "optimizer": "adamw", **site}
    cfg = TrainerConfig(
        site=SiteConfig(id=name, ranks=ranks, partition=0, local_steps=steps, **site),
        workload=workload, num_partitions=1, seed=0, socket=str(tmp / f"{name}.sock"), workdir=str(tmp / name))
    path = tmp / f"{name}.json"
    path.write_text(cfg.model_dump_json())
    return path


def plain_run(cfg_path: Path, ranks: int, steps: int, warmup: int = 0) -> dict:
    """The anchor's figures (samples, seconds, samples_per_s, peak_cuda_bytes) from one torchrun:
    `steps` timed steps after `warmup` untimed ones."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                          str(ROOT / "benchmarks" / "_plain_ddp.py"), str(cfg_path), str(steps), str(warmup)],
                         capture_output=True, text=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1", **_env()})
    if out.returncode != 0:
        raise SystemExit(f"plain torchrun failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plain(cfg_path: Path, ranks: int, steps: int) -> float:
    return plain_run(cfg_path, ranks, steps)["samples_per_s"]


def _env() -> dict:
    import os
    return dict(os.environ)


class Service:
    """A real trainer service (torchrun, K ranks) plus a relay-side driver."""

    def __init__(self, tmp: Path, cfg_path: Path, ranks: int):
        self.cfg = TrainerConfig.model_validate_json(cfg_path.read_text())
        self.sup = Supervisor(tmp)
        proc = self.sup.start(f"trainer-{self.cfg.site.id}", [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "site_trainer", "--config", str(cfg_path)], {"OMP_NUM_THREADS": "1"})
        wait_trainers({self.cfg.site.id: proc}, {self.cfg.site.id: self.cfg.socket}, 300, lambda s: None)
        self.model = workloads.initial_weights(self.cfg.workload, 0)

    def round(self, rnd: int) -> tuple[float, dict]:
        t0 = time.perf_counter()
        h = handoff.write_arrays(self.model, "bench-global")
        try:
            reply = endpoint.call(self.cfg.socket, "Train", {"round": rnd, "global": h.to_json(),
                                  "config": {"update_kind": "delta"}, "timeout_s": 600}, timeout_s=600)
        finally:
            handoff.release(h.path)
        upd = handoff.Handle.from_json(reply["update"])
        delta = handoff.map_arrays(upd)
        handoff.release(upd.path)
        self.model = {k: v + delta[k] for k, v in self.model.items()}
        return time.perf_counter() - t0, reply["metrics"]

    def close(self) -> None:
        self.sup.close()


def ours_run(tmp: Path, cfg_path: Path, ranks: int, rounds: int, steps: int) -> dict:
    """Our service's figures: samples/s over whole rounds (hand-off included) and over training only."""
    svc = Service(tmp, cfg_path, ranks)
    try:
        svc.round(0)  # warm-up, like the plain script's untimed start
        t0 = time.perf_counter()
        samples, train_s = 0, 0.0
        for r in range(1, rounds + 1):
            _, m = svc.round(r)
            samples += m["samples_seen"]
            train_s += m["train_s"]
        wall = time.perf_counter() - t0
        return {"samples": samples, "samples_per_s": samples / wall, "train_samples_per_s": samples / train_s,
                "metrics": m}
    finally:
        svc.close()


def ours(tmp: Path, cfg_path: Path, ranks: int, rounds: int, steps: int) -> float:
    return ours_run(tmp, cfg_path, ranks, rounds, steps)["samples_per_s"]


def handoff_seconds(tmp: Path, ranks: int) -> tuple[float, int]:
    wl = WorkloadConfig(name="slm", n_layer=3, n_head=8, n_embd=512, block_size=64, corpus_bytes_per_site=100_000)
    cfg_path = trainer_config(tmp, "big", wl, ranks, steps=1)
    svc = Service(tmp, cfg_path, ranks)
    try:
        params = sum(v.size for v in svc.model.values())
        times = []
        for r in range(4):
            wall, m = svc.round(r)
            times.append(wall - m["train_s"])
        return statistics.median(times[1:]), params
    finally:
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="local steps per round")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each side (shared machines are noisy)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sovfl-bench-") as d:
        tmp = Path(d)
        wl = WorkloadConfig(name="slm", n_layer=2, n_head=4, n_embd=128, block_size=64, corpus_bytes_per_site=200_000)
        cfg_path = trainer_config(tmp, "tp", wl, args.ranks, args.steps)
        n = args.rounds * args.steps
        print(f"model: {sum(v.size for v in workloads.initial_weights(wl, 0).values()):,} parameters, "
              f"{args.ranks} rank(s), {args.rounds} rounds x {args.steps} steps, batch 16/rank", flush=True)
        p_runs, o_runs = [], []
        for i in range(args.repeats):  # interleaved so that machine load hits both sides alike
            p_runs.append(plain(cfg_path, args.ranks, n))
            o_runs.append(ours(tmp / f"o{i}", cfg_path, args.ranks, args.rounds, args.steps))
            print(f"  repeat {i}: plain {p_runs[-1]:.0f} samples/s, ours {o_runs[-1]:.0f} samples/s", flush=True)
        p, o = max(p_runs), max(o_runs)
        print(f"plain torchrun DDP: {p:.0f} samples/s; site trainer service: {o:.0f} samples/s", flush=True)
        hs, params = handoff_seconds(tmp / "h", args.ranks)
        print(f"hand-off (relay <-> rank 0 <-> all ranks, both directions) for {params:,} parameters: {hs:.3f} s/round")
        print(f"RESULT throughput_ratio={o / p:.3f} handoff_s={hs:.3f}")


if __name__ == "__main__":
    main()
