"""How a site's ranks share one model (`parallelism`): `ddp`, `zero2` or `zero3`, with optional bf16 and recompute.

- `ddp`: every rank holds parameters, gradients and optimizer state (16P bytes with fp32 Adam).
- `zero2`: FSDP2 `fully_shard(reshard_after_forward=False)`: gradients and optimizer state are
  sharded; parameters stay gathered from forward to backward (one all-gather per step), which is
  what high-latency links want.
- `zero3`: FSDP2 with `reshard_after_forward=True`: parameters are sharded too and gathered per
  block in forward and again in backward (16P/K bytes, twice the all-gathers).

Models with repeated blocks (`find_blocks`: Hugging Face's `_no_split_modules` classes, else the
longest ModuleList of one class) are sharded block by block, so that only one block is ever
gathered under ZeRO-3; other models are sharded as one unit. Parameter names are unchanged by
every strategy, so the hand-off layout is the same for all of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Iterable, Sequence
from typing import Callable

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
    """The configured parallelism cannot run on this backend or device; says what to change."""


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
        raise StrategyUnavailable(f"parallelism {strategy!r} needs torch's FSDP2 (fully_shard, torch >= 2.6); "
                                  f"this is torch {torch.__version__}: upgrade torch or use parallelism 'ddp'") from None
    world = dist.get_world_size()
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        out = torch.empty(2, device=device)
        reduce_scatter(out, torch.ones(2 * world, device=device))
        all_gather(torch.empty(2 * world, device=device), out)
    except (RuntimeError, NotImplementedError, ValueError) as err:
        raise StrategyUnavailable(
            f"parallelism {strategy!r} needs reduce-scatter and all-gather, which backend {backend!r} on "
            f"{device.type} does not provide here ({str(err).splitlines()[0]}); use parallelism 'ddp', or "
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


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of a model (units of sharding and of recompute), found generically.

    A Hugging Face model names them: the modules whose class is in `_no_split_modules` (its
    decoder layers), outermost ones only. Otherwise: the longest `nn.ModuleList` whose members
    are all of one class (a GPT's blocks), or none.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found: list[nn.Module] = []
        inside: set[int] = set()
        for m in model.modules():
            if id(m) in inside or m is model:
                continue
            if type(m).__name__ in names:
                found.append(m)
                inside.update(id(x) for x in m.modules())
        if found:
            return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(x) for x in m}) == 1:
            best = list(m)
    return best


@contextlib.contextmanager
def parameters_on_meta():
    """Build a model with its parameters on the meta device and its buffers real.

    ZeRO ranks never hold the full model: they build its structure, shard it, then allocate their
    shards. Buffers stay real because some are made only by the constructor (non-persistent ones
    such as rotary `inv_freq` are in no state dict and could not be restored). Each parameter is
    moved to meta as it is registered, so its initialisation (`reset_parameters`) runs on meta:
    no compute and no memory beyond one transient empty tensor.
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            extra = {k: v for k, v in vars(p).items() if k != "_is_param"}
            moved = type(p)(p.detach().to("meta"), requires_grad=p.requires_grad)
            vars(moved).update(extra)
            self._parameters[name] = moved

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _recompute_in_backward(block: nn.Module) -> None:
    """Wrap the block's forward in non-reentrant activation checkpointing, keeping its FQNs."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def wrap(module: nn.Module, strategy: str, dtype: torch.dtype | None, activation_checkpointing: bool,
         device: torch.device, blocks: Sequence[nn.Module] | None = None) -> nn.Module:
    """Return the model to train: DDP around `module` (`module` itself on a single rank, where DDP
    would only add per-step work: gradient hooks, a buffer broadcast before every forward, an
    all-reduce of every bucket), or `module` itself sharded in place (FSDP2), block by block
    (`blocks`, default `find_blocks(module)`)."""
    blocks = list(find_blocks(module) if blocks is None else blocks)
    if activation_checkpointing:
        if blocks:
            for block in blocks:
                _recompute_in_backward(block)
        else:
            log.warning("activation_checkpointing: found no repeated blocks in %s; nothing to recompute",
                        type(module).__name__)
    if strategy == "ddp":
        if dist.get_world_size() == 1:  # nothing to synchronize: no reducer hooks, buffer broadcasts or all-reduces
            return module
        ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        if dtype is not None:
            ddp.register_comm_hook(None, _reduce_in(dtype))
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype is not None else MixedPrecisionPolicy()
    reshard = strategy == "zero3"
    ignored = set(replicated_params(module)) or None
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored)
    fully_shard(module, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored)
    return module


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters ZeRO leaves whole on every rank: 0-dim ones (FSDP2 cannot shard a scalar). Their
    gradients are averaged by `average_grads` instead of FSDP's reduce-scatter."""
    return [p for p in module.parameters() if p.dim() == 0]


def average_grads(params: Sequence[nn.Parameter]) -> None:
    """Collective: average the gradients of `params` over all ranks (what DDP/FSDP do for the rest)."""
    world = dist.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # unused here: every rank still joins the reduction
        if world > 1:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


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
        with model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext():
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
    """Give a meta-built, sharded module storage for this rank's shards only, zero-filled; buffers
    built real (see `parameters_on_meta`) keep their values, moved to `device`.

    The real weights arrive with every request, from rank 0's streamed build or from a local
    checkpoint (site_trainer/transfer.py); until then the shards hold zeros rather than garbage.
    """
    real = {name: b.detach().clone() for name, b in module.named_buffers() if b.device.type != "meta"}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
        for name, b in module.named_buffers():
            if name in real:
                b.copy_(real[name])
            else:
                b.zero_()


def param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """The trainable parameters, decayed only where they are matrices (weights of linear layers and
    embeddings), as in GPT-2 and nanoGPT: biases and norm gains are left alone. One group when
    there is no decay."""
    params = [(n, p) for n, p in named if p.requires_grad]
    if not weight_decay:
        return [{"params": [p for _, p in params], "weight_decay": 0.0}]
    return [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(params: Iterable[nn.Parameter] | list[dict], name: str, lr: float,
                   state_placement: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   ) -> torch.optim.Optimizer:
    """SGD, or AdamW with the fused kernel: one pass per tensor and no model-sized temporary (the
    default foreach AdamW on GPUs allocates sqrt(v) for every parameter at once: 4P/K more bytes).
    `params` may be parameter groups (`param_groups`, with their weight decay).

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
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return optimizer


def lr_at(step: int, lr: float, warmup_steps: int, schedule: str, total_steps: int | None, min_lr: float) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up over `warmup_steps`, then
    constant, or cosine from `lr` to `min_lr` at `total_steps` (and `min_lr` after)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant" or not total_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
