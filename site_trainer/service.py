"""The site trainer service: K ranks in one process group, alive for the whole federation run.

Model, optimizer, data and process group are created once (`local_trainer.LocalTrainer`). Rank 0
serves the local endpoint; each round request is validated on rank 0, then broadcast as a small
command to every rank, which load the global model (a broadcast, or shard by shard under ZeRO),
train with the site's strategy, stream the full weights to rank 0's hand-off file and return to
the command loop. While idle, rank 0 sends heartbeats so that no collective waits on its own
timeout; a due local checkpoint rides on the next command or heartbeat.

Multi-node sites: torchrun's c10d rendezvous orders nodes by host name and process id and ignores
`--node-rank`, so the trainer numbers the global ranks itself (node_rank x ranks + local rank):
global rank 0, the one serving the endpoint, is always on node 0, and a restarted rank keeps its
data shard and its checkpointed sampling stream.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from site_trainer import endpoint, handoff
from site_trainer.config import SiteConfig, TrainerConfig
from site_trainer.launch import check_node_rank
from site_trainer.local_trainer import LocalTrainer
from site_trainer.strategies import StrategyUnavailable

log = logging.getLogger("sovfl.trainer")

HEARTBEAT_S = 5.0
STATE_WAIT_S = 30.0  # how long a due checkpoint waits for the round's PutState (codec residuals)
PG_TIMEOUT = timedelta(minutes=10)


class RequestRejected(ValueError):
    """A round request is unusable (wrong model layout, non-finite values): answered, not trained."""


class TrainerService:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.trainer = LocalTrainer(cfg)
        self.rank = self.trainer.rank
        self.world = self.trainer.world
        self.names = self.trainer.names
        self.spec = self.trainer.spec
        self.commands: queue.Queue = queue.Queue()
        # Site-private state the relay keeps here between rounds (codec error-feedback residuals):
        # named float arrays on rank 0, handed out with Train replies and replaced by PutState.
        self.site_state: dict[str, np.ndarray] = {}
        self.state_lock = threading.Lock()
        self.last_reply: str | None = None
        self.last_state: str | None = None
        self.round_times: list[float] = []
        # Rank 0's plan for the next local checkpoint: the round it covers, whether a PutState
        # (the residuals of that round) is still expected, and how long to wait for it.
        self.ckpt_due: int | None = None
        self.ckpt_awaits_state = False
        self.ckpt_deadline = 0.0
        resumed = self.trainer.resume() if cfg.site.checkpoint_every else None
        if resumed is not None and self.rank == 0:
            self.site_state = resumed[1]

    # ---- rank 0: endpoint side ------------------------------------------------------------
    def info(self) -> dict:
        return {
            "ok": True,
            "site": self.cfg.site.id,
            "workdir": self.cfg.workdir,  # the relay keeps the downlink reference model there
            "ranks": self.world,
            "strategy": self.cfg.site.strategy,
            "device": str(self.trainer.device),
            "compute": "bf16" if self.trainer.dtype == torch.bfloat16 else "fp32",
            "num_examples": int(len(self.trainer.data.train_y)),
            "num_val_examples": int(len(self.trainer.data.val_y)),
            "spec": {n: [d, list(shape)] for n, (d, shape) in self.spec.items()},
        }

    def handle(self, method: str, request: dict) -> dict:
        """Called on gRPC threads: queue the work for the main loop and wait for its answer."""
        if method == "Info":
            return self.info()
        if method == "PutState":
            return self.put_state(request)
        fut: Future = Future()
        self.commands.put((method, request, fut))
        try:
            return fut.result(timeout=float(request.get("timeout_s", 600)))
        except TimeoutError:
            fut.cancel()
            return {"ok": False, "error": f"site {self.cfg.site.id}: {method} did not finish in time"}

    def put_state(self, request: dict) -> dict:
        try:
            arrays = handoff.map_arrays(handoff.Handle.from_json(request["state"]))
        except (KeyError, OSError, ValueError) as err:
            return {"ok": False, "error": f"site {self.cfg.site.id}: cannot read the state hand-off: {err}"}
        with self.state_lock:
            self.site_state = {k: np.array(v) for k, v in arrays.items()}
            if self.ckpt_awaits_state:
                self.ckpt_awaits_state = False
                self.commands.put(("Nudge", {}, None))  # checkpoint now that the residuals are here
        return {"ok": True, "arrays": len(self.site_state)}

    def open_global(self, request: dict) -> handoff.Reader:
        """Rank 0: open the request's global model and check all of it before any rank sees it;
        returns the open reader, for the load (RequestRejected says what is wrong)."""
        try:
            reader = handoff.Reader(handoff.Handle.from_json(request["global"]))
        except (KeyError, OSError, ValueError) as err:
            raise RequestRejected(f"cannot read the global model hand-off: {err}") from None
        try:
            self._check_global(reader)
        except BaseException:
            reader.close()
            raise
        return reader

    def _check_global(self, reader: handoff.Reader) -> None:
        """Names, dtypes and shapes from the layout; then finite values, reading the tensors one at
        a time and dropping each (the load reads them again): one tensor of memory, not a model's."""
        if list(reader) != self.names:
            missing = sorted(set(self.names) - set(reader))
            extra = sorted(set(reader) - set(self.names))
            raise RequestRejected(f"global model does not match this site's model: missing {missing[:5]}, "
                                  f"unexpected {extra[:5]}")
        for e in reader.handle.entries:
            want = self.spec[e.name]
            if e.dtype != want[0] or e.shape != want[1]:
                raise RequestRejected(f"global tensor {e.name}: got {e.dtype}{e.shape}, expected {want[0]}{want[1]}")
        for name in self.names:
            try:
                finite = np.isfinite(reader[name]).all()
            except (OSError, ValueError) as err:
                raise RequestRejected(f"cannot read global tensor {name} from the hand-off: {err}") from None
            if not finite:
                raise RequestRejected(f"global tensor {name} contains NaN or Inf")

    # ---- all ranks ------------------------------------------------------------------------
    def _pack_update(self, arrays: Mapping[str, np.ndarray] | None, kind: str, round_no: int
                     ) -> tuple[handoff.Handle | None, list[str]]:
        """Collective: stream the full weights into rank 0's hand-off file (weights or delta), one
        tensor at a time; every rank returns the digests of every rank."""
        writer = handoff.Writer(self.spec, tag=f"{self.cfg.site.id}-update") if self.rank == 0 else None

        def put(name: str, t: torch.Tensor) -> None:
            out = t.numpy()
            if kind == "delta":
                out = arrays[name]  # a fresh copy of the global tensor: subtract in place
                np.subtract(t.numpy(), out, out=out)
            writer.write(name, out)

        try:
            digests = self.trainer.gather(put if writer is not None else None)
        finally:
            if writer is not None:
                writer.close()
        handle = writer.handle if writer is not None else None
        if handle is not None and self.cfg.site.dump_updates:
            dump = Path(self.cfg.workdir) / "updates"
            dump.mkdir(parents=True, exist_ok=True)
            np.savez(dump / f"round_{round_no:04d}.npz", **handoff.map_arrays(handle))
        return handle, digests

    def run_command(self, method: str, request: dict, arrays: Mapping[str, np.ndarray] | None) -> dict:
        """Executed by every rank in lock-step; rank 0 (which holds `arrays`) builds the answer."""
        t0 = time.perf_counter()
        self.trainer.load_global(arrays)
        load_s = time.perf_counter() - t0
        if method == "Evaluate":
            return {"ok": True, "metrics": {**self.trainer.evaluate(), "load_s": load_s},
                    "num_examples": int(len(self.trainer.data.val_y))}
        rc = request.get("config", {})
        steps = int(rc.get("local_steps", self.cfg.site.local_steps))
        round_no = int(request.get("round", 0))
        metrics = self.trainer.train(steps)
        t1 = time.perf_counter()
        handle, digests = self._pack_update(arrays, str(rc.get("update_kind", "delta")), round_no)
        every = self.cfg.site.checkpoint_every
        if self.rank != 0:
            return {}
        if every and self.trainer.rounds_trained % every == 0:
            self.ckpt_due = round_no
            self.ckpt_awaits_state = bool(request.get("with_state"))
            self.ckpt_deadline = time.monotonic() + STATE_WAIT_S
        self.last_reply = handle.path
        metrics.update(load_s=load_s, pack_s=time.perf_counter() - t1)
        state = None
        if request.get("with_state"):
            with self.state_lock:
                state = handoff.write_arrays(self.site_state, tag=f"{self.cfg.site.id}-state").to_json()
            self.last_state = state["path"]
        return {
            "state": state,
            "ok": True,
            "update": handle.to_json(),
            "num_examples": int(len(self.trainer.data.train_y)),
            "metrics": metrics,
            "rank_digests": digests,
        }

    def serve_forever(self) -> None:
        server = endpoint.serve(self.cfg.socket, self.handle) if self.rank == 0 else None
        if server is not None:
            Path(self.cfg.socket + ".ready").write_text(json.dumps(self.info()))
            log.info("site %s: trainer ready with %d rank(s) on %s", self.cfg.site.id, self.world, self.cfg.socket)
        try:
            while True:
                method, request, fut, arrays, ckpt_round = self._next_command()
                if ckpt_round is not None:
                    with self.state_lock:
                        site_state = dict(self.site_state)
                    self.trainer.save_checkpoint(ckpt_round, site_state)
                if method == "Heartbeat":
                    continue
                try:
                    reply = self.run_command(method, request, arrays)
                finally:
                    if arrays is not None:
                        arrays.close()
                if fut is not None and not fut.set_running_or_notify_cancel():
                    handoff.release((reply.get("update") or {}).get("path"))  # nobody waits any more
                    handoff.release((reply.get("state") or {}).get("path"))
                elif fut is not None:
                    fut.set_result(reply)
        finally:
            if server is not None:
                server.stop(grace=1.0)
                handoff.release(self.last_reply)
                handoff.release(self.last_state)
                for p in (self.cfg.socket, self.cfg.socket + ".ready"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)

    def _next_command(self):
        """Rank 0 takes the next request (or a heartbeat) and tells every rank what to run, and
        whether to write the local checkpoint that is due first."""
        if self.rank == 0:
            wait = HEARTBEAT_S
            if self.ckpt_due is not None:
                wait = min(wait, max(0.0, self.ckpt_deadline - time.monotonic())) if self.ckpt_awaits_state else 0.0
            try:
                method, request, fut = self.commands.get(timeout=wait)
            except queue.Empty:
                method, request, fut = "Heartbeat", {}, None
            if method == "Nudge":
                method = "Heartbeat"
            ckpt = None
            if self.ckpt_due is not None and (method != "Heartbeat" or not self.ckpt_awaits_state
                                              or time.monotonic() >= self.ckpt_deadline):
                ckpt, self.ckpt_due, self.ckpt_awaits_state = self.ckpt_due, None, False
            arrays = None
            if method != "Heartbeat":
                handoff.release(self.last_reply)  # the previous reply has been read by now
                handoff.release(self.last_state)
                self.last_reply = self.last_state = None
                try:
                    if fut.cancelled():
                        raise RequestRejected("the caller gave up before the request was taken")
                    arrays = self.open_global(request)
                except RequestRejected as err:
                    if not fut.cancelled():
                        fut.set_result({"ok": False, "error": f"site {self.cfg.site.id}: {err}"})
                    method, request, fut = "Heartbeat", {}, None
            header = [method, {k: v for k, v in request.items() if k != "global"} if method != "Heartbeat" else {}, ckpt]
        else:
            header = [None, None, None]
        if self.world > 1:
            dist.broadcast_object_list(header, src=0)
        if self.rank == 0:
            return method, request, fut, arrays, header[2]
        return header[0], header[1], None, None, header[2]


