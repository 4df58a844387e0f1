"""How close the site trainer's start-up step estimate is to the steps it then really takes.

`federation.round_target_s` plans round 1's local steps from each site's `step_s_estimate` (its
trainer times two forward and backward passes over one batch at start-up, the second counted,
x grad_accum: site_trainer/local_trainer.py `_time_step`), later rounds from the steps measured in
the round before. This starts the real trainer service (torchrun, `python -m site_trainer`, the
byte-level GPT task) once per parallelism, reads the estimate from its Info answer, as the
ClientApp does at discovery, and drives `--rounds` Train requests of `--local-steps` steps as the
relay does; the anchor is what the planner uses from round 2 on: the trainer's own `train_s` over
its steps (rounds 2 on, the first carrying warm-up).

    python benchmarks/step_estimate.py [--backend gloo|nccl] [--ranks 2] [--parallelism ddp,zero2,zero3]
                                       [--layers 4] [--embd 256] [--block 128] [--batch 16]
                                       [--local-steps 10] [--rounds 3]

One line per parallelism, then the last line:
RESULT estimate_s=<median over parallelisms> measured_s=<..> ratio=<estimate/measured, median>
(a ratio near 1: round 1 gets about the steps the target allows; below 1 it gets more).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trainer_bench import Service, trainer_config  # noqa: E402
from site_trainer.config import WorkloadConfig  # noqa: E402


def measure(tmp: Path, args: argparse.Namespace, parallelism: str) -> dict:
    wl = WorkloadConfig(task="slm", options={"n_layer": args.layers, "n_head": 4, "n_embd": args.embd,
                                             "block_size": args.block, "corpus_bytes_per_site": 400_000})
    cfg = trainer_config(tmp, parallelism, wl, args.ranks, args.local_steps, batch_size=args.batch,
                         backend=args.backend, parallelism=parallelism,
                         mixed_precision="bf16" if args.backend == "nccl" else "fp32")
    svc = Service(tmp / f"svc-{parallelism}", cfg, start_timeout_s=600)
    try:
        estimate = svc.info.get("step_s_estimate")
        if not estimate:
            raise SystemExit(f"{parallelism}: the trainer gave no step_s_estimate in its Info answer: {svc.info}")
        per_step = []
        for rnd in range(1, args.rounds + 1):
            _, m = svc.round(rnd)
            if rnd >= 2:
                per_step.append(m["train_s"] / m["steps"])
        return {"parallelism": parallelism, "device": svc.info["device"], "estimate_s": float(estimate),
                "measured_s": statistics.median(per_step)}
    finally:
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallelism", default="ddp,zero2,zero3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (round 1 carries warm-up)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-estimate-") as tmp:
        for p in args.parallelism.split(","):
            row = measure(Path(tmp), args, p)
            rows.append(row)
            print(f"{p} on {args.ranks} rank(s), {row['device']}: estimate {row['estimate_s']:.4f}s per step, "
                  f"measured {row['measured_s']:.4f}s (ratio {row['estimate_s'] / row['measured_s']:.2f})", flush=True)
    ratio = statistics.median(r["estimate_s"] / r["measured_s"] for r in rows)
    print(f"RESULT estimate_s={statistics.median(r['estimate_s'] for r in rows):.4f} "
          f"measured_s={statistics.median(r['measured_s'] for r in rows):.4f} ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
