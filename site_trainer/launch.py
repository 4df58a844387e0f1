"""How a site's trainer pool is started: the torchrun command line for one node of a site.

Single-node sites use `--standalone`. Multi-node sites start one torchrun per node, joined by
torchrun's c10d rendezvous at `rdzv_endpoint` (node 0's host:port); the node's rank goes to the
trainer (`--node-rank`), which numbers global ranks by node, since c10d ignores torchrun's own
`--node-rank`. On the nodes other than 0, an operator runs

    python -m site_trainer.launch --config trainer.json --node-rank 1

with the same trainer.json (its socket is used by node 0 only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from site_trainer.config import SiteConfig, TrainerConfig


def torchrun_argv(site: SiteConfig, config_path: str, node_rank: int = 0, rdzv_id: str | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m site_trainer --config PATH` for this site's ranks on one node."""
    if site.nnodes == 1:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={site.ranks}",
            "-m", "site_trainer", "--config", config_path,
        ]
    if not 0 <= node_rank < site.nnodes:
        raise ValueError(f"site {site.id}: node_rank {node_rank} is outside 0..{site.nnodes - 1}")
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={site.nnodes}", f"--nproc-per-node={site.ranks}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={site.rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'sovfl-' + site.id}",
        "-m", "site_trainer", "--config", config_path, "--node-rank", str(node_rank),
    ]


def main(argv: list[str] | None = None) -> None:
    """Start this node's part of a site trainer (exec's torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m site_trainer.launch", description=main.__doc__)
    parser.add_argument("--config", required=True, help="the site's TrainerConfig JSON (same file on every node)")
    parser.add_argument("--node-rank", type=int, default=0, help="0 on the node that serves the endpoint")
    parser.add_argument("--print", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)
    cfg = TrainerConfig.model_validate_json(Path(args.config).read_text())
    cmd = torchrun_argv(cfg.site, str(Path(args.config).resolve()), node_rank=args.node_rank)
    if args.print:
        print(" ".join(cmd))
        return
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
