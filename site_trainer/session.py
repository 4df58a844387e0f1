"""The session: one collective API that every rank of a site calls, for any training loop.

    from site_trainer import update_pack, session

    sess = session.connect(model, optimizer=opt)         # every rank, after building its model
    for rnd in sess.rounds():                            # every rank: the same rounds, in lock-step
        if rnd.evaluating:
            loss, n = my_eval(model)
            rnd.report(num_examples=n, loss=loss)        # this rank's figures
            continue
        for _ in range(rnd.local_steps):
            ...                                          # the script's own steps (DDP, FSDP2, ...)
        rnd.report(num_examples=n_seen, loss=mean_loss)  # every rank; the update is gathered here

The framework does the rank-divergent parts, so no rank ever waits on a call another rank did not
make (the hangs of rank-0-only client APIs, NVFlare issues 3360 and 5040): global rank 0 serves
the site's local endpoint (gRPC over a Unix socket, `endpoint.py`), takes each request, checks
it and broadcasts a small command; every rank then loads the global model into its own copy
(the whole tensor under DDP, its shard of FSDP2 DTensors), one tensor at a time
(`transfer.stream_in`), and `report` gathers the full tensors into rank 0's hand-off file
(`transfer.stream_out`). Only the exchanged tensors move (`layout.Layout`). While idle, rank 0
broadcasts heartbeats so that no collective reaches its timeout; `rounds()` ends on every rank
when the trainer is told to stop (SIGTERM, or the endpoint's Stop).

The built-in loop (`local_trainer.LocalTrainer`, which runs declarative tasks) is a user of this
same session. A script started by `sovfl` finds its configuration in $SOVFL_TRAINER_CONFIG.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from site_trainer import handoff, layout, strategies, transfer, update_files, update_pack
from site_trainer.command_loop import CommandLoop, _Request, open_global
from site_trainer.data_digest import snapshot as snapshot_fields
from site_trainer.command_loop import RequestRejected  # noqa: F401 - re-exported: part of the session's API
from site_trainer.local_checkpoints import LocalCheckpoints
from site_trainer.overlap import BackgroundStep, Overlap, background_budget
from site_trainer.config import SiteConfig, TrainerConfig
from site_trainer.launch import check_node_rank

log = logging.getLogger("sovfl.trainer")

ENV_CONFIG = "SOVFL_TRAINER_CONFIG"  # path of the TrainerConfig JSON the launcher wrote
ENV_NODE_RANK = "SOVFL_NODE_RANK"  # multi-node sites: this node's index (0 serves the endpoint)
PG_TIMEOUT = timedelta(minutes=10)


class SessionError(RuntimeError):
    """The training loop used the session wrongly (the message says how to fix it)."""


class StateHook(Protocol):
    """Per-rank state a local checkpoint keeps besides model and optimizer (sampling streams, ...)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# ---- process group ----------------------------------------------------------------------------

def site_config() -> TrainerConfig:
    """This site's trainer configuration (options, partition, ...), from $SOVFL_TRAINER_CONFIG: what a
    script reads before it builds its model and data."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        raise SessionError(f"no trainer configuration: ${ENV_CONFIG} is not set. Start the script through sovfl "
                           f"(workload.script), or set {ENV_CONFIG} to a trainer JSON and run it under torchrun")
    try:
        return TrainerConfig.model_validate_json(Path(path).read_text())
    except OSError as err:
        raise SessionError(f"${ENV_CONFIG}={path}: cannot read the trainer configuration ({err})") from None


def init_process_group(cfg: TrainerConfig, node_rank: int = 0) -> None:
    """Join the site's process group from torchrun's environment, ranks numbered by node.

    c10d's rendezvous orders nodes by host name and process id and ignores torchrun's --node-rank,
    so global ranks are numbered here (node_rank x ranks + local rank): global rank 0, the one
    serving the endpoint, is on node 0 whatever order the nodes joined in.
    """
    site = cfg.site
    gpu = {"device_id": _bind_gpu(site)} if site.backend == "nccl" else {}
    if site.nnodes == 1:
        dist.init_process_group(site.backend, timeout=PG_TIMEOUT, **gpu)
        return
    rank = node_ordered_rank(site, node_rank)
    dist.init_process_group(site.backend, rank=rank, world_size=site.world_size, timeout=PG_TIMEOUT, **gpu)


def node_ordered_rank(site: SiteConfig, node_rank: int) -> int:
    """This process's global rank on a multi-node site, after checking torchrun formed the site."""
    try:
        check_node_rank(site, node_rank)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    world = int(os.environ["WORLD_SIZE"])
    if world != site.world_size or int(os.environ["LOCAL_WORLD_SIZE"]) != site.ranks:
        raise SystemExit(f"site {site.id}: torchrun formed {world} rank(s) with {os.environ['LOCAL_WORLD_SIZE']} "
                         f"per node, the config says {site.nnodes} node(s) x {site.ranks}")
    return node_rank * site.ranks + int(os.environ["LOCAL_RANK"])


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


