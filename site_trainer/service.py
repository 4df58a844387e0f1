"""The site trainer service: K ranks in one process group, alive for the whole federation run.

Model, optimizer, data and process group are created once. Rank 0 serves the local endpoint; each
round request is validated on rank 0, then broadcast as a small command to every rank, which
load the global model (one flat broadcast), train with DDP and return to the command loop. While
idle, rank 0 sends heartbeats so that no collective waits on its own timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from site_trainer import endpoint, handoff, workloads
from site_trainer.config import TrainerConfig

log = logging.getLogger("sovfl.trainer")

HEARTBEAT_S = 5.0
PG_TIMEOUT = timedelta(minutes=10)


class RequestRejected(ValueError):
    """A round request is unusable (wrong model layout, non-finite values): answered, not trained."""


class TrainerService:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        torch.manual_seed(cfg.seed)
        self.workload = workloads.build(cfg.workload, cfg.site.partition, cfg.num_partitions, cfg.seed)
        self.module = self.workload.model
        self.model = DDP(self.module)
        self.names = list(self.module.state_dict().keys())
        self.tensors = list(self.module.state_dict().values())
        self.spec = {n: ("<f4", tuple(t.shape)) for n, t in zip(self.names, self.tensors)}
        s = cfg.site
        params = self.model.parameters()
        self.optimizer = (torch.optim.SGD(params, lr=s.lr) if s.optimizer == "sgd"
                          else torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0))
        data = self.workload.data
        self.train_idx = torch.arange(len(data.train_y))[self.rank :: self.world]
        self.val_idx = torch.arange(len(data.val_y))[self.rank :: self.world]
        if len(self.train_idx) == 0:
            raise RuntimeError(f"site {s.id}: rank {self.rank} has no training data; use fewer ranks")
        self.gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s.partition * 1009 + self.rank)
        self.commands: queue.Queue = queue.Queue()
        # Site-private state the relay keeps here between rounds (codec error-feedback residuals):
        # named float arrays on rank 0, handed out with Train replies and replaced by PutState.
        self.site_state: dict[str, np.ndarray] = {}
        self.state_lock = threading.Lock()
        self.last_reply: str | None = None
        self.last_state: str | None = None
        self.round_times: list[float] = []

    # ---- rank 0: endpoint side ------------------------------------------------------------
    def info(self) -> dict:
        return {
            "ok": True,
            "site": self.cfg.site.id,
            "ranks": self.world,
            "num_examples": int(len(self.workload.data.train_y)),
            "num_val_examples": int(len(self.workload.data.val_y)),
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
        return {"ok": True, "arrays": len(self.site_state)}

    def _validated_global(self, request: dict) -> dict[str, np.ndarray]:
        try:
            arrays = handoff.map_arrays(handoff.Handle.from_json(request["global"]))
        except (KeyError, OSError, ValueError) as err:
            raise RequestRejected(f"cannot read the global model hand-off: {err}") from None
        if list(arrays) != self.names:
            missing = sorted(set(self.names) - set(arrays))
            extra = sorted(set(arrays) - set(self.names))
            raise RequestRejected(f"global model does not match this site's model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, arr in arrays.items():
            want = self.spec[name]
            if arr.dtype.str != want[0] or arr.shape != want[1]:
                raise RequestRejected(f"global tensor {name}: got {arr.dtype.str}{arr.shape}, expected {want[0]}{want[1]}")
            if not np.isfinite(arr).all():
                raise RequestRejected(f"global tensor {name} contains NaN or Inf")
        return arrays

    # ---- all ranks ------------------------------------------------------------------------
    def _load_global(self, arrays: dict[str, np.ndarray] | None) -> None:
        """Rank 0 copies the mapped arrays in; one flat broadcast gives every rank the same weights."""
        with torch.no_grad():
            if self.rank == 0:
                for t, name in zip(self.tensors, self.names):
                    t.copy_(torch.from_numpy(arrays[name]))
            if self.world > 1:
                flat = parameters_to_vector(self.tensors)
                dist.broadcast(flat, src=0)
                offset = 0
                for t in self.tensors:  # copy in place: the tensors share storage with the model
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _batch(self, idx: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = idx[torch.randint(len(idx), (size,), generator=self.gen)]
        d = self.workload.data
        return d.train_x[pick], d.train_y[pick]

    def train(self, steps: int) -> dict:
        s = self.cfg.site
        self.model.train()
        total, t0 = torch.zeros(2, dtype=torch.float64), time.perf_counter()
        for _ in range(steps):
            for micro in range(s.grad_accum):
                x, y = self._batch(self.train_idx, s.batch_size)
                sync = micro == s.grad_accum - 1
                with contextlib.nullcontext() if sync else self.model.no_sync():
                    loss, _ = self.workload.loss(self.model, x, y)
                    (loss / s.grad_accum).backward()
                total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if self.world > 1:
            dist.all_reduce(total)
        return {"loss": float(total[0] / total[1]), "steps": steps, "samples_seen": int(total[1]), "train_s": seconds}

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        d = self.workload.data
        acc = torch.zeros(3, dtype=torch.float64)
        for chunk in self.val_idx.split(256):
            loss, correct = self.workload.loss(self.module, d.val_x[chunk], d.val_y[chunk])
            acc += torch.tensor([loss.item() * len(chunk), len(chunk), max(correct, 0)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(acc)
        out = {"eval_loss": float(acc[0] / max(acc[1], 1)), "num_val_examples": int(acc[1])}
        if self.workload.data.val_y.dtype == torch.long and self.workload.data.val_y.dim() == 1:
            out["eval_accuracy"] = float(acc[2] / max(acc[1], 1))
        return out

    def rank_digests(self) -> list[str]:
        """A digest of every rank's weights: equal digests prove the ranks stayed in lock-step."""
        mine = hashlib.sha256(parameters_to_vector(self.tensors).detach().numpy().tobytes()).hexdigest()[:16]
        if self.world == 1:
            return [mine]
        out: list = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def _pack_update(self, arrays: dict[str, np.ndarray], kind: str, round_no: int) -> handoff.Handle:
        handle, views = handoff.allocate(self.spec, tag=f"{self.cfg.site.id}-update")
        with torch.no_grad():
            for t, name in zip(self.tensors, self.names):
                out = torch.from_numpy(views[name])
                if kind == "delta":
                    torch.sub(t, torch.from_numpy(arrays[name]), out=out)
                else:
                    out.copy_(t)
        if self.cfg.site.dump_updates:
            dump = Path(self.cfg.workdir) / "updates"
            dump.mkdir(parents=True, exist_ok=True)
            np.savez(dump / f"round_{round_no:04d}.npz", **views)
        return handle

    def run_command(self, method: str, request: dict, arrays: dict[str, np.ndarray] | None) -> dict:
        """Executed by every rank in lock-step; rank 0 (which holds `arrays`) builds the answer."""
        t0 = time.perf_counter()
        self._load_global(arrays)
        load_s = time.perf_counter() - t0
        if method == "Evaluate":
            return {"ok": True, "metrics": {**self.evaluate(), "load_s": load_s}, "num_examples": int(len(self.workload.data.val_y))}
        rc = request.get("config", {})
        steps = int(rc.get("local_steps", self.cfg.site.local_steps))
        metrics = self.train(steps)
        digests = self.rank_digests()
        if self.rank != 0:
            return {}
        t1 = time.perf_counter()
        handle = self._pack_update(arrays, str(rc.get("update_kind", "delta")), int(request.get("round", 0)))
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
            "num_examples": int(len(self.workload.data.train_y)),
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
                cmd = self._next_command()
                if cmd is None:
                    continue
                method, request, fut, arrays = cmd
                reply = self.run_command(method, request, arrays)
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
        """Rank 0 takes the next request (or a heartbeat) and tells every rank what to run."""
        if self.rank == 0:
            try:
                method, request, fut = self.commands.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                method, request, fut = "Heartbeat", {}, None
            arrays = None
            if method != "Heartbeat":
                handoff.release(self.last_reply)  # the previous reply has been read by now
                handoff.release(self.last_state)
                self.last_reply = self.last_state = None
                try:
                    if fut.cancelled():
                        raise RequestRejected("the caller gave up before the request was taken")
                    arrays = self._validated_global(request)
                except RequestRejected as err:
                    if not fut.cancelled():
                        fut.set_result({"ok": False, "error": f"site {self.cfg.site.id}: {err}"})
                    method, request, fut = "Heartbeat", {}, None
            header = [method, {k: v for k, v in request.items() if k != "global"} if method != "Heartbeat" else {}]
        else:
            header = [None, None]
        if self.world > 1:
            dist.broadcast_object_list(header, src=0)
        if header[0] == "Heartbeat":
            return None
        if self.rank == 0:
            return method, request, fut, arrays
        return header[0], header[1], None, None


def run(cfg: TrainerConfig) -> None:
    """Join (or form) the process group from torchrun's environment and serve until told to stop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not dist.is_initialized():
        if cfg.site.backend == "nccl" and not torch.cuda.is_available():
            raise SystemExit(f"site {cfg.site.id}: backend 'nccl' needs CUDA GPUs; use backend 'gloo' on CPU")
        dist.init_process_group(cfg.site.backend, timeout=PG_TIMEOUT)
    def on_term(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        TrainerService(cfg).serve_forever()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m site_trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="TrainerConfig JSON written by `sovfl site`/`sovfl simulate`")
    args = parser.parse_args(argv)
    cfg = TrainerConfig.model_validate_json(Path(args.config).read_text())
    torch.set_num_threads(int(os.environ.get("SOVFL_TORCH_THREADS", "1")))
    run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
