"""Worker for tests/test_dp.py, run under torchrun with 2 gloo ranks (not a test module).

`python -m torch.distributed.run --standalone --nproc-per-node=2 tests/dp_worker.py OUT.npz WORKDIR`
saves, from every rank, `<case>/rank<r>/<name>` arrays:
- clip: the DP mean gradient (sigma 0) of a fixed batch of 12 records split 6 + 6 over the ranks;
- noise: the reduced noise of zero gradients (sigma 1.3, C 0.7, seed 7, 200,000 coordinates);
- trainer: the digits LocalTrainer with privacy on, grad_accum 2, after one round: its weights and figures.
"""

from __future__ import annotations

import faulthandler
import sys

import numpy as np
import torch
import torch.distributed as dist

from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.local_trainer import LocalTrainer
from site_trainer.privacy.dp_sgd import NoisyReducer, PerSampleClipper
from site_trainer.workloads import initial_weights
from dp_cases import NOISE, clip_case


def main(out_path: str, workdir: str) -> None:
    faulthandler.enable()  # a native abort (SIGABRT) prints every thread's Python stack to stderr
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, np.ndarray] = {}
    model, loss_fn, (x, y), C = clip_case()
    mine = (x[rank * 6:(rank + 1) * 6], y[rank * 6:(rank + 1) * 6])
    for method in ("vmap", "loop"):
        sums, _ = PerSampleClipper(model, loss_fn, C, method).clipped_sum(mine)
        grads = NoisyReducer(0.0, C, torch.device("cpu")).reduce(sums, 12)
        for (name, _), g in zip(model.named_parameters(), grads):
            out[f"clip-{method}/rank{rank}/{name}"] = g.numpy().copy()
    sigma, c, seed, n = NOISE
    noise = NoisyReducer(sigma, c, torch.device("cpu"), seed).reduce([torch.zeros(n)], 1.0)[0]
    out[f"noise/rank{rank}/x"] = noise.numpy().copy()

    wl = WorkloadConfig(task="digits", options={"hidden": 16})
    site = SiteConfig(id="dp", ranks=2, partition=0, batch_size=8, grad_accum=2, local_steps=3,
                      privacy={"enabled": True, "epsilon": 8.0, "max_grad_norm": 1.0, "noise_seed": 3})
    cfg = TrainerConfig(site=site, workload=wl, num_partitions=1, socket="/nonexistent", workdir=workdir, rounds=5)
    t = LocalTrainer(cfg)
    t.load_global(initial_weights(wl, 0) if rank == 0 else None)
    rep = t.train(3, round_no=1)
    for name, p in t.module.named_parameters():
        out[f"trainer/rank{rank}/{name}"] = p.detach().numpy().copy()
    figs = t.dp.figures()
    out[f"trainer/rank{rank}/figures"] = np.array([figs["dp_epsilon"], figs["dp_noise_multiplier"], figs["dp_steps"],
                                                   rep["samples_seen"]])
    np.savez(out_path.replace(".npz", f"-{rank}.npz"), **out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