# ---- rounds -----------------------------------------------------------------------------------

class Round:
    """One request from the coordinator, the same object on every rank.

    The global weights are already in the model when the loop body starts. Call `report` exactly
    once, on every rank, when the round's work is done.
    """

    def __init__(self, session: "Session", kind: str, request: dict, load_s: float):
        self._session = session
        self.kind = kind  # "train" or "evaluate"
        self.number = int(request.get("round", 0))
        self.config: dict = dict(request.get("config") or {})
        self.local_steps = int(self.config.get("local_steps", session.config.site.local_steps))
        self.load_s = load_s
        # steps of this round already taken in the background and folded in (site_trainer/overlap.py):
        # the loop trains local_steps - background_steps more
        self.background_steps = 0
        self.reported = False
        # site figures the loop adds to the reply as they are (rank 0's); the steps this round was given
        self.figures: dict[str, float] = {"local_steps": float(self.local_steps)}
        self._started = time.perf_counter()

    @property
    def evaluating(self) -> bool:
        """An evaluation request: measure the global model, do not train (nothing is sent back)."""
        return self.kind == "evaluate"

    def report(self, num_examples: int, loss: float | torch.Tensor | None = None,
               **metrics: float | torch.Tensor) -> None:
        """Collective: this rank's figures for the round; after training, the update leaves here.

        `num_examples` is this rank's count (summed over ranks: the site's weight in the average);
        `loss` and every other metric are this rank's means, averaged over ranks weighted by
        `num_examples`. Values may be Python numbers or 0-dim tensors (on the GPU: no sync until
        here). An evaluation must report `loss`; it is sent as `eval_loss`, `accuracy` as
        `eval_accuracy`, any other key K as `eval_K`.
        """
        if self.reported:
            raise SessionError(f"round {self.number} was reported twice; call report() once per round")
        self.reported = True
        self._session._finish(self, num_examples, loss, metrics)


    def refuse(self, reason: str) -> None:
        """Collective: answer this training round with `reason` instead of training it (the built-in
        loop's DP budget); nothing is sent back, and the coordinator leaves the site out of the round."""
        if self.reported:
            raise SessionError(f"round {self.number} was reported twice; call report() or refuse() once per round")
        self.reported = True
        self._session._refuse(self, reason)


def _wire_read(source: Mapping[str, np.ndarray]):
    """A `transfer.ReadInto` over named arrays: a hand-off Reader (pread straight into the
    destination when the dtypes agree) or any mapping of arrays; a float32 global of a bf16
    tensor is converted on the way."""
    def read(name: str, out: np.ndarray) -> None:
        if isinstance(source, handoff.Reader) and source.handle_entry(name).dtype == out.dtype.str:
            source.read_into(name, out)
            return
        arr = np.asarray(source[name])
        if arr.dtype == out.dtype:
            out[...] = arr
        else:
            dst = torch.from_numpy(out)
            raw = {np.dtype("<u2"): torch.bfloat16}.get(out.dtype)
            (dst.view(raw) if raw is not None else dst).copy_(torch.as_tensor(arr))
    return read


def _ranges(reader: handoff.Reader) -> transfer.RangesOf:
    """A tensor's byte-range reader from the hand-off file, where it travels in the dtype it loads as."""
    def of(name: str, wire: np.dtype) -> transfer.ReadRange | None:
        if reader.handle_entry(name).dtype != wire.str:
            return None
        return lambda start, out: reader.read_range(name, start, out)
    return of


