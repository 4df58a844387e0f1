"""FedAvg's step for one tensor, the one place its arithmetic is written.

The server optimizer (aggregate.py), the spilled plain-round mean (spilled_mean.py) and the model
held on disk through a SecAgg+ round (model_spill.py) each decide where a tensor's next value
goes (the model's own array, the consumed mean's, a new one, slice by slice); all of them compute
it here, so the three placements take the same float operations element for element and a run's
model does not depend on which one a round used.
"""

from __future__ import annotations

import numpy as np


def replaces(update_kind: str, lr: float) -> bool:
    """Whether the step is the mean itself (weights at server lr 1): no arithmetic, a copy at most."""
    return update_kind == "weights" and lr == 1.0


def fedavg_into(model: np.ndarray, mean: np.ndarray, update_kind: str, lr: float, out: np.ndarray) -> np.ndarray:
    """`out` <- the next value of one tensor: `model + lr * mean` (delta) or `model + lr * (mean -
    model)` (weights; the mean itself at lr 1). `out` may be `model` or `mean` (either is read
    before it is written) or a new float32 array; the sum is taken in the inputs' dtype and cast
    into `out`'s."""
    if replaces(update_kind, lr):
        if out is not mean:
            np.copyto(out, mean, casting="unsafe")
        return out
    step = lr * (mean if update_kind == "delta" else mean - model)
    np.add(model, step, out=out, casting="unsafe")
    return out
