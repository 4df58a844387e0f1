"""How a site's trainer pool is started: the command line for one node of a site.

A one-rank, one-node site runs its rank directly (`python -m site_trainer`): torchrun's agent
would only watch one process (it restarts nothing: the site supervisor does), and it costs a
torch import, ~1.5 s of CPU, per start; the rank forms its one-process group itself
(service.standalone_env). Other single-node sites use torchrun `--standalone`.

Multi-node sites start one torchrun per node, joined by torchrun's c10d rendezvous at
`rdzv_endpoint` (node 0's host:port, where node 0's torchrun hosts the store); the node's rank
goes to the trainer (`--node-rank`), which numbers global ranks by node, since c10d ignores
torchrun's own `--node-rank`. Nodes other than 0 are started with
`sovfl site CONFIG --site ID --node-rank N` (or, from node 0's trainer.json,
`python -m site_trainer.launch --config trainer.json --node-rank N`); both first wait, up to a
deadline, for node 0's rendezvous endpoint to accept connections.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from site_trainer.config import SiteConfig, TrainerConfig


class RendezvousUnreachable(RuntimeError):
    """Node 0's rendezvous endpoint did not accept a connection before the deadline."""


def trainer_argv(site: SiteConfig, config_path: str, node_rank: int = 0, rdzv_id: str | None = None,
                 join_timeout_s: float | None = None) -> list[str]:
    """The command for this site's ranks on one node: the rank itself for a one-rank, one-node
    site, else `torchrun_argv`."""
    if site.nnodes == 1 and site.ranks == 1:
        check_node_rank(site, node_rank)
        return [sys.executable, "-m", "site_trainer", "--config", config_path]
    return torchrun_argv(site, config_path, node_rank, rdzv_id, join_timeout_s)


def torchrun_argv(site: SiteConfig, config_path: str, node_rank: int = 0, rdzv_id: str | None = None,
                  join_timeout_s: float | None = None) -> list[str]:
    """`python -m torch.distributed.run ... -m site_trainer --config PATH` for this site's ranks on one node.

    `join_timeout_s` bounds how long a multi-node torchrun waits for the other nodes to join
    (torchrun's own default is 600 s). torchrun never restarts the ranks itself: whoever started it
    does (the site supervisor), with a fresh `rdzv_id` for a multi-node site (see `publish_rdzv_id`).
    """
    if site.nnodes == 1:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={site.ranks}",
            "-m", "site_trainer", "--config", config_path,
        ]
    check_node_rank(site, node_rank)
    conf = [f"--rdzv-conf=join_timeout={int(join_timeout_s)}"] if join_timeout_s else []
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={site.nnodes}", f"--nproc-per-node={site.ranks}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={site.rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'sovfl-' + site.id}",
        *conf, "-m", "site_trainer", "--config", config_path, "--node-rank", str(node_rank),
    ]


def check_node_rank(site: SiteConfig, node_rank: int) -> None:
    if site.nnodes == 1 and node_rank != 0:
        raise ValueError(f"site {site.id} is a single-node site (nnodes: 1): --node-rank {node_rank} does not apply; "
                         "set nnodes and rdzv_endpoint in the site's configuration for a multi-node site")
    if not 0 <= node_rank < site.nnodes:
        raise ValueError(f"site {site.id}: node_rank {node_rank} is outside 0..{site.nnodes - 1} "
                         f"(the site has nnodes: {site.nnodes})")


def wait_for_rendezvous(site: SiteConfig, deadline_s: float) -> None:
    """Block until node 0's rendezvous endpoint accepts TCP connections (node 0 must start first)."""
    host, port = site.rdzv_endpoint.rsplit(":", 1)
    host = host.strip("[]")
    end = time.monotonic() + deadline_s
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, max(0.1, end - time.monotonic()))):
                return
        except OSError as err:
            last = err.strerror or str(err)
        if time.monotonic() >= end:
            raise RendezvousUnreachable(
                f"site {site.id}: node 0's rendezvous endpoint {site.rdzv_endpoint} did not accept a connection "
                f"within {deadline_s:g}s ({last}); start node 0 first (`sovfl site` without --node-rank) and "
                "check that this node can reach that host and port")
        time.sleep(0.5)