class Session:
    """A site's connection to the federation, shared by every rank (see the module docstring).

    Use `connect()` from a script; `local_trainer.LocalTrainer` builds one for declarative tasks.
    """

    def __init__(self, model: nn.Module, config: TrainerConfig, *, exchanged: Sequence[str] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, state: StateHook | None = None,
                 frozen: layout.FrozenDigest | None = None, num_examples: int | None = None,
                 num_val_examples: int | None = None, device: torch.device | None = None,
                 describe: dict | None = None, site_metrics: Mapping[str, float] | None = None,
                 data_snapshot: Mapping[str, Any] | None = None):
        if not dist.is_initialized():
            raise SessionError("torch.distributed is not initialized: call session.connect(), which joins the "
                               "site's process group, or dist.init_process_group() first")
        self.config = config
        self.model = model
        self.module = layout.unwrap(model)
        self.optimizer = optimizer
        self.state = state
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device or strategies.device_for(config.site.backend)
        self.layout = layout.Layout.of(self.module, layout.default_exchanged(self.module) if exchanged is None
                                       else exchanged)
        if not self.layout.exchanged:
            raise SessionError("nothing to exchange: the model has no trainable parameters (or exchanged is empty)")
        self.frozen = frozen if frozen is not None else self._hash_frozen()
        self.manifest = self.layout.manifest(self.frozen)
        self.num_examples, self.num_val_examples = num_examples, num_val_examples
        self.describe = dict(describe or {})
        # Figures of the site rather than of a round (the PII scrubber's counts per entity type), added
        # by rank 0 to every train reply as they are: numbers only, never text.
        self.site_metrics = {str(k): float(v) for k, v in (site_metrics or {}).items()}
        # rank 0: what the site trains on (data_digest.py), for its audit log: in the discovery answer and
        # the first train answer of this process (a restarted trainer may have read other data)
        self.data_snapshot, self._snapshot_told = dict(data_snapshot or {}), False
        self.reply_listeners: list[Callable[[int, dict], None]] = []  # rank 0: (round, a train reply's metrics)
        self.rounds_reported = 0
        self.last_files: list[str | None] = []
        self.ckpt_due: int | None = None  # rank 0: the round the next local checkpoint covers
        self.trained_round = 0  # the newest round trained (a local checkpoint's round after a resume)
        self._current: _Request | None = None
        # federation.overlap: steps between a reply and the next request (site_trainer/overlap.py)
        self.overlap = Overlap()
        self._last_reply: float | None = None  # rank 0: when the last train reply was answered
        self._overlap_warned = False
        self.loop = CommandLoop(self)  # rank 0's request pump, every rank's next command
        self.checkpoints = LocalCheckpoints(self)
        # rank 0: the update's files, kept and mapped for the trainer's life (update_files.py)
        self.update_files = update_files.UpdateFiles(f"{self.site}-update") if self.rank == 0 else None
        if self.rank == 0:  # update files of this site's killed predecessors (never released)
            for path in handoff.sweep_stale(f"{self.site}-update"):
                log.info("site %s: removed the hand-off file %s of a trainer that no longer runs", self.site, path)
        if config.site.checkpoint_every:
            self.resume()

    @property
    def site(self) -> str:
        return self.config.site.id

    @property
    def options(self) -> dict[str, Any]:
        """This site's workload options (workload.options with the site's workload_options merged)."""
        return self.config.options

    def keep_training(self, step: BackgroundStep) -> None:
        """Let the ranks train between a reply and the next request when the round asks for it
        (federation.overlap): `step(round_no, first)` is one collective optimizer step of round
        `round_no` (`first`: the first of this gap: place the schedule and batch stream there). The
        built-in loop registers its own; without one, the ranks wait as before."""
        self.overlap.step_fn = step

    def run_background(self, steps: int) -> int:
        """Collective: up to `steps` background steps now, as the served loop takes them between
        requests (tools and tests); returns how many were taken."""
        n = max(0, min(steps, self.overlap.budget - self.overlap.steps)) if self.overlap.pending else 0
        if n:
            self.overlap.run(n)
        return n

    # ---- the exchanged tensors -----------------------------------------------------------
    def _entries(self) -> list[transfer.Entry]:
        tensors = layout.named_tensors(self.module)
        return [(name, tensors[name]) for name in self.layout.names]

    def _hash_frozen(self) -> layout.FrozenDigest:
        """Collective: fingerprint the frozen tensors of a model the caller built (one pass)."""
        digest = layout.FrozenDigest()
        tensors = layout.named_tensors(self.module)
        with torch.no_grad():
            for name in self.layout.frozen:
                t = tensors[name]
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if self.rank == 0:
                    digest.update(name, full)
        return digest

    def load(self, source: Mapping[str, np.ndarray] | None) -> dict[str, str]:
        """Collective: the exchanged tensors from `source` (rank 0: a hand-off Reader or arrays by
        name; None elsewhere) into every rank's model. Returns {name: why} of refused tensors."""
        read = _wire_read(source) if self.rank == 0 else None
        ranges = _ranges(source) if self.rank == 0 and isinstance(source, handoff.Reader) else None
        return transfer.stream_in(self._entries(), read, self.device, ranges=ranges)

    def gather(self, visit=None, piecewise: bool = False) -> list[str]:
        """Collective: walk the full exchanged tensors (rank 0 passes `visit(name, cpu_tensor)`, or
        with `piecewise` `visit(name, flat, lo, hi)` from several threads); returns every rank's
        digest (see `transfer.stream_out`)."""
        mine = transfer.stream_out(self._entries(), visit, self.device, piecewise)
        if self.world == 1:
            return [mine]
        out: list = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def full_state(self) -> dict[str, np.ndarray]:
        """Collective: the exchanged tensors as they travel, on rank 0 ({} elsewhere)."""
        out: dict[str, np.ndarray] = {}
        keep = (lambda n, t: out.__setitem__(n, layout.to_wire(t).copy())) if self.rank == 0 else None
        self.gather(keep)
        return out

    # ---- rank 0: endpoint side -----------------------------------------------------------
    def info(self) -> dict:
        return {
            "ok": True,
            "site": self.site,
            "workdir": self.config.workdir,  # the relay keeps the downlink reference model there
            "workload": self.config.workload.name,
            "ranks": self.world,
            "parallelism": self.config.site.parallelism,
            "device": str(self.device),
            "num_examples": int(self.num_examples or 0),
            "num_val_examples": int(self.num_val_examples or 0),
            "spec": {n: [d, list(shape)] for n, (d, shape) in self.layout.wire_spec().items()},
            "manifest": self.manifest,
            "data_snapshot": self.data_snapshot,
            # federation.overlap: background steps taken since the last reply, of how many allowed
            "background_steps": self.overlap.steps, "background_budget": self.overlap.budget,
            **self.describe,
        }

    def handle(self, method: str, request: dict) -> dict:
        """Called on gRPC threads: queue the work for the ranks' loop and wait for its answer."""
        return self.loop.handle(method, request)

    def open_global(self, request: dict) -> handoff.Reader:
        """Rank 0: the request's global model, its layout checked (`command_loop.open_global`)."""
        return open_global(request, self.layout)

    # ---- all ranks: the loop ---------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to end after the current round (any rank may call it; rank 0's call counts)."""
        self.loop.stop_requested = True

    def rounds(self) -> Iterator[Round]:
        """Collective: the coordinator's requests, the same on every rank, until the trainer is stopped.

        Serves the endpoint (rank 0) from the first iteration; SIGTERM ends the loop cleanly on
        every rank once the current round is answered.
        """
        return self.loop.rounds()

    def serve_one(self, method: str, request: dict, body) -> dict:
        """Collective: one request, handed over in-process instead of through the endpoint (every
        rank passes the same `request`; tools and benchmarks): the same load, `body(round)` and
        reply as a served request. Returns the reply on rank 0, {} elsewhere."""
        return self.loop.serve_one(method, request, body)

    def _begin(self, req: _Request, kind: str) -> Round | None:
        """Collective: load the global model; None (the request answered) when it is refused. A
        round trained again (the coordinator resumed and reruns the round in flight) first rewinds
        the local state to before it (`rewind`)."""
        t0 = time.perf_counter()
        entries = self._entries()
        self.overlap.freeze(entries)  # background progress stops here; loading w overwrites the weights
        if kind == "train":
            self.rewind(int(req.request.get("round", 0)))
        refused = self.load(req.reader)
        if refused:
            if self.rank == 0:
                what = "; ".join(f"global tensor {n} {why}" for n, why in list(refused.items())[:3])
                req.answer({"ok": False, "error": f"site {self.site}: {what}"})
            req.close()
            return None
        self._current = req
        if kind == "train" and self.rank == 0:  # the update's file, made ready while the round trains
            req.update = self._round_writer()
            if req.reader is not None and (req.request.get("config") or {}).get("update_kind", "delta") == "delta":
                req.premapped = handoff.Premapped(req.reader.handle)
        rnd = Round(self, kind, req.request, time.perf_counter() - t0)
        if kind == "train":
            rnd.background_steps, discarded, seconds = self.overlap.fold(entries, rnd.number)
            if rnd.config.get("overlap") or rnd.background_steps or discarded:
                rnd.figures.update(background_steps=rnd.background_steps, background_s=seconds)
            if discarded:
                rnd.figures["overlap_discarded_steps"] = discarded
                if self.rank == 0:
                    log.info("site %s: %d background step(s) discarded: round %d is not the round they were "
                             "taken for", self.site, discarded, rnd.number)
        return rnd

    def _end(self, rnd: Round, closing: bool = False) -> None:
        req, self._current = self._current, None
        if req is None:
            return
        why = "failed in report()" if rnd.reported else \
            "ended without report(); the training loop must call rnd.report(...) on every rank"
        req.answer({"ok": False, "error": f"site {self.site}: round {rnd.number} {why}"})  # if still unanswered
        req.close()
        if not rnd.reported and not closing:
            raise SessionError(f"round {rnd.number} ({rnd.kind}) ended without rnd.report(...); call it once per "
                               "round, on every rank, before taking the next round")

    # ---- all ranks: the end of a round -------------------------------------------------------
    def _combine(self, num_examples: int, loss, metrics: dict, need_loss: bool = False
                 ) -> tuple[int, dict[str, float]]:
        """Collective: examples summed over ranks; loss and metrics averaged weighted by examples.

        Every rank first shares whether its report is usable (and its metric names), so that a bad
        report on one rank raises the same SessionError on every rank instead of leaving the others
        waiting in the reduction."""
        values = {**({"loss": loss} if loss is not None else {}), **metrics}
        keys = sorted(values)
        problem, parts = None, []
        if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)) or num_examples < 0:
            problem = f"report(num_examples={num_examples!r}): give this rank's example count, an int >= 0"
        elif need_loss and loss is None:
            problem = "an evaluation round must report loss=... (the coordinator averages eval_loss)"
        else:
            n = torch.tensor(float(num_examples), dtype=torch.float64, device=self.device)
            parts.append(n)
            for k in keys:
                v = values[k]
                try:
                    v = v.detach().to(self.device, torch.float64).reshape(()) if isinstance(v, torch.Tensor) \
                        else torch.tensor(float(v), dtype=torch.float64, device=self.device)
                except (TypeError, ValueError, RuntimeError):
                    problem = f"report({k}={values[k]!r}): metrics must be numbers or 1-element tensors"
                    break
                parts.append(torch.where(n > 0, v * n, torch.zeros_like(v)))
        every: list = [(keys, problem)]
        if self.world > 1:
            every = [None] * self.world
            dist.all_gather_object(every, (keys, problem))
        bad = [f"rank {r}: {p}" for r, (_, p) in enumerate(every) if p]
        if bad:
            raise SessionError("; ".join(bad))
        if any(k != keys for k, _ in every):
            raise SessionError("ranks reported different metrics: " + "; ".join(
                f"rank {r}: {k}" for r, (k, _) in enumerate(every)) + "; report the same keys on every rank")
        total = torch.stack(parts)
        if self.world > 1:
            dist.all_reduce(total)
        total = total.cpu().tolist()
        count = total[0]
        return int(round(count)), {k: (s / count if count > 0 else 0.0) for k, s in zip(keys, total[1:])}

    def _refuse(self, rnd: Round, reason: str) -> None:
        req, self._current = self._current, None
        if req is None:
            return
        if self.rank == 0:
            req.answer({"ok": False, "error": f"site {self.site}: {reason}", "refused": True})
        req.close()

    def _finish(self, rnd: Round, num_examples: int, loss, metrics: dict) -> None:
        count, means = self._combine(num_examples, loss, metrics, need_loss=rnd.evaluating)
        req = self._current
        if rnd.evaluating:
            out = {f"eval_{k}" if not k.startswith("eval_") else k: v for k, v in means.items()}
            out.update(num_val_examples=count, load_s=rnd.load_s)
            if self.rank == 0:
                self.num_val_examples = count
                req.answer({"ok": True, "metrics": out, "num_examples": count})
            return
        means.setdefault("train_s", time.perf_counter() - rnd._started)
        t1 = time.perf_counter()
        handle, digests = self._pack_update(req, str(rnd.config.get("update_kind", "delta")), rnd.number)
        self.rounds_reported += 1
        self.trained_round = rnd.number
        if self.rank != 0:
            self._after_reply(rnd)
            return
        self.num_examples = count
        every = self.config.site.checkpoint_every
        if every and self.rounds_reported % every == 0:
            self.ckpt_due = rnd.number  # written before the next request is taken
        means.update(load_s=rnd.load_s, pack_s=time.perf_counter() - t1, **self.site_metrics, **rnd.figures)
        means.update(self._idle_figures())
        self.last_files = [] if handle.owned else [handle.path]  # an owned file stays for the next rounds
        told, self._snapshot_told = self._snapshot_told, True
        req.answer({"ok": True, "update": handle.to_json(), "num_examples": count, "metrics": means,
                    "rank_digests": digests, **({} if told or not self.data_snapshot else {"data_snapshot": self.data_snapshot})})
        for listener in self.reply_listeners:  # the site's own trackers: what was just sent, nothing more
            listener(rnd.number, dict(means))
        self._after_reply(rnd)  # the weights just sent, kept after the reply left (not on its path)

    def _idle_figures(self) -> dict[str, float]:
        """Rank 0, at a train reply: the seconds the ranks waited for a command since the previous
        train reply and their share of that span (none at the first reply of this trainer)."""
        now, last = time.monotonic(), self._last_reply
        idle, self.loop.idle_s, self._last_reply = self.loop.idle_s, 0.0, now
        if last is None or now <= last:
            return {}
        return {"idle_s": idle, "idle_fraction": min(1.0, idle / (now - last))}

    def _after_reply(self, rnd: Round) -> None:
        """Collective (local on each rank): with the round's `overlap`, remember the weights just sent
        and let background steps start (up to the round's local_steps times its
        `overlap_max_steps_factor`)."""
        if not rnd.config.get("overlap"):
            self.overlap.clear()
            return
        if self.overlap.step_fn is None:
            if self.rank == 0 and not self._overlap_warned:
                log.warning("site %s: the round asks for overlap, but this site's loop registered no background "
                            "step (a script's session): its ranks wait between rounds", self.site)
            self._overlap_warned = True
            return
        factor = rnd.config.get("overlap_max_steps_factor", 1.0)
        self.overlap.sent(self._entries(), rnd.number, background_budget(rnd.local_steps, factor))

    def _update_writer(self, tag: str, allocate: bool = False) -> handoff.Writer:
        return handoff.Writer(self.layout.wire_spec(), tag=f"{self.site}-{tag}", allocate=allocate)

    def _round_writer(self) -> handoff.Writer | update_files.OwnedWriter:
        """Rank 0: one of the trainer's own update files no reader holds, else a one-off file."""
        return self.update_files.writer_or_one_off(self.layout.wire_spec(),
                                                   lambda: self._update_writer("update", allocate=True))

    def close_files(self) -> None:
        """Rank 0: unlink the trainer's update files (its shutdown; readers holding one open keep it)."""
        if self.update_files is not None:
            self.update_files.close()

    def _write_exchanged(self, writer: handoff.Writer | None,
                         put: Callable[[handoff.Writer], transfer.PieceVisit]
                         ) -> tuple[handoff.Handle | None, list[str]]:
        """Collective: stream the exchanged tensors into rank 0's hand-off file `writer` (None on the
        other ranks), one tensor at a time, each written a piece at a time by `put(writer)(name,
        flat, lo, hi)`; (its handle on rank 0, every rank's digest)."""
        try:
            digests = self.gather(put(writer) if writer is not None else None, piecewise=True)
        except BaseException:
            if writer is not None:  # no reply will name this file: free it (an owned one: for the next round)
                writer.abandon()
            raise
        if writer is not None:
            writer.close()
        return (writer.handle if writer is not None else None), digests

    def _export(self, fut: Future | None) -> None:
        """Collective: the exchanged tensors as they are now, as they travel, in a hand-off file the
        caller (rank 0's `fut`) reads and unlinks. At discovery it is how a site shows it already
        holds the coordinator's starting model, which round 1 then does not send (federation's
        downlink, site/downlink_mod.py `offer_held`)."""
        handle, _ = self._write_exchanged(self._update_writer("export") if self.rank == 0 else None,
                                          lambda writer: update_pack.UpdatePacker(writer, {}, None).weights_piece)
        if handle is None:
            return
        self.last_files.append(handle.path)  # unlinked at the next round if the caller is gone
        if fut is None or fut.cancelled():
            handoff.release(handle.path)
            return
        fut.set_result({"ok": True, "model": handle.to_json()})

    def _pack_update(self, req: _Request, kind: str, round_no: int) -> tuple[handoff.Handle | None, list[str]]:
        """Collective: stream the exchanged tensors into rank 0's hand-off file (weights, or the delta
        from the global model it read), one tensor at a time, each written once in its wire dtype
        (`update_pack`); every rank gets every rank's digest."""
        def put(writer: handoff.Writer) -> transfer.PieceVisit:
            mapped = req.premapped.arrays() if req.premapped is not None else None
            packer = update_pack.UpdatePacker(writer, {s.name: s for s in self.layout.exchanged}, req.reader, mapped)
            return packer.delta_piece if kind == "delta" else packer.weights_piece

        writer = None
        if self.rank == 0:  # the file allocated while the round trained (a new one if the round has none)
            writer, req.update = req.update or self._round_writer(), None
        handle, digests = self._write_exchanged(writer, put)
        if handle is not None and self.config.site.dump_updates:
            dump = Path(self.config.workdir) / "updates"
            dump.mkdir(parents=True, exist_ok=True)
            np.savez(dump / f"round_{round_no:04d}.npz", **handoff.map_arrays(handle))
        return handle, digests

    # ---- local checkpoints (local_checkpoints.py) ----------------------------------------
    def save_checkpoint(self, round_no: int) -> Path:
        """Collective: a sharded checkpoint of everything a resumed rank needs."""
        return self.checkpoints.save(round_no)

    def resume(self) -> int | None:
        """Collective: restore the newest local checkpoint if there is one (`LocalCheckpoints.resume`)."""
        return self.checkpoints.resume()

    def rewind(self, round_no: int) -> None:
        """Collective: before training `round_no` again, restore the local checkpoint of the round
        before it (`LocalCheckpoints.rewind`)."""
        self.checkpoints.rewind(round_no)


