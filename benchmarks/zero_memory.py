"""Peak memory per rank of the real site trainer under ddp, zero2 and zero3 with Adam, next to theory.

Theory for P fp32 parameters, Adam (two fp32 moments) and K ranks, in bytes per rank:
  ddp 16P (weights 4P, gradients 4P, moments 8P) · zero2 4P + 12P/K · zero3 16P/K.

What is measured: K ranks (gloo on CPU; with --cuda, NCCL with one GPU per rank) each run the site
trainer service's own code for one round, in-process and without the socket: `LocalTrainer` is
built (model on the meta device under ZeRO, shards allocated, fused AdamW) and runs one Train
request through its session (`run_request`): rank 0 opens the global model from a hand-off file
written by this script (the relay's part), every rank loads it (checked as it arrives), trains
`--steps` AdamW steps and streams the update into rank 0's hand-off file. Per rank: the peak
resident set over that whole window (/proc VmHWM, reset after a warm-up round on a tiny model)
minus the resident set before the trainer existed. That is everything the trainer allocated for
this model (weights, gradients, moments, gathered blocks, activations, collective buffers, the
allocator's slack), which is what the theory's bytes-per-rank promise is about. The batch is one
16-token sequence, so activations stay under a tenth of the model states, as the theory assumes.
The hand-off files (global model in, update out; 4P bytes each, one pair per site) live in
/dev/shm, owned by the relay: rank 0 copies through them with pread/pwrite, so they are in no
rank's resident set and are listed separately. With --cuda, torch.cuda.max_memory_allocated over
the same window is reported too, and the ratios use it (device memory is what ZeRO divides there).

    python benchmarks/zero_memory.py [--ranks 4] [--layers 64] [--embd 256] [--steps 3] [--cuda]

Last line: RESULT zero2_vs_theory=<measured/theory> zero3_vs_theory=<measured/theory> (target <= 1.2).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from site_trainer import handoff, workloads  # noqa: E402
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig  # noqa: E402
from site_trainer.local_trainer import LocalTrainer  # noqa: E402

MIB = 2**20


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _config(wl: WorkloadConfig, strategy: str, ranks: int, steps: int, backend: str, workdir: str) -> TrainerConfig:
    site = SiteConfig(id="mem", ranks=ranks, partition=0, parallelism=strategy, backend=backend, optimizer="adamw",
                      lr=1e-4, batch_size=1, grad_accum=1, local_steps=steps)
    return TrainerConfig(site=site, workload=wl, num_partitions=1, socket=f"{workdir}/unused.sock", workdir=workdir)


def _one_round(cfg: TrainerConfig, global_handle: dict) -> dict:
    """Collective: build the trainer service and run one Train request through its own code; the
    reply's metrics on rank 0, {} elsewhere."""
    trainer = LocalTrainer(cfg)
    reply = trainer.run_request("Train", {"round": 1, "global": global_handle, "config": {"update_kind": "delta"}})
    if trainer.rank == 0:
        handoff.release(reply["update"]["path"])
    return reply.get("metrics", {})


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, strategy: str, handles: dict,
          out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    backend = "nccl" if args.cuda else "gloo"
    if args.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    with tempfile.TemporaryDirectory(prefix="sovfl-mem-") as tmp:
        # Warm-up round on a tiny model: the first run of every kernel pages torch's code in,
        # which is resident memory too but no part of what a strategy costs.
        _one_round(_config(_tiny(args), strategy, world, 1, backend, tmp), handles["tiny"])
        gc.collect()  # FSDP's modules hold reference cycles: drop the warm-up trainer before the baseline
        before = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        if args.cuda:
            torch.cuda.reset_peak_memory_stats()
            cuda_before = torch.cuda.memory_allocated()
        metrics = _one_round(_config(_workload(args), strategy, world, args.steps, backend, tmp), handles["model"])
        host = _status_bytes("VmHWM") - before
        cuda = 0
        if args.cuda:  # the trainer reads (and resets) the peak at the end of training: its figure covers
            # build, load and training, max over ranks (rank 0's reply); the allocator's covers the rest
            cuda = max(int(metrics.get("cuda_peak_bytes", 0)), torch.cuda.max_memory_allocated()) - cuda_before
    out.put((rank, host, cuda))
    dist.barrier()
    dist.destroy_process_group()


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(task="slm", options={"n_layer": args.layers, "n_head": 8, "n_embd": args.embd,
                                               "block_size": 16, "corpus_bytes_per_site": 10_000})


