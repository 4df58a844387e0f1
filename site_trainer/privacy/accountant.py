"""Privacy accounting of DP-SGD with Poisson sampling: epsilon spent, and the noise a budget needs.

A history is a list of (sample_rate q, noise_multiplier sigma, steps). Two accountants:
- `rdp`: Renyi DP of the Poisson-subsampled Gaussian mechanism, computed here exactly at integer
  orders (Mironov, Talwar, Zhang 2019: A_alpha = sum_k C(alpha, k) (1-q)^(alpha-k) q^k
  exp((k^2 - k) / (2 sigma^2))), composed by adding over steps and converted to (epsilon, delta)
  with the conversion of Balle et al. 2020 (Hypothesis testing interpretations and Renyi DP,
  Thm. 21), minimised over the orders. Integer orders only: a little more conservative than an
  accountant that also tries fractional orders.
- `prv`: Opacus's PRV accountant (Gopi, Lee, Wutschitz 2021), numerically tighter; imported only
  when chosen (Opacus costs about 2 s to import).

No torch here (numpy and the standard library); `prv` imports Opacus, which imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ORDERS: tuple[int, ...] = tuple(range(2, 65)) + (72, 80, 96, 128, 160, 192, 256, 384, 512)
History = Sequence[tuple[float, float, int]]  # (q, sigma, steps)


def _log_binom(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def rdp_step(q: float, sigma: float, order: int) -> float:
    """RDP at integer `order` >= 2 of one step of the Poisson-subsampled Gaussian mechanism."""
    if q == 0:
        return 0.0
    if q == 1.0:
        return order / (2 * sigma**2)
    log_q, log_1q = math.log(q), math.log1p(-q)
    terms = [_log_binom(order, k) + (order - k) * log_1q + k * log_q + (k * k - k) / (2 * sigma**2)
             for k in range(order + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (order - 1)


def rdp_epsilon(history: History, delta: float, orders: Sequence[int] = ORDERS) -> tuple[float, int]:
    """(epsilon at `delta`, the best order) of the composed history under the RDP accountant."""
    if not any(steps for _, _, steps in history):
        return 0.0, int(orders[0])
    best, best_order = math.inf, int(orders[0])
    for a in orders:
        rdp = sum(steps * rdp_step(q, sigma, a) for q, sigma, steps in history if steps)
        eps = rdp + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        if eps < best:
            best, best_order = eps, int(a)
    return max(best, 0.0), best_order


def prv_epsilon(history: History, delta: float) -> float:
    """Epsilon at `delta` of the composed history under Opacus's PRV accountant (upper estimate)."""
    from opacus.accountants import PRVAccountant  # noqa: PLC0415 - heavy, and only for this accountant

    acc = PRVAccountant()
    acc.history = [(float(sigma), float(q), int(steps)) for q, sigma, steps in history if steps]
    if not acc.history:
        return 0.0
    return float(acc.get_epsilon(delta=delta, eps_error=0.01))


def epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """Epsilon spent at `delta` by the steps of `history`."""
    if accountant == "prv":
        return prv_epsilon(history, delta)
    return rdp_epsilon(history, delta)[0]


def calibrate(target_epsilon: float, delta: float, q: float, steps: int, accountant: str = "rdp",
              sigma_max: float = 50.0, rel_tol: float = 1e-3) -> float | None:
    """The smallest noise multiplier (within `rel_tol`) whose `steps` steps at rate `q` spend at
    most `target_epsilon`; None when even `sigma_max` does not meet it."""
    spent = lambda s: epsilon([(q, s, steps)], delta, accountant)  # noqa: E731
    if spent(sigma_max) > target_epsilon:
        return None
    lo, hi = 0.0, sigma_max
    while spent(hi / 2) <= target_epsilon and hi > 1e-3:  # bracket from above cheaply
        lo, hi = 0.0, hi / 2
    lo = hi / 2
    while (hi - lo) > rel_tol * hi:
        mid = (lo + hi) / 2
        if spent(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["ORDERS", "calibrate", "epsilon", "np", "prv_epsilon", "rdp_epsilon", "rdp_step"]
