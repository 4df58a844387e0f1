"""Worker for tests/test_exchange.py, run under torchrun (2 ranks, gloo): a LoRA-like task under each
parallelism. Not a test module: `torchrun ... tests/exchange_worker.py OUT.npz WORKDIR`.

Per parallelism it records what every rank holds after the build (the frozen weights as each rank
assembles them, the constructor-made buffer), the manifest rank 0 reports, and after a load and
two training steps the rank digests and whether the frozen weights stayed put.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from site_trainer import handoff, layout
from site_trainer.config import SiteConfig, TrainerConfig, WorkloadConfig
from site_trainer.local_trainer import LocalTrainer
from site_trainer.session import SessionError
from site_trainer.workloads import initial_weights
from group_exit import leave

LORA = WorkloadConfig(task="user_tasks:Toy")
FULL = WorkloadConfig(task="user_tasks:Toy", options={"lora": False})


def trainer(wl: WorkloadConfig, parallelism: str, workdir: str) -> LocalTrainer:
    site = SiteConfig(id="t", ranks=2, partition=0, parallelism=parallelism, batch_size=4, local_steps=2,
                      optimizer="adamw", lr=1e-2)
    return LocalTrainer(TrainerConfig(site=site, workload=wl, num_partitions=1, socket="/nonexistent", workdir=workdir))


def frozen_digest(t: LocalTrainer) -> str:
    """Collective: the fingerprint of the frozen weights as this rank holds them (shards gathered)."""
    d = layout.FrozenDigest()
    tensors = layout.named_tensors(t.module)
    with torch.no_grad():
        for name in t.session.layout.frozen:
            x = tensors[name]
            d.update(name, x.full_tensor() if isinstance(x, DTensor) else x)
    return d.hexdigest()


def every_rank(value: str) -> list[str]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main(out_path: str, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, np.ndarray] = {}
    for par in ("ddp", "zero2", "zero3"):
        t = trainer(LORA, par, workdir)
        out[f"{par}/manifest_sha"] = np.array(t.session.manifest["frozen"]["sha256"])
        out[f"{par}/held_sha"] = np.array(every_rank(frozen_digest(t)))
        inv = t.module.inv_freq
        out[f"{par}/inv_freq_ok"] = np.array(every_rank(str(bool(torch.equal(
            inv, 1.0 / (100.0 ** (torch.arange(8) / 8)))))))
        t.load_global(initial_weights(LORA, 0) if rank == 0 else None)
        t.train(2)
        out[f"{par}/digests"] = np.array(t.gather())
        out[f"{par}/held_sha_after"] = np.array(every_rank(frozen_digest(t)))
        for name, arr in t.full_state().items():
            out[f"{par}/adapters/{name}"] = arr
        # full fine-tuning of the same model: the tied embedding travels once and stays tied
        f = trainer(FULL, par, workdir)
        f.load_global(initial_weights(FULL, 0) if rank == 0 else None)
        f.train(2)
        out[f"{par}/full_digests"] = np.array(f.gather())
        out[f"{par}/full_names"] = np.array(f.session.layout.names)
        out[f"{par}/full_tied"] = np.array(every_rank(str(f.module.head.weight is f.module.emb.weight)))
        for name, arr in f.full_state().items():
            out[f"{par}/full/{name}"] = arr
    # a report that is bad on one rank only raises the same error on every rank (none is left waiting)
    t = trainer(LORA, "ddp", workdir)
    h = handoff.write_arrays(initial_weights(LORA, 0), "misuse") if rank == 0 else None
    request = {"round": 1, "global": h.to_json() if h else None, "config": {}}
    try:
        t.session.serve_one("Train", request, lambda rnd: rnd.report(num_examples=1, loss=1.0,
                                                                     acc="high" if rank == 1 else 0.5))
        out_misuse = "no error"
    except SessionError as err:
        out_misuse = str(err)
    finally:
        if h is not None:
            handoff.release(h.path)
    out["misuse"] = np.array(every_rank(out_misuse))
    if rank == 0:
        np.savez(out_path, **out)
    leave()  # group_exit.py


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
