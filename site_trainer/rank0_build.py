"""Rank 0's real build streamed into every rank's ZeRO shards.

Under ZeRO every rank builds its parameters on the meta device and allocates only its shards; the
values come from one real build on rank 0, streamed tensor by tensor (`transfer.stream_in`), so no
rank ever holds a second full model. The frozen tensors are fingerprinted on that same pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from site_trainer import layout, transfer


def stream_rank0_build(module: nn.Module, build_model: Callable[[], nn.Module], lay: layout.Layout,
                       frozen: layout.FrozenDigest, *, seed: int, rank: int, device: torch.device) -> None:
    """Collective: rank 0 builds the real model on its CPU and streams every state-dict tensor
    (parameters and buffers, a tied one once) into each rank's shards; the frozen ones are
    hashed as they pass."""
    ref: dict[str, torch.Tensor] = {}
    if rank == 0:
        torch.manual_seed(seed)
        ref = layout.named_tensors(build_model())
    tensors = layout.named_tensors(module)
    seen: set[int] = set()
    entries = []
    for name, t in tensors.items():
        if id(t) not in seen:
            seen.add(id(t))
            entries.append((name, t))
    order = list(tensors)
    to_hash = set(lay.frozen)
    done = [0]

    def hash_up_to(position: int) -> None:
        while done[0] < position:
            name = order[done[0]]
            if name in to_hash:
                frozen.update(name, ref[name])
            done[0] += 1

    def read(name: str, out: np.ndarray) -> None:
        t = ref[name].detach().contiguous()
        out[...] = layout.to_wire(t)
        hash_up_to(order.index(name) + 1)

    with torch.no_grad():
        transfer.stream_in(entries, read if rank == 0 else None, device, check_finite=False)
    if rank == 0:
        hash_up_to(len(order))
    del ref
