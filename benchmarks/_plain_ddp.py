"""The anchor for trainer_overhead.py and gpu_throughput.py: a plain torchrun DDP loop, same
model, data and steps. With `backend: nccl` it trains on the rank's GPU, under bf16 autocast when
the site asks for `mixed_precision: bf16` (as a hand-written script would).

Run as `torchrun --nproc-per-node K benchmarks/_plain_ddp.py TRAINER_JSON STEPS [WARMUP]`; WARMUP
untimed steps come first (as the service's untimed warm-up round does); rank 0 prints one JSON
line with samples/s.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from site_trainer import workloads
from site_trainer.config import TrainerConfig


def main() -> None:
    cfg = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    steps = int(sys.argv[2])
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    torch.set_num_threads(1)
    gpu = cfg.site.backend == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(cfg.site.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    w = workloads.build(cfg.workload, cfg.site.partition, cfg.num_partitions, cfg.seed)
    model = DDP(w.model.to(device), device_ids=[device.index] if gpu else None)
    bf16 = gpu and cfg.site.mixed_precision == "bf16"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.site.lr) if cfg.site.optimizer == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=cfg.site.lr)
    idx = torch.arange(len(w.data.train_y))[rank::world]
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            if gpu:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        pick = idx[torch.randint(len(idx), (cfg.site.batch_size,), generator=gen)]
        with autocast():
            loss, _ = w.loss(model, w.data.train_x[pick].to(device), w.data.train_y[pick].to(device))
        loss.backward()
        loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        samples = steps * cfg.site.batch_size * world
        peak = torch.cuda.max_memory_allocated(device) if gpu else 0
        print(json.dumps({"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                          "peak_cuda_bytes": peak}), flush=True)
    dist.barrier()  # leave together (see tests/test_zero_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
