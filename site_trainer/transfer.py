"""Full tensors between rank 0's host memory and every rank's replica or shard, one at a time.

`stream_in`: rank 0 fills each tensor (from the relay's hand-off file, or from its own real build
of the model) and broadcasts it; every rank keeps what it holds: the whole tensor (ddp, buffers)
or its dim-0 shard (zero2/zero3). `stream_out`: every rank assembles each full tensor (all-gather
under ZeRO), rank 0 passes it on (to the update's hand-off file), and every rank hashes what it
assembled. Whatever the parallelism, no rank holds more of the full model than the tensors in
flight (at most two).

Cheap on purpose, because the hand-off sits between every two rounds. Rank 0's copies run on the
hand-off's worker threads (WORKERS, started once), PIECE_BYTES at a time, each torch op on one
thread (`one_thread_per_op`; torch, numpy, pread and pwrite release the GIL):
- in: rank 0 reads each tensor straight into its destination (on the CPU, the parameter itself;
  on a GPU, a pinned staging buffer copied asynchronously, double-buffered) while the previous
  tensor's broadcast is still travelling; finiteness is checked as each tensor arrives (one
  min/max reduction, flags read once at the end; on the CPU per piece, by the thread that read
  it, while it is in the cache; there the next tensor's reads start before the current one lands);
- out: on a GPU each tensor is copied to pinned memory asynchronously; each piece is digested
  (`weights_digest`, at memory speed) and, on rank 0, packed (`update_pack`: the update written
  once, in its wire dtype) by one job, overlapping the next tensor's all-gather and copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from site_trainer import layout
from site_trainer.weights_digest import WeightsDigest, fold

PIECE_BYTES = 2 * 2**20  # what one job moves (a multiple of weights_digest.BLOCK_BYTES)
WORKERS = max(2, min(4, os.cpu_count() or 2))  # the hand-off's threads on rank 0's host

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The hand-off's WORKERS threads, started once (inside `one_thread_per_op`, so their torch ops
    stay single-threaded) and reused: a thread's start waits for the scheduler, which on a busy
    host takes a while."""
    global _POOL
    if _POOL is None:
        with one_thread_per_op():
            _POOL = ThreadPoolExecutor(WORKERS, "sovfl-handoff")
            for fut in [_POOL.submit(torch.zeros, 1) for _ in range(WORKERS)]:
                fut.result()
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)


Entry = tuple[str, torch.Tensor]  # (state-dict name, the tensor the module holds: plain or DTensor)
ReadInto = Callable[[str, np.ndarray], None]  # rank 0: fill this wire-dtype array with tensor `name`
ReadRange = Callable[[int, np.ndarray], None]  # rank 0: a tensor's bytes from this offset into this uint8 array
RangesOf = Callable[[str, np.dtype], "ReadRange | None"]  # a tensor's range reader, if it can be read so


class _Staging:
    """Two reusable host buffers for a GPU's copies (pinned: asynchronous and about twice as fast
    as pageable memory); on the CPU there is nothing to stage."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._ready: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A free buffer of at least `nbytes` (waits until its last asynchronous copy is done)."""
        i, self._next = self._next, 1 - self._next
        if self._ready[i] is not None:
            self._ready[i].synchronize()
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.cuda)
        return i, buf[:nbytes]

    def mark(self, i: int) -> torch.cuda.Event | None:
        """Buffer `i` is in use by an asynchronous copy issued just now; returns its completion event."""
        if not self.cuda:
            return None
        ev = self._ready[i] = torch.cuda.Event()
        ev.record()
        return ev