def connect(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
            exchanged: Sequence[str] | None = None, state: StateHook | None = None,
            num_examples: int | None = None, config: TrainerConfig | None = None,
            data_digest: str | None = None) -> Session:
    """Collective: join the federation from a torchrun script; every rank calls it with its model.

    `model` may be a plain module, DDP-wrapped, or sharded by FSDP2's `fully_shard` (DTensors):
    the session loads the global weights into it and gathers the update from it. `exchanged`
    names the tensors that travel (state-dict names; default: the trainable parameters), which
    must match the coordinator's model (workload.model). With `optimizer` (and `state`, anything
    with state_dict/load_state_dict) the session's local checkpoints (site.checkpoint_every) keep
    and restore them. `num_examples` is the site's training-set size the coordinator sees at
    discovery (SecAgg weights); by default the count of the last training report. `data_digest`
    names the data this site trains on (e.g. the SHA-256 of its files, see
    site_trainer/data_digest.py): the site's audit log records it; without it the log says the
    data is undeclared.

    The configuration comes from $SOVFL_TRAINER_CONFIG (set when sovfl starts the script); the
    process group is joined here unless the script did it already.
    """
    cfg = config or site_config()
    if not dist.is_initialized():
        init_process_group(cfg, int(os.environ.get(ENV_NODE_RANK, "0")))
    if dist.get_world_size() != cfg.site.world_size:
        raise SessionError(f"site {cfg.site.id}: the process group has {dist.get_world_size()} rank(s), the site "
                           f"config says {cfg.site.world_size}; start the script with torchrun "
                           f"--nproc-per-node={cfg.site.ranks}")
    return Session(model, cfg, exchanged=exchanged, optimizer=optimizer, state=state, num_examples=num_examples,
                   describe={"loop": "script"},
                   data_snapshot=snapshot_fields(data_digest, "script", num_examples or 0, 0))
