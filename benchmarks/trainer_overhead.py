"""Site trainer service vs a plain torchrun DDP script: same model, data and steps, one run.

Ours is driven exactly as the Flower relay drives it (global model into shared memory, a Train
call over the Unix socket, the update read back; see _trainer_bench.py), so its samples/s include
every per-round cost. The hand-off time is measured on a ~10M-parameter model: relay wall time
minus training time.

Last line: RESULT throughput_ratio=<ours/plain> handoff_s=<seconds>   (target: ratio >= 0.97)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trainer_bench import Service, plain, trainer_config  # noqa: E402
from site_trainer import workloads  # noqa: E402
from site_trainer.config import WorkloadConfig  # noqa: E402


def ours(tmp: Path, cfg_path: Path, rounds: int) -> float:
    svc = Service(tmp, cfg_path)
    try:
        svc.round(0)  # warm-up, like the plain script's untimed start
        samples, seconds = 0, 0.0
        for r in range(1, rounds + 1):
            wall, m = svc.round(r)
            samples += m["samples_seen"]
            seconds += wall
        return samples / seconds
    finally:
        svc.close()


def handoff_seconds(tmp: Path, ranks: int) -> tuple[float, int]:
    wl = WorkloadConfig(task="slm", options={"n_layer": 3, "n_head": 8, "n_embd": 512, "block_size": 64,
                                             "corpus_bytes_per_site": 100_000})
    svc = Service(tmp, trainer_config(tmp, "big", wl, ranks, steps=1))
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
        wl = WorkloadConfig(task="slm", options={"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64,
                                                 "corpus_bytes_per_site": 200_000})
        cfg_path = trainer_config(tmp, "tp", wl, args.ranks, args.steps)
        n = args.rounds * args.steps
        print(f"model: {sum(v.size for v in workloads.initial_weights(wl, 0).values()):,} parameters, "
              f"{args.ranks} rank(s), {args.rounds} rounds x {args.steps} steps, batch 16/rank", flush=True)
        p_runs, o_runs = [], []
        for i in range(args.repeats):  # interleaved so that machine load hits both sides alike
            p_runs.append(plain(cfg_path, n)["samples_per_s"])
            o_runs.append(ours(tmp / f"o{i}", cfg_path, args.rounds))
            print(f"  repeat {i}: plain {p_runs[-1]:.0f} samples/s, ours {o_runs[-1]:.0f} samples/s", flush=True)
        p, o = max(p_runs), max(o_runs)
        print(f"plain torchrun DDP: {p:.0f} samples/s; site trainer service: {o:.0f} samples/s", flush=True)
        hs, params = handoff_seconds(tmp / "h", args.ranks)
        print(f"hand-off (relay <-> rank 0 <-> all ranks, both directions) for {params:,} parameters: {hs:.3f} s/round")
        print(f"RESULT throughput_ratio={o / p:.3f} handoff_s={hs:.3f}")


if __name__ == "__main__":
    main()