def _tiny(args: argparse.Namespace) -> WorkloadConfig:
    wl = _workload(args)
    return WorkloadConfig(task=wl.task, options={**wl.options, "n_layer": 1, "n_embd": 16, "n_head": 1})


def measure(strategy: str, args: argparse.Namespace, handles: dict) -> list[tuple[int, int, int]]:
    """(rank, host peak bytes, CUDA peak bytes) of every rank for one strategy, in fresh processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, strategy, handles, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=120)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise SystemExit(f"{strategy}: rank(s) exited with {bad}")
    return sorted(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated subset to measure")
    ap.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank; ratios from CUDA peak memory")
    args = ap.parse_args()
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda: no CUDA device is visible to torch; run without --cuda to measure on the CPU")
    if args.cuda and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--cuda with --ranks {args.ranks} needs {args.ranks} GPUs (one per rank, as NCCL "
                         f"requires); this machine has {torch.cuda.device_count()}: pass --ranks "
                         f"{max(1, torch.cuda.device_count())}")
    k = args.ranks
    init = workloads.initial_weights(_workload(args), 0)
    p = sum(a.size for a in init.values())
    handles = {"model": handoff.write_arrays(init, "mem-global").to_json(),
               "tiny": handoff.write_arrays(workloads.initial_weights(_tiny(args), 0), "mem-tiny").to_json()}
    del init
    where = "CUDA max_memory_allocated" if args.cuda else "host VmHWM"
    ratios = {}
    print(f"{'strategy':<8} {'peak MiB/rank (worst)':>22} {'rank 0':>8} {'theory MiB/rank':>16} {'ratio':>7}"
          + ("   host VmHWM MiB (worst)" if args.cuda else ""))
    try:
        for strategy in args.strategies.split(","):
            rows = measure(strategy, args, handles)
            peaks = [cuda if args.cuda else host for _, host, cuda in rows]
            theory = {"ddp": 16 * p, "zero2": 4 * p + 12 * p / k, "zero3": 16 * p / k}[strategy]
            ratios[strategy] = max(peaks) / theory
            print(f"{strategy:<8} {max(peaks) / MIB:>22.1f} {peaks[0] / MIB:>8.1f} {theory / MIB:>16.1f} "
                  f"{ratios[strategy]:>7.3f}" + (f"   {max(h for _, h, _ in rows) / MIB:.1f}" if args.cuda else ""),
                  flush=True)
    finally:
        for h in handles.values():
            handoff.release(h["path"])
    print(f"model: byte-level GPT, P={p:,} parameters, K={k} ranks ({'NCCL, GPU' if args.cuda else 'gloo, CPU'}), "
          f"AdamW fp32, one round of {args.steps} steps on 1x16 tokens per rank; measured: {where} over the "
          "round (build, load, train, update out) minus the level before the trainer existed")
    print("why: the theory counts the bytes a rank must hold for weights, gradients and Adam moments; the peak "
          "a rank needs from its machine over a whole round covers those plus everything else the trainer "
          "allocates, so measured/theory is what a site pays on top of ZeRO's promise")
    print(f"hand-off files (relay's, /dev/shm, per site, in no rank's resident set): global model {4 * p / MIB:.1f} "
          f"MiB in, update {4 * p / MIB:.1f} MiB out")
    fmt = lambda s: f"{ratios[s]:.3f}" if s in ratios else "not-measured"  # noqa: E731
    print(f"RESULT zero2_vs_theory={fmt('zero2')} zero3_vs_theory={fmt('zero3')}")


if __name__ == "__main__":
    main()