# ---- a multi-node pool started again: which rendezvous to meet in ------------------------------
# A torchrun agent whose ranks failed closes its rendezvous for good: every node that comes back
# with the same id fails with RendezvousClosedError. (torchrun's own --max-restarts does not help
# either: two agents restarting on their own were seen to start ranks of different generations that
# never connect.) So every start of node 0's pool gets a fresh id, which node 0 publishes in the
# store its torchrun agent hosts at the rendezvous endpoint, and a node >= 1 reads it there before
# each start of its own torchrun. A rank that dies fails every other rank's collectives, so all
# nodes' pools go down together and a node >= 1 waits for an id other than the one its last pool
# used: read too early, it would get the old id from node 0's agent that is still going down, and
# wait in a rendezvous that node 0's new pool never enters (seen under load on CI: both new pools
# waited for each other until the test gave up).

RDZV_ID_KEY = "sovfl/rdzv-id"


def fresh_rdzv_id(site: SiteConfig) -> str:
    """A rendezvous id for one start of `site`'s pool."""
    return f"sovfl-{site.id}-{uuid.uuid4().hex[:12]}"


def _endpoint_store(site: SiteConfig, timeout_s: float):
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = site.rdzv_endpoint.rsplit(":", 1)
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def publish_rdzv_id(site: SiteConfig, rdzv_id: str, timeout_s: float) -> None:
    """Node 0, just after starting its torchrun with `rdzv_id`: tell the other nodes (raises when
    the agent's store does not come up within `timeout_s`)."""
    _endpoint_store(site, timeout_s).set(RDZV_ID_KEY, rdzv_id)


def read_rdzv_id(site: SiteConfig, timeout_s: float, not_id: str | None = None) -> str:
    """Node >= 1: the rendezvous id node 0's running pool uses, waiting up to `timeout_s` for one
    other than `not_id` (the id of this node's last pool, which went down with node 0's). Past
    that, the id published then (node 0's pool may be waiting in it); raises if there is none."""
    end = time.monotonic() + timeout_s
    seen, last_err = None, None
    while True:
        left = end - time.monotonic()
        try:  # node 0's store is down between its agents: connect again each time
            seen = _endpoint_store(site, max(1.0, min(5.0, left))).get(RDZV_ID_KEY).decode()
            if seen != not_id:
                return seen
        except Exception as err:  # noqa: BLE001 - torch's store errors (refused, timed out)
            last_err = err
        if left <= 0:
            if seen is not None:
                return seen
            raise RuntimeError(f"no rendezvous id in node 0's store at {site.rdzv_endpoint}: {last_err}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    """Start this node's part of a site trainer (exec's torchrun)."""
    parser = argparse.ArgumentParser(prog="python -m site_trainer.launch", description=main.__doc__)
    parser.add_argument("--config", required=True, help="the site's TrainerConfig JSON (same file on every node)")
    parser.add_argument("--node-rank", type=int, default=0, help="0 on the node that serves the endpoint")
    parser.add_argument("--rdzv-timeout", type=float, default=300.0,
                        help="seconds a node other than 0 waits for node 0's rendezvous endpoint (default 300)")
    parser.add_argument("--print", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)
    cfg = TrainerConfig.model_validate_json(Path(args.config).read_text())
    try:
        cmd = trainer_argv(cfg.site, str(Path(args.config).resolve()), node_rank=args.node_rank,
                            join_timeout_s=args.rdzv_timeout)
        if args.print:
            print(" ".join(cmd))
            return
        if args.node_rank > 0:
            wait_for_rendezvous(cfg.site, args.rdzv_timeout)
    except (ValueError, RendezvousUnreachable) as err:
        raise SystemExit(f"python -m site_trainer.launch: {err}") from None
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
