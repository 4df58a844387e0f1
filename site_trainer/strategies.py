"""How a site's ranks share one model: `ddp`, `zero2` or `zero3`, with optional bf16 and recompute.

- `ddp`: every rank holds parameters, gradients and optimizer state (16P bytes with fp32 Adam).
- `zero2`: FSDP2 `fully_shard(reshard_after_forward=False)`: gradients and optimizer state are
  sharded; parameters stay gathered from forward to backward (one all-gather per step), which is
  what high-latency links want.
- `zero3`: FSDP2 with `reshard_after_forward=True`: parameters are sharded too and gathered per
  block in forward and again in backward (16P/K bytes, twice the all-gathers).

Transformer models (anything with a `blocks` ModuleList) are sharded block by block so that only
one block is ever gathered under ZeRO-3; other models are sharded as one unit. Parameter names
are unchanged by every strategy, so the hand-off layout is the same for all of them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("sovfl.trainer")

SHARDED = ("zero2", "zero3")
FORCE_BF16_ENV = "SOVFL_BF16_EMULATED"  # tests only: run bf16 even where the CPU emulates it


class StrategyUnavailable(RuntimeError):
    """The configured strategy cannot run on this backend or device; says what to change."""


def device_for(backend: str) -> torch.device:
    """nccl ranks train on their local GPU; gloo ranks on the CPU."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise StrategyUnavailable("backend 'nccl' needs CUDA GPUs; use backend 'gloo' on CPU")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_supported(strategy: str, backend: str, device: torch.device) -> None:
    """Fail early and clearly: ZeRO needs FSDP2 and the backend's all-gather and reduce-scatter.

    Probed with a real collective on every rank (all ranks take the same path, so none hangs),
    because backend support depends on the torch build, not only on its version.
    """
    if strategy not in SHARDED:
        return
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise StrategyUnavailable(f"strategy {strategy!r} needs torch's FSDP2 (fully_shard, torch >= 2.6); "
                                  f"this is torch {torch.__version__}: upgrade torch or use strategy 'ddp'") from None
    world = dist.get_world_size()
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        out = torch.empty(2, device=device)
        reduce_scatter(out, torch.ones(2 * world, device=device))
        all_gather(torch.empty(2 * world, device=device), out)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        raise StrategyUnavailable(
            f"strategy {strategy!r} needs reduce-scatter and all-gather, which backend {backend!r} on "
            f"{device.type} does not provide here ({str(err).splitlines()[0]}); use strategy 'ddp', or "
            "backend 'nccl' on GPUs") from None


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 where the hardware computes it natively; otherwise warn and train in fp32."""
    if mixed_precision != "bf16":
        return None
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if native or os.environ.get(FORCE_BF16_ENV) == "1":
        return torch.bfloat16
    log.warning("mixed_precision 'bf16' requested but this %s has no native bf16 (needs AVX512-BF16 or AMX on "
                "CPU, compute capability 8.0+ on GPU); falling back to fp32", device.type)
    return None


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer (the unit of sharding and of recompute), if any."""
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def _recompute_in_backward(block: nn.Module) -> None:
    """Wrap the block's forward in non-reentrant activation checkpointing, keeping its FQNs."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def wrap(module: nn.Module, strategy: str, dtype: torch.dtype | None, activation_checkpointing: bool,
         device: torch.device) -> nn.Module:
    """Return the model to train: DDP around `module`, or `module` itself sharded in place (FSDP2)."""
    blocks = transformer_blocks(module)
    if activation_checkpointing:
        if blocks:
            for block in blocks:
                _recompute_in_backward(block)
        else:
            log.warning("activation_checkpointing: %s has no `blocks`; nothing to recompute", type(module).__name__)
    if strategy == "ddp":
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        if dtype is not None:
            ddp.register_comm_hook(None, _reduce_in(dtype))
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype is not None else MixedPrecisionPolicy()
    reshard = strategy == "zero3"
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(module, reshard_after_forward=reshard, mp_policy=mp)
    return module


def _reduce_in(dtype: torch.dtype):
    """A DDP comm hook averaging each gradient bucket in `dtype` (torch's own bf16 hook is GPU-only)."""

    def hook(_state, bucket):
        grads = bucket.buffer()
        low = grads.to(dtype).div_(dist.get_world_size())
        fut = dist.all_reduce(low, async_op=True).get_future()

        def unpack(f):
            grads.copy_(f.value()[0])
            return grads

        return fut.then(unpack)

    return hook


def autocast(strategy: str, device: torch.device, dtype: torch.dtype | None):
    """DDP computes in bf16 through autocast; FSDP2 casts parameters itself (its mp_policy)."""
    if dtype is None or strategy in SHARDED:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, strategy: str, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on inner micro-batches of an accumulation."""
    if sync:
        yield
    elif strategy == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def after_forward_only(model: nn.Module, strategy: str) -> None:
    """Free the parameters ZeRO-2 keeps gathered after a forward that has no backward (evaluation)."""
    if strategy in SHARDED:
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def materialize_shards(module: nn.Module, device: torch.device) -> None:
    """Give a meta-built, sharded module storage for this rank's shards only, zero-filled.

    The real weights arrive with every request (`load_full_state`) or from a local checkpoint;
    until then the shards hold zeros rather than uninitialized memory.
    """
    module.to_empty(device=device)
    with torch.no_grad():
        for t in module.state_dict().values():
            (t.to_local() if isinstance(t, DTensor) else t).zero_()


def _shard_of(full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of `full` under FSDP2's layout: dim-0 chunks over all ranks, as torch.chunk
    cuts them (the last ranks may hold an empty one)."""
    chunks = full.chunk(world, dim=0)
    mine = chunks[rank] if rank < len(chunks) else full[:0]
    if mine.shape != local.shape:
        raise RuntimeError(f"shard layout mismatch: rank {rank} of {world} holds {tuple(local.shape)} of "
                           f"{tuple(full.shape)}, expected {tuple(mine.shape)} (dim-0 sharding over all ranks)")
    return mine


def load_full_state(module: nn.Module, device: torch.device, arrays: Mapping[str, np.ndarray] | None) -> None:
    """Collective: every rank gets the global model that rank 0 reads from `arrays` (None elsewhere).

    One tensor at a time, whatever the strategy: rank 0 reads it (from the hand-off file, see
    `handoff.Reader`), broadcasts it, and each rank copies in what it keeps, the whole tensor under
    ddp, its shard under ZeRO. No rank ever holds more of the full model than one tensor of it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if rank == 0:
                full = torch.from_numpy(np.asarray(arrays[name])).to(device=device, dtype=t.dtype)
            else:
                full = torch.empty(t.shape, dtype=t.dtype, device=device)
            if world > 1:
                dist.broadcast(full, src=0)
            if isinstance(t, DTensor):
                local = t.to_local()
                local.copy_(_shard_of(full, local, rank, world))
            else:
                t.copy_(full)
            del full  # freed before the next tensor is allocated


def visit_full_state(module: nn.Module, visit: Callable[[str, torch.Tensor], None] | None) -> str:
    """Collective under ZeRO: walk the full weights in state-dict order, one CPU tensor at a time,
    calling `visit` on each; return their digest.

    Each sharded tensor is all-gathered, visited and dropped before the next, so no rank holds the
    full model because of this (rank 0 streams it straight into the hand-off file). The digest is
    sha256 (16 hex chars) of the fp32 bytes of all entries, back to back: under DDP of this rank's
    replica, under ZeRO of the full model as this rank assembles it from every shard. Equal for
    equal weights whatever the strategy.
    """
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()
        h.update(full.numpy())
        if visit is not None:
            visit(name, full)
    return h.hexdigest()[:16]


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float,
                   state_placement: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                   ) -> torch.optim.Optimizer:
    """SGD, or AdamW with the fused kernel: one pass per tensor and no model-sized temporary (the
    default foreach AdamW on GPUs allocates sqrt(v) for every parameter at once: 4P/K more bytes).

    AdamW's state is created here, not in the first `step()`: that step runs when every gradient is
    alive, the worst moment to allocate 8P/K bytes of moments (and, on a GPU, to carve them out of
    the caching allocator's blocks). It is exactly the state AdamW's first step would create (zero
    moments, a float32 step counter on the parameter's device, as the fused kernel wants it;
    tests/test_zero.py checks the two agree), allocated inside `state_placement()` (see
    `host_memory.long_lived`).
    """
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    with state_placement(), torch.no_grad():
        for p in params:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return optimizer
