"""How a site's trainer pool is started: the torchrun command line for one node of a site."""

from __future__ import annotations

import sys

from site_trainer.config import SiteConfig


def torchrun_argv(site: SiteConfig, config_path: str) -> list[str]:
    """`python -m torch.distributed.run ... -m site_trainer --config PATH` for this site's ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={site.ranks}",
        "-m", "site_trainer", "--config", config_path,
    ]
