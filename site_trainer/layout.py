"""What travels between a site and the coordinator, and how it is laid out on the wire.

Only the exchanged tensors (`Task.exchanged`, by default the trainable parameters) are loaded from
the global model and sent back. The rules:
- a tied tensor travels once, under its first name; loading it re-ties the others (they are the
  same parameter);
- integer tensors (step counters, position ids) never travel: they stay on the site;
- shapes are kept exactly, 0-dim tensors included;
- dtypes numpy knows travel as themselves (float32 stays float32); bfloat16 and the float8 types,
  which numpy lacks, travel as raw words of their size (`<u2`, `|u1`) and the manifest records
  their logical dtype, so nothing is lost and a bf16 model sends half the bytes.

Everything that does not travel is frozen here: its SHA-256 fingerprint (`FrozenDigest`: names,
dtypes, shapes and bytes in state-dict order; the same whatever the parallelism) goes into the
manifest, so that a site whose base weights differ from the coordinator's can be refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from site_trainer.manifest import MANIFEST_VERSION, manifest_mismatch  # noqa: F401 - the manifest's home


# Logical dtypes that numpy cannot hold travel as unsigned words of the same size.
_RAW = {torch.bfloat16: "<u2", torch.float8_e4m3fn: "|u1", torch.float8_e5m2: "|u1"}
_RAW_VIEW = {"<u2": torch.uint16, "|u1": torch.uint8}
_LOW_PRECISION = (torch.bfloat16, torch.float16, *(d for d in _RAW if d.itemsize == 1))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype: torch.dtype) -> str:
    """The numpy dtype string a tensor of `dtype` travels as."""
    if dtype in _RAW:
        return _RAW[dtype]
    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype).str


def accepted_wire(dtype: torch.dtype) -> tuple[str, ...]:
    """What a global tensor of logical `dtype` may arrive as: its wire dtype, and float32 for the
    low-precision floats (a coordinator that accumulates in float32 may send float32 down)."""
    own = wire_dtype(dtype)
    return (own, "<f4") if dtype in _LOW_PRECISION and own != "<f4" else (own,)


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the numpy array that travels (a view, no copy)."""
    raw = _RAW.get(t.dtype)
    return t.view(_RAW_VIEW[raw]).numpy() if raw else t.numpy()


def from_wire(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of logical `dtype` that `array` carries (a view where the wire dtype is the
    tensor's own or its raw words; converted when a low-precision tensor arrives as float32)."""
    t = torch.from_numpy(array)
    if dtype in _RAW and array.dtype.str == _RAW[dtype]:
        return t.view(dtype)
    return t if t.dtype == dtype else t.to(dtype)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or torch.compile wrappers (FSDP2 shards in place: no wrapper)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict tensor by name, as the module holds it (parameters themselves, DTensors
    under ZeRO): writing into these writes into the model. Tied names map to one object."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def default_exchanged(module: nn.Module) -> list[str]:
    """The trainable parameters, a tied one once under its first name (Task.exchanged's default)."""
    return [name for name, p in module.named_parameters() if p.requires_grad]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def wire(self) -> str:
        return wire_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class LayoutError(ValueError):
    """A task names tensors that cannot travel; says which and why."""


@dataclass(frozen=True)
class Layout:
    """The exchanged tensors (in order) and the frozen ones (everything else in the state dict,
    tied aliases of exchanged tensors excepted)."""

    exchanged: tuple[TensorSpec, ...]
    frozen: tuple[str, ...]

    @staticmethod
    def of(module: nn.Module, names: Iterable[str]) -> "Layout":
        tensors = named_tensors(module)
        chosen: list[TensorSpec] = []
        taken: set[int] = set()
        for name in names:
            if name not in tensors:
                close = [n for n in tensors if n.endswith(name.rsplit(".", 1)[-1])][:5]
                raise LayoutError(f"exchanged tensor {name!r} is not in the model's state dict"
                                  f"{f' (similar: {close})' if close else ''}")
            t = tensors[name]
            if not (t.is_floating_point() or t.is_complex()):
                raise LayoutError(f"exchanged tensor {name!r} is {dtype_name(t.dtype)}: only floating-point tensors "
                                  "travel; integer buffers (counters, position ids) stay on the site")
            if t.is_complex():
                raise LayoutError(f"exchanged tensor {name!r} is complex ({dtype_name(t.dtype)}): "
                                  "not supported on the wire")
            if id(t) in taken:
                continue  # a tied alias named again: it travels once
            taken.add(id(t))
            chosen.append(TensorSpec(name, t.dtype, tuple(t.shape)))  # a DTensor's shape is the full one
        frozen = tuple(n for n, t in tensors.items() if id(t) not in taken)
        return Layout(tuple(chosen), frozen)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.exchanged]

    def wire_spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (wire dtype, shape): the hand-off layout of the global model and of updates."""
        return {s.name: (s.wire, s.shape) for s in self.exchanged}

    def manifest(self, frozen: "FrozenDigest") -> dict:
        """What the coordinator checks a site against (JSON): exchanged names, logical dtypes,
        shapes and wire dtypes; the frozen tensors' count, size and SHA-256."""
        return {
            "version": MANIFEST_VERSION,
            "exchanged": [[s.name, dtype_name(s.dtype), list(s.shape), s.wire] for s in self.exchanged],
            "exchanged_numel": sum(s.numel for s in self.exchanged),
            "frozen": {"tensors": frozen.tensors, "numel": frozen.numel, "sha256": frozen.hexdigest()},
        }


class FrozenDigest:
    """SHA-256 over the frozen tensors, fed one full tensor at a time in state-dict order.

    Each tensor contributes its name, dtype, shape and raw bytes, so equal weights give the same
    digest whatever the parallelism that held them.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.tensors = 0
        self.numel = 0

    def update(self, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if isinstance(t, DTensor):
            raise TypeError(f"{name}: hash the full tensor, not a shard")
        t = t.cpu().contiguous()
        self._h.update(f"{name}\0{dtype_name(t.dtype)}\0{list(t.shape)}\0".encode())
        if t.numel():
            self._h.update(t.reshape(-1).view(torch.uint8).numpy())
        self.tensors += 1
        self.numel += t.numel()

    def hexdigest(self) -> str:
        return self._h.hexdigest()