def init_process_group(cfg: TrainerConfig, node_rank: int) -> None:
    """Join the site's process group from torchrun's environment, ranks numbered by node."""
    site = cfg.site
    gpu = {"device_id": _bind_gpu(site)} if site.backend == "nccl" else {}
    if site.nnodes == 1:
        dist.init_process_group(site.backend, timeout=PG_TIMEOUT, **gpu)
        return
    try:
        check_node_rank(site, node_rank)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    world = int(os.environ["WORLD_SIZE"])
    if world != site.world_size or int(os.environ["LOCAL_WORLD_SIZE"]) != site.ranks:
        raise SystemExit(f"site {site.id}: torchrun formed {world} rank(s) with {os.environ['LOCAL_WORLD_SIZE']} "
                         f"per node, the config says {site.nnodes} node(s) x {site.ranks}")
    rank = node_rank * site.ranks + int(os.environ["LOCAL_RANK"])
    dist.init_process_group(site.backend, rank=rank, world_size=world, timeout=PG_TIMEOUT, **gpu)


def _bind_gpu(site: SiteConfig) -> torch.device:
    """One GPU per rank on its node (cuda:LOCAL_RANK), made current before NCCL starts, so that
    every collective, object broadcast and barrier of this rank runs on it."""
    if not torch.cuda.is_available():
        raise SystemExit(f"site {site.id}: backend 'nccl' needs CUDA GPUs; use backend 'gloo' on CPU")
    if not dist.is_nccl_available():
        raise SystemExit(f"site {site.id}: backend 'nccl' is not built into this torch ({torch.__version__}); "
                         "install a CUDA build of torch or use backend 'gloo'")
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:
        raise SystemExit(f"site {site.id}: {site.ranks} rank(s) per node need one GPU each, this node has {gpus}; "
                         f"set ranks to at most {gpus}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def run(cfg: TrainerConfig, node_rank: int = 0) -> None:
    """Join (or form) the process group from torchrun's environment and serve until told to stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not dist.is_initialized():
        init_process_group(cfg, node_rank)

    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            service = TrainerService(cfg)
        except StrategyUnavailable as err:
            raise SystemExit(f"site {cfg.site.id}: {err}") from None
        service.serve_forever()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m site_trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="TrainerConfig JSON written by `sovfl site`/`sovfl simulate`")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in a multi-node site (0 serves)")
    args = parser.parse_args(argv)
    cfg = TrainerConfig.model_validate_json(Path(args.config).read_text())
    torch.set_num_threads(int(os.environ.get("SOVFL_TORCH_THREADS", "1")))
    run(cfg, args.node_rank)


if __name__ == "__main__":
    main(sys.argv[1:])
