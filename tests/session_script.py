"""A plain torchrun DDP training script, joined to a federation by the session (about ten lines).

Run by `sovfl simulate` as `workload: {script: tests/session_script.py, args: [--lr, "0.1"],
model: "user_tasks:make_model", options: {...}}`; by hand:
`SOVFL_TRAINER_CONFIG=trainer.json torchrun --nproc-per-node 2 tests/session_script.py --lr 0.1`.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from site_trainer import session
from user_tasks import Blobs, BlobsOptions, make_model
from site_trainer.workload import TaskContext


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    dist.init_process_group("gloo")  # the script's own start, as any torchrun script has it
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = session.site_config()  # this site's options and partition
    data = Blobs(BlobsOptions(**cfg.options), TaskContext(role="site", partition=cfg.site.partition)).build_data()
    x, y = data.train.tensors
    mine = torch.arange(len(y))[rank::world]
    torch.manual_seed(cfg.seed)
    model = DDP(make_model(cfg.options))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(rank)

    sess = session.connect(model, optimizer=opt, num_examples=len(y))
    rounds = 0
    for rnd in sess.rounds():
        if rnd.evaluating:
            vx, vy = data.val.tensors
            with torch.no_grad():
                logits = model.module(vx[rank::world])
            n = len(vy[rank::world])
            rnd.report(num_examples=n, loss=F.cross_entropy(logits, vy[rank::world]),
                       accuracy=(logits.argmax(-1) == vy[rank::world]).float().mean())
            continue
        total = 0.0
        for _ in range(rnd.local_steps):
            pick = mine[torch.randint(len(mine), (args.batch,), generator=gen)]
            loss = F.cross_entropy(model(x[pick]), y[pick])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        rnd.report(num_examples=len(mine), loss=total / rnd.local_steps)
        rounds += 1
    print(f"rank {rank}: session ended cleanly after {rounds} training round(s)", flush=True)


if __name__ == "__main__":
    main()
