"""Tokens/s per GPU: the site trainer service against a plain torchrun script, same steps.

The small GPT workload scaled to about 125M parameters (byte vocabulary, 18 layers x 768), NCCL
and bf16 autocast with fp32 master weights. The anchor is a plain torchrun DDP loop
(benchmarks/_plain_ddp.py); ours is the trainer service driven exactly as the Flower relay drives
it (global model into shared memory, Train over the Unix socket, update back), for strategies
ddp, zero2 and zero3. Ours is reported twice: over whole rounds (hand-off of the 0.5 GB model in
and out included) and over its training time only.

    python benchmarks/gpu_throughput.py              # on a GPU machine: all visible GPUs
    python benchmarks/gpu_throughput.py --smoke      # CPU, gloo, a tiny model: checks the script

Last line: RESULT tokens_per_s_ours=<ddp, whole rounds> tokens_per_s_plain=<..> ratio=<ours/plain>
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_overhead import ours_run, plain_run, trainer_config, workloads  # noqa: E402

from site_trainer.config import WorkloadConfig  # noqa: E402

GPT_125M = WorkloadConfig(name="slm", n_layer=18, n_head=12, n_embd=768, block_size=256,
                          corpus_bytes_per_site=4_000_000)
TINY = WorkloadConfig(name="slm", n_layer=2, n_head=2, n_embd=32, block_size=32, corpus_bytes_per_site=100_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model: a check of the script itself")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU)")
    ap.add_argument("--steps", type=int, default=150, help="local steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up round)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--strategies", default="ddp,zero2,zero3")
    args = ap.parse_args()

    if args.smoke:
        wl, site, nproc = TINY, {"backend": "gloo"}, args.nproc or 2
        print("SMOKE: CPU and gloo, tiny model; figures say nothing about GPUs")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke on a CPU machine")
        nproc = args.nproc or torch.cuda.device_count()
        wl, site = GPT_125M, {"backend": "nccl", "mixed_precision": "bf16"}
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{nproc} x {torch.cuda.get_device_name(0)}")
    params = sum(v.size for v in workloads.initial_weights(wl, 0).values())
    tokens_per_step = args.batch * wl.block_size
    print(f"model: {params / 1e6:.1f}M parameters, {nproc} rank(s) (world size {nproc}"
          f"{': ddp, zero2 and zero3 shard over one rank, so they differ only in wrapping' if nproc == 1 else ''}), "
          f"{args.rounds} rounds x {args.steps} steps, {tokens_per_step} tokens/step/rank", flush=True)

    with tempfile.TemporaryDirectory(prefix="sovfl-gpu-") as d:
        tmp = Path(d)
        anchor_cfg = trainer_config(tmp, "plain", wl, nproc, args.steps, batch_size=args.batch, **site)
        # the same untimed warm-up as ours (one round's steps), then the same timed steps
        anchor = plain_run(anchor_cfg, nproc, args.rounds * args.steps, warmup=args.steps)
        plain_tps = anchor["samples_per_s"] * wl.block_size / nproc
        print(f"plain torchrun DDP:            {plain_tps:10,.0f} tokens/s/GPU   peak {anchor['peak_cuda_bytes'] / 2**30:.2f} GiB",
              flush=True)
        results = {}
        for strategy in args.strategies.split(","):
            cfg = trainer_config(tmp, strategy, wl, nproc, args.steps, batch_size=args.batch, strategy=strategy, **site)
            r = ours_run(tmp / f"o-{strategy}", cfg, nproc, args.rounds, args.steps)
            results[strategy] = r
            whole, train = (r[k] * wl.block_size / nproc for k in ("samples_per_s", "train_samples_per_s"))
            print(f"ours {strategy:5s} whole rounds:       {whole:10,.0f} tokens/s/GPU   (training only {train:,.0f}; "
                  f"loss {r['metrics']['loss']:.3f})", flush=True)
        base = results.get("ddp") or next(iter(results.values()))
        ours_tps = base["samples_per_s"] * wl.block_size / nproc
        print(f"RESULT tokens_per_s_ours={ours_tps:.0f} tokens_per_s_plain={plain_tps:.0f} ratio={ours_tps / plain_tps:.3f}")


if __name__ == "__main__":
    main()
