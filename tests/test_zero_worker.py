"""Worker for tests/test_zero.py, run under torchrun: trains `LocalTrainer` under each parallelism.

Not a test module itself (no tests here): `python -m torch.distributed.run ... tests/test_zero_worker.py
OUT.npz WORKDIR` runs every case once per launch, so the whole comparison costs one process-group start.
Rank 0 saves the full weights of every case into OUT.npz as `<case>/<tensor name>`.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from site_trainer import handoff
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.local_trainer import LocalTrainer
from site_trainer.workloads import initial_weights
from group_exit import leave

SLM = WorkloadConfig(task="slm", options={"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
                                          "corpus_bytes_per_site": 20_000})
DIGITS = WorkloadConfig(task="digits", options={"hidden": 16})


def trainer(wl: WorkloadConfig, strategy: str, workdir: str = "/nonexistent", rounds: int | None = None,
            **site) -> LocalTrainer:
    s = {"id": "t", "ranks": 2, "partition": 0, "batch_size": 4, "grad_accum": 2, "parallelism": strategy, **site}
    cfg = TrainerConfig(site=SiteConfig(**s), workload=wl, num_partitions=2, socket="/nonexistent", workdir=workdir,
                        rounds=rounds)
    t = LocalTrainer(cfg)
    t.load_global(initial_weights(wl, 0) if t.rank == 0 else None)
    return t


def fixed_batches(t: LocalTrainer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples of this rank's data, the same for every strategy (a fixed generator)."""
    g = torch.Generator().manual_seed(100 + t.rank)
    pick = t.train_idx[torch.randint(len(t.train_idx), (n,), generator=g)]
    return t.data.train.take(pick)


def served_round(t: LocalTrainer, rnd: int) -> None:
    """Collective: a Train request of round `rnd` on the initial weights, as the endpoint serves it."""
    h = handoff.write_arrays(initial_weights(DIGITS, 0), f"rerun-{rnd}") if t.rank == 0 else None
    request = {"round": rnd, "config": {}, **({"global": h.to_json()} if h else {})}
    try:
        reply = t.run_request("Train", request)
        assert t.rank != 0 or reply["ok"], reply
        if reply:
            handoff.release(reply["update"]["path"])
    finally:
        if h is not None:
            handoff.release(h.path)


def main(out_path: str, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, np.ndarray] = {}

    def keep(case: str, t: LocalTrainer) -> None:
        for name, arr in t.full_state().items():
            out[f"{case}/{name}"] = arr

    for strategy in ("ddp", "zero2", "zero3"):
        # the same local steps from the same seed and data: sampled batches, grad_accum=2, AdamW
        for wl_name, wl in (("slm", SLM), ("digits", DIGITS)):
            t = trainer(wl, strategy, optimizer="adamw", lr=1e-2)
            t.train(3)
            keep(f"{wl_name}-{strategy}", t)
        t = trainer(SLM, strategy, optimizer="adamw", lr=1e-2, activation_checkpointing=True)
        t.train(3)
        keep(f"slm-{strategy}-ac", t)
        # gradient accumulation: 4 micro-batches of 3 vs one batch of 12 (SGD shows the gradient)
        x, y = fixed_batches(t, 12)
        for case, chunks in (("accum4", 4), ("accum1", 1)):
            t = trainer(SLM, strategy, optimizer="sgd", lr=0.5)
            t.model.train()
            t.step(list(zip(x.chunk(chunks), y.chunk(chunks))))
            t.step(list(zip(x.flip(0).chunk(chunks), y.flip(0).chunk(chunks))))
            keep(f"{case}-{strategy}", t)
        # bf16 compute (the worker runs with SOVFL_BF16_EMULATED=1): master weights stay fp32
        t = trainer(SLM, strategy, optimizer="adamw", lr=1e-2, mixed_precision="bf16")
        assert t.dtype == torch.bfloat16
        t.train(3)
        keep(f"slm-{strategy}-bf16", t)
        digests = t.gather()
        if t.rank == 0:
            out[f"digests-{strategy}"] = np.array(digests)
        # local checkpoint: 2 steps, save, 2 more, versus a fresh trainer resumed from the save
        ckpt_dir = f"{workdir}/{strategy}"
        t = trainer(SLM, strategy, ckpt_dir, optimizer="adamw", lr=1e-2)
        t.train(2)
        t.save_checkpoint(1)
        t.train(2)
        keep(f"uninterrupted-{strategy}", t)
        t = trainer(SLM, strategy, ckpt_dir, optimizer="adamw", lr=1e-2)
        assert t.resume() == 1 and t.rounds_trained == 1
        t.train(2)
        keep(f"resumed-{strategy}", t)
        # the learning-rate schedule (warm-up, then cosine) and weight decay survive it as well
        sched = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2, "lr_schedule": "cosine",
                 "local_steps": 2}
        t = trainer(DIGITS, strategy, f"{ckpt_dir}-sched", rounds=3, **sched)
        t.train(2)
        t.save_checkpoint(1)
        t.train(2)
        keep(f"sched-uninterrupted-{strategy}", t)
        lrs = [t.optimizer.param_groups[0]["lr"]]
        t = trainer(DIGITS, strategy, f"{ckpt_dir}-sched", rounds=3, **sched)
        t.resume()
        t.train(2)
        keep(f"sched-resumed-{strategy}", t)
        out[f"sched-lr-{strategy}"] = np.array(lrs + [t.optimizer.param_groups[0]["lr"]])
        # a round trained again (the coordinator resumed): through the session's request path, local
        # checkpoints after each round as the served loop writes them; the rerun rewinds to round 1's
        t = trainer(DIGITS, strategy, f"{ckpt_dir}-rerun", optimizer="adamw", lr=1e-2, local_steps=2, checkpoint_every=1)
        for case, rnd in (("", 1), ("rerun-first", 2), ("rerun-again", 2)):
            served_round(t, rnd)
            t.save_checkpoint(rnd)
            if case:
                keep(f"{case}-{strategy}", t)
    if dist.get_rank() == 0:
        np.savez(out_path, **out)
    leave()  # group_exit.py


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
