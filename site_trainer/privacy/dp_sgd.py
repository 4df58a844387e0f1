"""DP-SGD for the built-in loop: per-record clipping, one Gaussian noise draw per logical batch.

One optimizer step of a site with privacy on:
1. Poisson sampling: every rank keeps each record of its own shard with probability
   q = batch_size x grad_accum x world / N (N: the site's training records); the union over ranks
   is a Poisson sample of the site's data at rate q, which is what the accountant assumes. The
   rank's sample is cut into `grad_accum` micro-batches (sizes vary; one may be empty).
2. Per-record gradients of the trainable parameters (`torch.func.vmap(grad(...))` over the
   micro-batch, or one record at a time with `per_sample: loop`; `auto`, the default, takes the loop
   where vmap would hold more than VMAP_MAX_VALUES gradient values (records x trainable parameters:
   full fine-tuning of a large model) and for a model vmap cannot run, e.g. GPT-2's data-dependent
   padding check), each clipped to L2 norm C
   (factor min(1, C / (norm + 1e-6))) and summed: no record contributes more than C.
3. Noise, once per logical batch, by global rank 0 only: N(0, sigma^2 C^2) per coordinate added
   to rank 0's sum before one all-reduce (SUM) of the flat gradient, so the total noise is sigma x C
   whatever the number of ranks and micro-batches. Every rank then holds the same noisy sum and
   divides it by the expected logical batch q N (not the drawn size, which depends on the data).
4. The optimizer steps on that gradient (DDP's own reducer is not used: the forward passes run on
   the bare module).

The noise comes from a torch generator seeded from the OS's entropy when the trainer starts (a
fixed `noise_seed` in tests). It is not a CSPRNG, as in Opacus without `secure_mode`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from site_trainer.privacy.config import PrivacyConfig

log = logging.getLogger("sovfl.trainer")
CLIP_EPS = 1e-6  # in min(1, C / (norm + CLIP_EPS)), as Opacus does
# auto: above this many per-record gradient values in one micro-batch (records x trainable
# parameters; 2^27 fp32 values = 512 MiB), one record at a time instead of vmap
VMAP_MAX_VALUES = 1 << 27
LossFn = Callable[[Any, Any], torch.Tensor]  # (model, batch) -> mean loss of the batch (Task.loss)

# Layers whose output for one record depends on the other records of the batch: per-record
# gradients do not exist for them (the DP guarantee would not hold).
BATCH_COUPLED = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def incompatible_layers(module: nn.Module) -> list[str]:
    """Names of the trainable layers per-record gradients cannot handle (batch statistics)."""
    return [name or type(module).__name__ for name, m in module.named_modules()
            if isinstance(m, BATCH_COUPLED) and (m.training or any(p.requires_grad for p in m.parameters()))]


class _Functional:
    """The module called with other tensors (torch.func.functional_call); anything else (attributes
    a task's loss reads, such as a config) comes from the module itself."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]):
        self._module, self._tensors = module, tensors

    def __call__(self, *args, **kwargs):
        return torch.func.functional_call(self._module, self._tensors, args, kwargs, strict=False)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def batch_len(batch: Any) -> int:
    first = batch
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(len(first))


def _index(batch: Any, i: int) -> Any:
    """Record `i` of a batch as a batch of one."""
    return tree_map(lambda t: t[i : i + 1] if isinstance(t, torch.Tensor) else t, batch)


class PerSampleClipper:
    """Summed, per-record clipped gradients of `module`'s trainable parameters."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, max_grad_norm: float, method: str = "auto"):
        self.module, self.loss_fn, self.C, self.method = module, loss_fn, float(max_grad_norm), method
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in module.named_parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    def _factors(self, norms: torch.Tensor) -> torch.Tensor:
        return (self.C / (norms + CLIP_EPS)).clamp(max=1.0)

    def clipped_sum(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(sum over the batch's records of each clipped gradient, sum of their losses)."""
        n = batch_len(batch)
        if n == 0:
            return self.zeros(), torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        if self.method == "loop":
            return self._loop(batch, n)
        if self.method == "vmap":
            return self._vmap(batch)
        if n * self.numel > VMAP_MAX_VALUES:  # auto: vmap would hold n x P gradient values at once
            return self._loop(batch, n)
        try:  # auto: vmap, unless this model cannot run under it (data-dependent Python control flow)
            out = self._vmap(batch)
        except RuntimeError as err:
            if "vmap" not in str(err) and "functorch" not in str(err):
                raise
            log.warning("per-record gradients: the model does not run under torch.func.vmap (%s); computing them "
                        "one record at a time instead (privacy.per_sample: loop)", str(err).splitlines()[0][:200])
            self.method = "loop"
            return self._loop(batch, n)
        self.method = "vmap"
        return out

    def _vmap(self, batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        trainable = {n: p.detach() for n, p in zip(self.names, self.params)}
        fixed = {n: t for n, t in [*self.module.named_parameters(), *self.module.named_buffers()]
                 if n not in trainable}

        def one(params: dict, record: Any) -> torch.Tensor:
            single = tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, record)
            return self.loss_fn(_Functional(self.module, {**fixed, **params}), single).float()

        grads, losses = torch.func.vmap(torch.func.grad_and_value(one), in_dims=(None, 0),
                                        randomness="different")(trainable, batch)
        with torch.autocast(self.params[0].device.type, enabled=False):  # clip and sum in fp32 even under bf16
            per = [grads[n].float() for n in self.names]
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per))
            f = self._factors(norms)
            return [torch.einsum("b,b...->...", f, g) for g in per], losses.detach().double().sum()

    def _loop(self, batch: Any, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        out, loss_sum = self.zeros(), torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for i in range(n):
            loss = self.loss_fn(self.module, _index(batch, i)).float()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            with torch.autocast(self.params[0].device.type, enabled=False):
                grads = [torch.zeros_like(p) if g is None else g.float() for g, p in zip(grads, self.params)]
                norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
                f = self._factors(norm)
                for acc, g in zip(out, grads):
                    acc.add_(g * f)
            loss_sum += loss.detach().double()
        return out, loss_sum


class NoisyReducer:
    """The logical batch's gradient: every rank's clipped sums, plus one N(0, (sigma C)^2) draw by
    global rank 0, all-reduced (SUM) and divided by the expected batch."""

    def __init__(self, sigma: float, max_grad_norm: float, device: torch.device, seed: int | None = None):
        self.std = float(sigma) * float(max_grad_norm)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self.device = device

    def reduce(self, sums: Sequence[torch.Tensor], expected_batch: float) -> list[torch.Tensor]:
        """Collective: the noisy mean gradient, the same on every rank, shaped like `sums`."""
        flat = torch.cat([s.reshape(-1).float() for s in sums]).to(self.device)
        if self.rank == 0 and self.std > 0:
            flat += torch.randn(flat.numel(), generator=self.gen, device=self.device) * self.std
        if self.world > 1:
            dist.all_reduce(flat)
        flat /= float(expected_batch)
        return [t.view_as(s) for t, s in zip(flat.split([s.numel() for s in sums]), sums)]


def poisson_sample(indices: torch.Tensor, q: float, gen: torch.Generator) -> torch.Tensor:
    """Each of `indices` kept independently with probability `q` (Poisson sampling)."""
    return indices[torch.rand(len(indices), generator=gen) < q]


def sample_rate(batch_size: int, grad_accum: int, world: int, records: int) -> float:
    """q of the Poisson sampling: the expected logical batch over the site's records."""
    return batch_size * grad_accum * world / records


def logical_batch(q: float, records: int) -> float:
    return q * records


def check_rate(q: float, field_hint: str) -> None:
    if not 0 < q <= 1 or math.isnan(q):
        raise ValueError(f"privacy: the sampling rate q = {q:.4g} must be in (0, 1]: {field_hint}")


__all__ = ["BATCH_COUPLED", "NoisyReducer", "PerSampleClipper", "PrivacyConfig", "check_rate",
           "incompatible_layers", "logical_batch", "poisson_sample", "sample_rate"]
