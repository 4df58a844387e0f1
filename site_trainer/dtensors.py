"""DTensor checks that leave `torch.distributed.tensor` unimported until something shards.

That package pulls in sympy and torch's symbolic shapes, the largest part of a rank's start after
torch itself, and a site training under DDP or on one rank never needs it. A DTensor can only exist
once the package has been imported (FSDP2's `fully_shard` imports it, so does a user's script that
shards), so while it is absent from `sys.modules` no tensor is one.
"""

from __future__ import annotations

import sys

import torch

_MODULE = "torch.distributed.tensor"


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a DTensor, without importing the DTensor package to ask."""
    cls = getattr(sys.modules.get(_MODULE), "DTensor", None)  # None too while another thread imports it
    return cls is not None and isinstance(t, cls)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds: its shard of a DTensor, or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards (collective), any other as it is."""
    return t.full_tensor() if is_dtensor(t) else t
