"""Global-model checkpoints: one .npz per round plus `latest.npz`, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from federation.protocol.codecs import Arrays


def save_checkpoint(directory: Path, rnd: int, model: Arrays, opt_state: Arrays) -> Path:
    """Write round `rnd`'s model and optimizer state, then point latest.npz at it (each step atomic)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"round_{rnd:04d}.npz"
    tmp = directory / f".round_{rnd:04d}.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, __round__=np.array(rnd), **{f"model/{k}": v for k, v in model.items()},
                 **{f"opt/{k}": v for k, v in opt_state.items()})
    os.replace(tmp, path)
    latest = directory / "latest.npz"
    tmp_link = directory / ".latest.tmp"
    if tmp_link.exists() or tmp_link.is_symlink():
        tmp_link.unlink()
    os.symlink(path.name, tmp_link)
    os.replace(tmp_link, latest)
    return path


def load_checkpoint(path: Path) -> tuple[int, Arrays, Arrays]:
    """Returns (round, model, optimizer state)."""
    with np.load(path) as z:
        model = {k[6:]: z[k] for k in z.files if k.startswith("model/")}
        opt = {k[4:]: z[k] for k in z.files if k.startswith("opt/")}
        return int(z["__round__"]), model, opt
