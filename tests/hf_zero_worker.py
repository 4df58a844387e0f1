"""Worker for tests/test_hf_zero.py, run under torchrun with 2 gloo ranks: hf-causal-lm built the
way ZeRO ranks build it, sharded with FSDP2, trained, and compared with one process.

Not a test module: `python -m torch.distributed.run --nproc-per-node 2 tests/hf_zero_worker.py
OUT.json WORKDIR CASE_JSON...`, where each case is {name, model_dir, corpus, lora, dtype, reshard}.

Per case, every rank builds the task's model inside accelerate's `init_empty_weights` (parameters on
the meta device, buffers real), shards each decoder layer found from `_no_split_modules` and then
the root with `fully_shard`, gives the shards storage (keeping the real buffers), and copies in
rank 0's pretrained weights tensor by tensor (a broadcast, then each rank's dim-0 chunk). Two
AdamW steps on one batch follow, the same on both ranks; rank 0 also trains an unsharded copy of
the real model on that batch. Rank 0 writes, per case: the largest difference between the two
after the steps (gathered from the shards), how far the weights moved, whether the embedding and
the head are still one tensor, and the number of sharding units.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from site_trainer.tasks.hf_causal_lm import CausalLM
from site_trainer.workload import TaskContext
from group_exit import leave


def sharded(task: CausalLM, reshard: bool) -> tuple[torch.nn.Module, int]:
    with init_empty_weights():
        module = task.build_model()
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    classes = set(module._no_split_modules)
    blocks = [m for m in module.modules() if type(m).__name__ in classes]
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(module, reshard_after_forward=reshard)
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])  # rotary frequencies and the like: built real, kept real
    return module, len(blocks)


def stream(module: torch.nn.Module, full: dict[str, torch.Tensor] | None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            whole = full[name].to(t.dtype) if rank == 0 else torch.empty(t.shape, dtype=t.dtype)
            dist.broadcast(whole, src=0)
            if isinstance(t, DTensor):
                local = t.to_local()
                chunks = whole.chunk(world, dim=0)
                local.copy_(chunks[rank] if rank < len(chunks) else whole[:0])
            else:
                t.copy_(whole)


def run_case(case: dict, workdir: Path) -> dict:
    rank = dist.get_rank()
    opts = CausalLM.Options.model_validate({"model_dir": case["model_dir"], "data": case["corpus"], "seq_len": 32,
                                            "val_fraction": 0.0, "lora": case["lora"], "dtype": case["dtype"]})
    task = CausalLM(opts, TaskContext(role="site", site="s", rank=rank, world_size=dist.get_world_size(),
                                      workdir=workdir))
    data = task.build_data()
    torch.manual_seed(0)
    real = task.build_model()  # what rank 0 builds and streams
    start = {k: v.detach().clone() for k, v in real.state_dict().items()}
    module, units = sharded(task, case["reshard"])
    stream(module, start if rank == 0 else None)
    g = torch.Generator().manual_seed(7)
    batch = torch.stack([data.train[int(i)] for i in torch.randint(len(data.train), (4,), generator=g)])
    pairs = [(module, torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2))]
    if rank == 0:
        pairs.append((real, torch.optim.AdamW([p for p in real.parameters() if p.requires_grad], lr=1e-2)))
    for model, opt in pairs:
        model.eval()  # no dropout: both runs see the same function
        for _ in range(2):
            task.loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    got = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float()
           for k, v in module.state_dict().items()}
    out = {"units": units, "tied": module.get_output_embeddings().weight is module.get_input_embeddings().weight}
    if rank == 0:
        want = {k: v.detach().float() for k, v in real.state_dict().items()}
        out["diff"] = max(float((got[k] - want[k]).abs().max()) for k in want)
        out["moved"] = max(float((want[k] - start[k].float()).abs().max()) for k in want)
    return out


def main(out_path: str, workdir: str, *cases: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for raw in cases:
        case = json.loads(raw)
        results[case["name"]] = run_case(case, Path(workdir))
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    leave()  # group_exit.py


if __name__ == "__main__":
    main(*sys.argv[1:])
