"""The anchor for the trainer benchmarks: a plain torchrun training loop written with torch alone.

Same model, data, batch, optimizer (fused AdamW), parallelism and precision as the site trainer
config it is given, but none of the trainer's code: DDP (with autocast and torch's bf16 gradient
compression hook for bf16) or FSDP2's `fully_shard` per transformer block (bf16 parameters and
reductions, fp32 master weights), on the config's backend (NCCL: one GPU per rank).

    torchrun --nproc-per-node K benchmarks/_plain_torchrun.py TRAINER_JSON STEPS [WARMUP_STEPS]

Rank 0 prints one JSON line: samples and tokens per second over the timed steps (after the
untimed warm-up), the peak CUDA memory of any rank, the device and the compute dtype.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from site_trainer import workload_loader
from site_trainer.config import TrainerConfig
from site_trainer.workload import Task, TaskContext


def task_of(cfg: TrainerConfig, rank: int = 0, world: int = 1, device: torch.device | None = None) -> Task:
    """The workload's task (its model, data and loss): the same code as the trainer's, none of its loop.
    Its caches (a text task's tokens) go to a directory of the plain loop's own."""
    ctx = TaskContext(role="site", seed=cfg.seed, site=cfg.site.id, partition=cfg.site.partition,
                      num_partitions=cfg.num_partitions, rank=rank, world_size=world,
                      device=device or torch.device("cpu"), workdir=Path(cfg.workdir) / "plain-loop")
    return workload_loader.build_task(cfg.workload, ctx, cfg.options)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: a GPT's `blocks`, a Hugging Face model's decoder layers."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return list(model.model.layers)


def batch_of(train, pick: torch.Tensor):
    """The rows `pick` as one batch: the built-in tasks' `take`, else torch's default collation."""
    if hasattr(train, "take"):
        return train.take(pick)
    from torch.utils.data import default_collate

    return default_collate([train[int(i)] for i in pick])


def build(cfg: TrainerConfig, task: Task, device: torch.device, dtype: torch.dtype | None):
    torch.manual_seed(cfg.seed)
    model = task.build_model().to(device)
    if cfg.site.parallelism == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if dtype is not None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            model.register_comm_hook(dist.group.WORLD, bf16_compress_hook)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in blocks_of(model):
        fully_shard(block, reshard_after_forward=cfg.site.parallelism == "zero3", mp_policy=mp)
    return fully_shard(model, reshard_after_forward=cfg.site.parallelism == "zero3", mp_policy=mp)


def main() -> None:
    cfg = TrainerConfig.model_validate_json(Path(sys.argv[1]).read_text())
    steps, warmup = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
    site = cfg.site
    torch.set_num_threads(1)
    if site.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtype = torch.bfloat16 if site.mixed_precision == "bf16" else None
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    task = task_of(cfg, rank, world, device)
    train = task.build_data().train
    model = build(cfg, task, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=site.lr, weight_decay=0.0, fused=True)
    idx = torch.arange(len(train))[rank::world]
    gen = torch.Generator().manual_seed(rank)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None and site.parallelism == "ddp")

    def run(n: int) -> None:
        for _ in range(n):
            for _ in range(site.grad_accum):
                pick = idx[torch.randint(len(idx), (site.batch_size,), generator=gen)]
                batch = batch_of(train, pick)
                batch = tuple(t.to(device) for t in batch) if isinstance(batch, (tuple, list)) else batch.to(device)
                with autocast:
                    loss = task.loss(model, batch)
                (loss.float() / site.grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    run(warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    run(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated() if device.type == "cuda" else 0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        samples = steps * site.grad_accum * site.batch_size * world
        per_sample = {"slm": cfg.options.get("block_size", 1), "hf-causal-lm": cfg.options.get("seq_len") or 1}
        tokens = samples * per_sample.get(cfg.workload.task, 1)
        print(json.dumps({"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
                          "tokens_per_s": tokens / seconds, "cuda_peak_bytes": int(peak.item()),
                          "device": str(device), "compute": "bf16" if dtype is not None else "fp32"}), flush=True)
    dist.barrier()  # leave together (see tests/test_zero_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
