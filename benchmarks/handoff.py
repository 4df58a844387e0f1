"""The hand-off between the Flower relay and a site's ranks, for full fine-tuning of a >=100M model.

Every round the relay writes the global model into a shared-memory file, rank 0 reads it and every
rank loads it (a broadcast, or shards under ZeRO), the ranks train, and rank 0 streams the update
back into a file the relay reads. Everything but the training is overhead that grows with the model
and not with the steps: this script measures it on the path users run (the trainer service under
torchrun, driven as the relay drives it, `_trainer_bench.Service`), on a byte-level GPT of about
107M parameters (15 blocks, width 768), every parameter trained and exchanged (full fine-tuning),
fused AdamW, update_kind delta, one optimizer step of one sequence per rank per round.

Per round: hand-off = relay wall time - the trainer's train_s (write of the global model, the call
with load and update gathering, and the relay's read of the update). Printed with its parts (the
trainer's load_s and pack_s, the relay's write_s and read_s), and in units of one training step of
this benchmark's setup at batch 16 (measured on the same service), so that its weight in a round of
N steps reads directly: hand-off / (hand-off + N steps). The figures are the best of the timed
rounds (on a shared machine the other rounds measure the neighbours); the median is printed too.

    python benchmarks/handoff.py [--ranks 2] [--parallelism ddp] [--rounds 5] [--layers 15] [--embd 768]

Last line: RESULT handoff_s=<best s/round> params=<P> load_s=<..> pack_s=<..> handoff_in_steps=<..>
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


def measure(tmp: Path, args: argparse.Namespace, batch: int, steps: int) -> tuple[list[dict], int]:
    wl = WorkloadConfig(task="slm", options={"n_layer": args.layers, "n_head": 12, "n_embd": args.embd,
                                             "block_size": 64, "corpus_bytes_per_site": 100_000})
    cfg = trainer_config(tmp, f"h{batch}", wl, args.ranks, steps, batch_size=batch, parallelism=args.parallelism)
    svc = Service(tmp / f"svc{batch}", cfg, start_timeout_s=900)
    try:
        params = sum(v.size for v in svc.model.values())
        rows = []
        for r in range(args.rounds + 1):  # round 0 warms up (first touch of every page, kernels)
            wall, m = svc.round(r)
            if r:
                rows.append({"handoff_s": wall - m["train_s"], "train_s": m["train_s"], "load_s": m["load_s"],
                             "pack_s": m["pack_s"], **svc.phases})
        return rows, params
    finally:
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallelism", default="ddp", choices=["ddp", "zero2", "zero3"])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    ap.add_argument("--no-step-time", action="store_true", help="skip timing a training step (repeat runs)")
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--embd", type=int, default=768)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sovfl-handoff-") as d:
        rows, params = measure(Path(d), args, batch=1, steps=1)
        best = min(rows, key=lambda r: r["handoff_s"])
        med = statistics.median(r["handoff_s"] for r in rows)
        print(f"model: {params:,} parameters ({4 * params / 2**20:.0f} MiB fp32), all exchanged; {args.ranks} rank(s), "
              f"{args.parallelism}", flush=True)
        for i, r in enumerate(rows, 1):
            print(f"  round {i}: hand-off {r['handoff_s']:.3f} s = relay write {r['write_s']:.3f} + trainer load "
                  f"{r['load_s']:.3f} + pack {r['pack_s']:.3f} + relay read {r['read_s']:.3f} + rest "
                  f"{r['handoff_s'] - r['write_s'] - r['load_s'] - r['pack_s'] - r['read_s']:.3f}", flush=True)
        print(f"hand-off per round: best {best['handoff_s']:.3f} s, median {med:.3f} s")
        steps = ""
        if not args.no_step_time:
            step_rows, _ = measure(Path(d), argparse.Namespace(**{**vars(args), "rounds": 1}), batch=16, steps=1)
            step_s = step_rows[0]["train_s"]
            print(f"one training step (batch 16 per rank) takes {step_s:.3f} s here: the hand-off costs "
                  f"{best['handoff_s'] / step_s:.2f} steps; in a 60-step round it is "
                  f"{100 * best['handoff_s'] / (best['handoff_s'] + 60 * step_s):.1f}% of the round")
            steps = f" handoff_in_steps={best['handoff_s'] / step_s:.2f}"
        print(f"RESULT handoff_s={best['handoff_s']:.3f} params={params} load_s={best['load_s']:.3f} "
              f"pack_s={best['pack_s']:.3f}{steps}")

if __name__ == "__main__":
    main()
