"""The anchor for trainer_overhead.py: a plain torchrun DDP loop, same model, data and steps.

Run as `torchrun --nproc-per-node K benchmarks/_plain_ddp.py TRAINER_JSON STEPS`; rank 0 prints
one JSON line with samples/s.
"""

import json
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
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = workloads.build(cfg.workload, cfg.site.partition, cfg.num_partitions, cfg.seed)
    model = DDP(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.site.lr) if cfg.site.optimizer == "adamw" \
        else torch.optim.SGD(model.parameters(), lr=cfg.site.lr)
    idx = torch.arange(len(w.data.train_y))[rank::world]
    gen = torch.Generator().manual_seed(rank)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        pick = idx[torch.randint(len(idx), (cfg.site.batch_size,), generator=gen)]
        loss, _ = w.loss(model, w.data.train_x[pick], w.data.train_y[pick])
        loss.backward()
        loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        samples = steps * cfg.site.batch_size * world
        print(json.dumps({"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds}), flush=True)
    dist.barrier()  # leave together (see tests/test_zero_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
