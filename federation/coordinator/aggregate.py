"""Aggregation on the coordinator: a streaming sample-weighted mean and the server optimizers.

Updates are folded into one float64 accumulator as they arrive (memory O(P), not O(N·P)).
FedAvg takes the mean as the new model (weights) or adds it scaled by the server learning rate
(deltas); FedAdam and FedYogi (Reddi et al., ICLR 2021) treat the averaged delta as a
pseudo-gradient, and so does DiLoCo's outer optimizer (Douillard et al. 2023): SGD with Nesterov
momentum on the pseudo-gradient g = global - mean(site models) = -(mean delta). Every state array
is float32 and every step float32 arithmetic in a fixed order, so a resumed run that loads the
state from a checkpoint takes bit for bit the steps of the run that never stopped. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from federation.coordinator.model_spill import step_into_mean
from federation.coordinator.server_math import fedavg_into, replaces
from federation.coordinator.spilled_mean import SpilledMean, disjoint, writable_f32
from federation.protocol.codecs import Arrays


SLICE = 1 << 22  # elements per step of the accumulation: bounds its temporaries to 32 MiB, whatever the tensor


class WeightedMean:
    """Σ n_i·u_i / Σ n_i, accumulated one update at a time in float64 (so the float32 result does not
    depend on the order the updates arrive in, in practice), slice by slice, so that folding an
    update in allocates nothing of its size: the coordinator holds the float64 sum and the one
    update being folded."""

    def __init__(self) -> None:
        self._sum: Arrays = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, update: Arrays, weight: float) -> None:
        """Fold one update in with its (positive) weight."""
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        for name, arr in update.items():
            acc = self._sum.get(name)
            if acc is None:
                acc = self._sum[name] = np.empty(arr.shape, np.float64)
                np.multiply(arr, weight, out=acc, dtype=np.float64)  # cast in the ufunc's own small buffers
                continue
            flat_acc, flat = acc.reshape(-1), np.asarray(arr).reshape(-1)
            for lo in range(0, flat.size, SLICE):
                flat_acc[lo:lo + SLICE] += flat[lo:lo + SLICE].astype(np.float64) * weight
        self.total_weight += weight
        self.count += 1

    def result(self) -> Arrays:
        """The mean, float32. Consumes the sum: each float64 tensor is freed once converted, so the
        peak is the sum plus one tensor, not the sum plus the mean."""
        if not self.count:
            raise ValueError("no update was added")
        out = {}
        for name in list(self._sum):
            acc = self._sum.pop(name)
            np.divide(acc, self.total_weight, out=acc)
            out[name] = acc.astype(np.float32)
            del acc
        self.count = 0
        return out


def _target(m: np.ndarray, u: np.ndarray, update_kind: str, lr: float, consume: bool,
            in_place: bool) -> np.ndarray | None:
    """Where FedAvg writes one tensor's next value: the old model's float32 array (`in_place`:
    nothing else keeps the old model); None for the consumed mean's own array, slice by slice,
    when the model is read-only (on disk while a SecAgg+ round held its ring, model_spill.py); the
    consumed mean itself when the step is the mean and already float32; else a new float32 array."""
    if in_place and writable_f32(m) and u.shape == m.shape:
        return m
    if in_place and consume and writable_f32(u) and u.shape == m.shape and m.dtype == np.float32:
        return None
    if replaces(update_kind, lr):
        return u if consume and u.dtype == np.float32 else np.empty(u.shape, np.float32)
    return np.empty(np.broadcast_shapes(m.shape, u.shape), np.float32)


@dataclass
class ServerOptimizer:
    """Applies the round's mean update to the global model; keeps FedAdam/FedYogi moments and
    DiLoCo's momentum buffer (the state a checkpoint holds)."""

    strategy: str = "fedavg"
    update_kind: str = "delta"
    lr: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    momentum: float = 0.5  # diloco (the schema's default: FederationConfig.effective_server_momentum)
    nesterov: bool = True  # diloco; False: heavy-ball momentum
    m: Arrays = field(default_factory=dict)
    v: Arrays = field(default_factory=dict)
    buf: Arrays = field(default_factory=dict)  # diloco's momentum buffer, in the direction of the mean delta

    def step(self, model: Arrays, mean_update: Arrays | SpilledMean, consume: bool = False,
             in_place: bool = False) -> Arrays:
        """The next global model from the round's mean update (weights or delta, per update_kind).
        `consume`: FedAvg takes the mean's tensors out of `mean_update` as it goes (it is not needed
        after). `in_place`: FedAvg writes the new model into the old model's float32 arrays (the
        driver's: nothing else keeps the old model), and returns a new dict over them, so a step
        never holds two models; a read-only model (on disk while a SecAgg+ round held its ring,
        model_spill.py) takes its step into the consumed mean's arrays instead (the ring's words).
        A `SpilledMean` (the plain round's, on disk) is folded slice by
        slice straight into the model for FedAvg; the other optimizers take its dense mean.
        Either way the arithmetic is the same, element for element."""
        if isinstance(mean_update, SpilledMean):
            if self.strategy == "fedavg":
                return mean_update.apply_fedavg(model, self.update_kind, self.lr, in_place=in_place)
            mean_update = mean_update.result()
        if self.strategy == "fedavg":
            return self._fedavg(model, mean_update, consume, in_place and disjoint(model))
        delta = mean_update if self.update_kind == "delta" else {k: mean_update[k] - model[k] for k in model}
        if self.strategy == "diloco":
            return self._outer_sgd(model, delta)
        return self._adaptive(model, delta)

    def _adaptive(self, model: Arrays, delta: Arrays) -> Arrays:
        """FedAdam's or FedYogi's step on the pseudo-gradient (Reddi et al.), updating m and v."""
        out = {}
        for k in model:
            d = delta[k].astype(np.float32)
            m = self.m.get(k, np.zeros_like(d))
            v = self.v.get(k, np.full_like(d, self.tau**2))
            m = self.beta1 * m + (1 - self.beta1) * d
            if self.strategy == "fedadam":
                v = self.beta2 * v + (1 - self.beta2) * d * d
            else:  # fedyogi: additive, sign-controlled second moment
                v = v - (1 - self.beta2) * d * d * np.sign(v - d * d)
            self.m[k], self.v[k] = m, v
            out[k] = (model[k] + self.lr * m / (np.sqrt(v) + self.tau)).astype(np.float32)
        return out

    def _fedavg(self, model: Arrays, mean: Arrays, consume: bool, in_place: bool) -> Arrays:
        """FedAvg tensor by tensor (the peak is one tensor over model + mean): where each new
        tensor goes is decided here (`_target`), its value in `server_math.fedavg_into`."""
        out = {}
        for k in model:
            u = mean.pop(k) if consume else mean[k]
            m = model[k]
            target = _target(m, u, self.update_kind, self.lr, consume, in_place)
            if target is None:  # the model is read-only (on disk): into the consumed mean, slice by slice
                out[k] = step_into_mean(m, u, self.update_kind, self.lr)
            else:
                out[k] = fedavg_into(m, u, self.update_kind, self.lr, target)
            del u, m
        return out

    def _outer_sgd(self, model: Arrays, delta: Arrays) -> Arrays:
        """DiLoCo's outer step, torch.optim.SGD's (dampening 0) on g = -delta, written for delta:
        b <- momentum*b + delta; step = delta + momentum*b (Nesterov) or b; model + lr*step.

        A fresh buffer is zero, so the first round's buffer is the delta itself, as in torch."""
        out = {}
        for k in model:
            d = delta[k].astype(np.float32)
            b = self.buf.get(k)
            b = d.copy() if b is None else (self.momentum * b + d).astype(np.float32)
            self.buf[k] = b
            step = (d + self.momentum * b).astype(np.float32) if self.nesterov else b
            out[k] = (model[k] + self.lr * step).astype(np.float32)
        return out

    def state(self) -> Arrays:
        """The state to checkpoint (m/<name>, v/<name>: FedAdam/FedYogi; b/<name>: diloco)."""
        return {**{f"m/{k}": v for k, v in self.m.items()}, **{f"v/{k}": v for k, v in self.v.items()},
                **{f"b/{k}": v for k, v in self.buf.items()}}

    def load_state(self, arrays: Arrays) -> None:
        """Restore the state written by `state`."""
        self.m = {k[2:]: v for k, v in arrays.items() if k.startswith("m/")}
        self.v = {k[2:]: v for k, v in arrays.items() if k.startswith("v/")}
        self.buf = {k[2:]: v for k, v in arrays.items() if k.startswith("b/")}
