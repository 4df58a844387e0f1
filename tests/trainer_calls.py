"""Calling a running trainer service the way the ClientApp does: the global model through a
hand-off file, a request on the endpoint, the update read back out of its hand-off file."""

from __future__ import annotations

import numpy as np

from site_trainer import endpoint, handoff


def call(cfg, method: str, arrays, timeout_s: float = 120, **extra) -> dict:
    """`method` ("Train", "Evaluate") on the service of `cfg` with `arrays` as the global model."""
    h = handoff.write_arrays(arrays, "test")
    try:
        return endpoint.call(cfg.socket, method, {"global": h.to_json(), "timeout_s": timeout_s, **extra},
                             timeout_s=timeout_s)
    finally:
        handoff.release(h.path)


def update_of(reply) -> dict[str, np.ndarray]:
    """The update a Train reply handed off, copied out of its file (which is then released)."""
    upd = handoff.Handle.from_json(reply["update"])
    try:
        return {k: np.array(v) for k, v in handoff.map_arrays(upd).items()}
    finally:
        handoff.release(upd.path)


def far_from(initial: dict[str, np.ndarray], scale: float = 0.5, seed: int = 0) -> dict[str, np.ndarray]:
    """A global model far from `initial` (Gaussian noise of `scale`): a trainer that really loaded it
    answers a few steps away from it, not from its own initial weights."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, scale, v.shape)).astype(v.dtype) for k, v in initial.items()}