def _as_dtype(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _keep(local_target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy what this rank holds of `full` into `local_target` (the module's tensor)."""
    if isinstance(local_target, DTensor):
        local = local_target.to_local()
        placements = local_target.placements
        if all(isinstance(p, Shard) and p.dim == 0 for p in placements) and local_target.device_mesh.ndim == 1:
            rank, world = local_target.device_mesh.get_local_rank(), local_target.device_mesh.size()
            chunks = full.chunk(world, dim=0)  # FSDP2's layout: torch.chunk's dim-0 pieces over the mesh
            mine = chunks[rank] if rank < len(chunks) else full[:0]
            if mine.shape != local.shape:
                raise RuntimeError(f"shard layout mismatch: rank {rank} of {world} holds {tuple(local.shape)} of "
                                   f"{tuple(full.shape)}, expected {tuple(mine.shape)}")
            local.copy_(mine)
        else:  # other meshes and placements: let DTensor cut this rank's part (no communication)
            from torch.distributed.tensor import distribute_tensor

            local.copy_(distribute_tensor(full, local_target.device_mesh, placements, src_data_rank=None).to_local())
    elif full is not local_target:
        local_target.copy_(full)


class _FiniteChecks:
    """Rank 0's flags of tensors holding a NaN or an Inf, one min/max reduction per tensor (NaN
    propagates through it) on the tensor's device. On the CPU each check runs on a worker thread
    while the next tensor is read (torch releases the GIL), at most two pending."""

    def __init__(self, count: int, device: torch.device, on: bool):
        self.flags = torch.zeros(count, dtype=torch.bool, device=device) if on else None
        self._pool = ThreadPoolExecutor(1, "sovfl-check") if on and device.type == "cpu" else None
        self._pending: list[Future] = []

    def _flag(self, i: int, t: torch.Tensor) -> None:
        if t.numel() and t.is_floating_point():
            lo, hi = torch.aminmax(t)
            self.flags[i] = ~(torch.isfinite(lo) & torch.isfinite(hi))

    def check(self, i: int, t: torch.Tensor) -> None:
        if self.flags is None:
            return
        if self._pool is None:
            self._flag(i, t)
            return
        self._pending.append(self._pool.submit(self._flag, i, t))
        if len(self._pending) > 2:
            self._pending.pop(0).result()

    def mark(self, i: int) -> None:
        """Tensor `i` was found not finite (checked elsewhere)."""
        if self.flags is not None:
            self.flags[i] = True

    def flagged(self) -> list[int]:
        """The indices of the tensors that are not finite (waits for the pending checks)."""
        while self._pending:
            self._pending.pop(0).result()
        return [] if self.flags is None else torch.nonzero(self.flags.cpu()).flatten().tolist()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _nonfinite(t: torch.Tensor) -> bool:
    if not t.numel() or not t.is_floating_point():
        return False
    lo, hi = torch.aminmax(t)
    return not bool(torch.isfinite(lo) & torch.isfinite(hi))


def _read_piece(read: ReadRange, raw: np.ndarray, flat: torch.Tensor | None, lo: int, hi: int, esz: int) -> bool:
    """Bytes of elements [lo, hi) into `raw` (the destination's bytes); with `flat` (the destination
    on the CPU), whether that piece holds a NaN or an Inf, checked while it is in the cache."""
    read(lo * esz, raw[lo * esz:hi * esz])
    return flat is not None and _nonfinite(flat[lo:hi])


def _start_pieces(read: ReadRange, raw: np.ndarray, flat: torch.Tensor | None, esz: int) -> list[Future]:
    """The destination's bytes `raw` read a piece at a time on the hand-off's workers (`_landed`)."""
    return [_pool().submit(_read_piece, read, raw, flat, lo, hi, esz) for lo, hi in pieces(raw.size // esz, esz)]


def _landed(futs: list[Future]) -> bool:
    """Wait for a tensor's piece reads; whether any piece was not finite (an error is raised only
    once every job has ended: none still writes into the destination)."""
    wait(futs)
    return any([fut.result() for fut in futs])


@torch.no_grad()
def stream_in(entries: Sequence[Entry], read: ReadInto | None, device: torch.device, check_finite: bool = True,
              ranges: RangesOf | None = None) -> dict[str, str]:
    """Collective: every rank gets the tensors rank 0 reads with `read` (None on other ranks).
    `ranges(name, wire_dtype)`: where it gives a byte-range reader for a tensor, rank 0 reads that
    tensor a piece at a time on WORKERS threads (on the CPU checking each piece as it lands).

    Returns {name: reason} for tensors that were unreadable or not finite, the same on every rank
    (empty: all loaded). A rejected load leaves the model partly overwritten: the caller must load
    again before using it (every round request does).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = _Staging(device)
    unreadable: dict[str, str] = {}
    in_flight: list[tuple[dist.Work | None, torch.Tensor, torch.Tensor]] = []

    def finish(work: dist.Work | None, target: torch.Tensor, full: torch.Tensor) -> None:
        if work is not None:
            work.wait()
        _keep(target, full)

    checking = rank == 0 and check_finite
    ahead: dict[int, list[Future]] = {}  # rank 0, CPU: reads already on the workers, by tensor index

    def by_range(i: int) -> ReadRange | None:
        name, t = entries[i]
        return ranges(name, np.dtype(layout.wire_dtype(t.dtype))) if ranges is not None else None

    def read_ahead(i: int) -> None:
        """Start tensor i's reads now, while the previous one lands (rank 0 on the CPU, reading
        straight into a parameter: no memory beyond the model's own)."""
        if rank != 0 or device.type != "cpu" or i >= len(entries) or i in ahead:
            return
        t = entries[i][1]
        try:
            read_i = by_range(i)
        except (KeyError, ValueError):  # the tensor's own turn says what is wrong
            return
        if read_i is None or isinstance(t, DTensor) or t.device != device or not t.is_contiguous():
            return
        flat = t.detach().reshape(-1)
        ahead[i] = _start_pieces(read_i, layout.to_wire(flat).view(np.uint8), flat if checking else None,
                                 t.element_size())

    with contextlib.ExitStack() as stack:
        stack.enter_context(one_thread_per_op())
        checks = stack.enter_context(contextlib.closing(_FiniteChecks(len(entries), device, checking)))
        # past an error, no read still writes into a parameter (the first thing done on the way out)
        stack.callback(lambda: wait([fut for futs in ahead.values() for fut in futs]))
        for i, (name, t) in enumerate(entries):
            dtype, shape = t.dtype, tuple(t.shape)
            direct = not isinstance(t, DTensor) and t.device == device and t.is_contiguous()
            dest = t if direct else torch.empty(shape, dtype=dtype, device=device)
            if rank == 0:
                wire = layout.wire_dtype(dtype)
                rr = by_range(i)
                esz = dest.element_size()
                read_ahead(i)
                read_ahead(i + 1)
                try:
                    if i in ahead:
                        if _landed(ahead.pop(i)):
                            checks.mark(i)
                    elif device.type == "cpu" and rr is not None:  # a temporary full tensor (ZeRO)
                        flat = dest.detach().reshape(-1)
                        if _landed(_start_pieces(rr, layout.to_wire(flat).view(np.uint8), flat if checking else None,
                                                 esz)):
                            checks.mark(i)
                    elif device.type == "cpu":
                        read(name, layout.to_wire(dest.detach()))
                        checks.check(i, dest)
                    else:
                        j, raw = staging.take(dest.numel() * esz)
                        if rr is not None:
                            _landed(_start_pieces(rr, raw.numpy(), None, esz))
                        else:
                            read(name, raw.numpy().view(wire).reshape(shape))
                        dest.copy_(_as_dtype(raw, dtype, shape), non_blocking=True)
                        staging.mark(j)
                        checks.check(i, dest)
                except (OSError, ValueError, KeyError) as err:
                    unreadable[name] = f"cannot be read ({err})"
                    dest.zero_()  # the others wait for this broadcast: send something, then refuse the load
            # asynchronous: rank 0 reads the next tensor while this one travels (at most two in flight)
            in_flight.append((dist.broadcast(dest, src=0, async_op=True) if world > 1 else None, t, dest))
            if len(in_flight) == 2:
                finish(*in_flight.pop(0))
            del dest
        for item in in_flight:
            finish(*item)
        in_flight.clear()
        for i in checks.flagged():
            unreadable.setdefault(entries[i][0], "contains NaN or Inf")
    bad: list = [unreadable if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(bad, src=0)
    return bad[0]


@contextlib.contextmanager
def one_thread_per_op():
    """Torch ops single-threaded for a while (restored after): the hand-off's worker threads each
    run one op at a time on their own core; an op's own threads would wait at every op's barrier
    for the slowest of them, and on a busy host that one has lost its core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def pieces(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of PIECE_BYTES each (the last shorter; one empty range for an empty
    tensor): whole 4 KiB blocks but the last, so each piece's digest fold is the whole's."""
    step = max(1, PIECE_BYTES // max(element_size, 1))
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)] or [(0, 0)]


PieceVisit = Callable[[str, torch.Tensor, int, int], None]  # (name, the flat CPU tensor, lo, hi)


@torch.no_grad()
def stream_out(entries: Sequence[Entry], visit: Callable[[str, torch.Tensor], None] | PieceVisit | None,
               device: torch.device, piecewise: bool = False) -> str:
    """Collective under ZeRO: walk the full tensors in order, one CPU tensor at a time, calling
    `visit(name, tensor)` on each (rank 0 packs them); return this rank's digest. `piecewise`:
    `visit(name, flat, lo, hi)` on element ranges of PIECE_BYTES instead (`pieces`), from WORKERS
    threads at once, each piece visited and digested by one job while it is in the CPU's cache.

    The digest (`WeightsDigest`, 16 hex chars) is of the tensors' bytes as they travel: under
    ddp of this rank's replica, under ZeRO of the full tensors as this rank assembles them from
    every shard. Equal for equal weights whatever the parallelism.
    """
    h = WeightsDigest()
    staging = _Staging(device)
    pending: list[tuple[list[Future], Future | None]] = []  # per tensor in flight: its pieces' jobs, its visit

    def landed(copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()  # the asynchronous device-to-host copy is complete

    def job(name: str, flat: torch.Tensor, copied: torch.cuda.Event | None, lo: int, hi: int
            ) -> tuple[bytes, bytes, int]:
        landed(copied)
        if piecewise and visit is not None:
            visit(name, flat, lo, hi)
        raw = flat[lo:hi].view(torch.uint8)
        return (*fold(raw), raw.numel())

    def whole(name: str, host: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        landed(copied)
        visit(name, host)

    def settle(item: tuple[list[Future], Future | None]) -> None:
        futs, visited = item
        for i, fut in enumerate(futs):
            h.add(*fut.result(), last=i == len(futs) - 1)
        if visited is not None:
            visited.result()

    # A whole-tensor visitor sees the tensors one at a time, in order, on a thread of its own.
    serial = ThreadPoolExecutor(1, "sovfl-visit") if visit is not None and not piecewise else None
    pool = _pool()
    with one_thread_per_op():
        try:
            for name, t in entries:
                full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
                if len(pending) == 2:  # at most two tensors in flight: one being consumed, one queued
                    settle(pending[0])
                    pending.pop(0)
                copied = None
                if full.device.type == "cpu":
                    host = full.contiguous()
                else:  # the buffer is free: its last consumers finished above
                    j, raw = staging.take(full.numel() * full.element_size())
                    host = _as_dtype(raw, full.dtype, full.shape)
                    host.copy_(full, non_blocking=True)
                    copied = staging.mark(j)
                flat = host.reshape(-1)
                futs = [pool.submit(job, name, flat, copied, lo, hi)
                        for lo, hi in pieces(host.numel(), host.element_size())]
                pending.append((futs, serial.submit(whole, name, host, copied) if serial is not None else None))
                del full
            while pending:
                settle(pending[0])
                pending.pop(0)
        finally:  # past an error, nothing more starts and nothing still runs (its buffers are about to go)
            left = [fut for futs, visited in pending for fut in [*futs, visited] if fut is not None]
            for fut in left:
                fut.cancel()
            wait(left)
            if serial is not None:
                serial.shutdown(wait=True)
    return h.hexdigest()
