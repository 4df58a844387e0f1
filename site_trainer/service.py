"""`python -m site_trainer --config trainer.json`: one rank of a site's trainer, under torchrun
(or alone: a one-rank site needs no torchrun, see `standalone_env`).

A declarative task runs in the built-in loop (`local_trainer.LocalTrainer.serve`); a script
workload (`workload.script`) runs as this process's `__main__`, with $SOVFL_TRAINER_CONFIG pointing
at the configuration so that `session.connect()` finds it. Either way the session serves the
coordinator's requests (site_trainer/session.py) until the trainer is stopped.

Multi-node sites: torchrun's c10d rendezvous orders nodes by host name and process id and ignores
`--node-rank`, so the trainer numbers the global ranks itself (node_rank x ranks + local rank):
global rank 0, the one serving the endpoint, is always on node 0, and a restarted rank keeps its
data shard and its checkpointed sampling stream. For a script, the ordered rank is put in $RANK
before it starts, so that its own `dist.init_process_group()` gets it too.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from site_trainer.config import TrainerConfig
from site_trainer.session import ENV_CONFIG, ENV_NODE_RANK, init_process_group, node_ordered_rank
from site_trainer.privacy.site_privacy import PrivacyRefused
from site_trainer.strategies import StrategyUnavailable


def run(cfg: TrainerConfig, node_rank: int = 0) -> None:
    """Join (or form) the process group from torchrun's environment and serve until told to stop."""
    from site_trainer.local_trainer import LocalTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not dist.is_initialized():
        init_process_group(cfg, node_rank)
    try:
        trainer = LocalTrainer(cfg)
    except StrategyUnavailable as err:
        raise SystemExit(f"site {cfg.site.id}: {err}") from None
    except PrivacyRefused as err:  # sites[].privacy the site cannot run: the reason, before it serves
        raise SystemExit(str(err)) from None
    trainer.serve()


def run_script(cfg: TrainerConfig, config_path: str, node_rank: int = 0) -> None:
    """Run the site's script (`site.script`, else `workload.script`) as `__main__`, as `python script.py
    args...` would, with the
    trainer configuration in $SOVFL_TRAINER_CONFIG (and the node-ordered rank in $RANK)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    script, args = cfg.script
    os.environ[ENV_CONFIG] = str(Path(config_path).resolve())
    os.environ[ENV_NODE_RANK] = str(node_rank)
    if cfg.site.nnodes > 1:
        os.environ["RANK"] = str(node_ordered_rank(cfg.site, node_rank))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def standalone_env(cfg: TrainerConfig) -> None:
    """A one-rank site started without torchrun (launch.trainer_argv) forms its one-process group
    itself: torchrun's variables where absent, the store on a port the kernel picks (no other
    rank needs to find it), so that a script's own `dist.init_process_group()` works too."""
    if "RANK" in os.environ or cfg.site.world_size != 1:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m site_trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="TrainerConfig JSON written by `sovfl site`/`sovfl simulate`")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in a multi-node site (0 serves)")
    args = parser.parse_args(argv)
    cfg = TrainerConfig.model_validate_json(Path(args.config).read_text())
    torch.set_num_threads(int(os.environ.get("SOVFL_TORCH_THREADS", "1")))
    standalone_env(cfg)
    try:
        if cfg.script is not None:  # the workload's script, or this site's own (site.script)
            run_script(cfg, args.config, args.node_rank)
        else:
            run(cfg, args.node_rank)
    except BaseException as err:  # noqa: BLE001 - every way out of a failed rank ends in exit_now
        exit_now(err)
    if cfg.script is None:
        leave(0)


def leave(code: int) -> None:
    """Flush and exit without the interpreter's teardown. After the built-in loop's clean stop
    every rank has left its last collective (the stop command), so nothing is owed to a peer; what
    is left is the process group's C++ worker threads, and tearing those down while a peer tears
    down its own can abort a rank ("terminate called without an active exception", SIGABRT), so
    that a clean stop would read as a failed trainer. The kernel closes the group's sockets."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_now(err: BaseException) -> None:
    """A rank that cannot go on (its group broke: a rank on another node died) must exit at once,
    so that torchrun and the site supervisor see it and start the pool again. A normal exit can
    block for good: the interpreter joins the endpoint's handler threads, one of which may wait for
    a reply this rank will never produce, and tearing down a group whose peer is dead can block too.
    So: report, flush, and leave without either. A script's own `sys.exit(0)` exits normally."""
    if isinstance(err, SystemExit) and err.code in (None, 0):
        raise err
    if isinstance(err, SystemExit) and isinstance(err.code, int):
        code = err.code
    else:
        code = 130 if isinstance(err, KeyboardInterrupt) else 1
        if isinstance(err, SystemExit):
            print(err.code, file=sys.stderr)
        elif not isinstance(err, KeyboardInterrupt):
            traceback.print_exception(err)
    leave(code)


if __name__ == "__main__":
    main(sys.argv[1:])
