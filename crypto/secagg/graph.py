"""The SecAgg+ neighbour graph (Bell et al., CCS 2020) and the rule that sizes its degree.

Graph. Clients are placed on a ring in a pseudo-random order derived from the public round seed,
and each is joined to the k/2 nearest on either side: a Harary graph H(n, k) under a random
permutation, as in Bell et al. Server and clients compute it from (seed, roster) alone, so no
adjacency lists travel and a client can check the neighbour keys the server forwards. A client
exchanges pairwise masks and secret shares with its k neighbours only, so its cost is O(k)
instead of O(n). When k >= n - 1 the graph is complete, which is plain SecAgg (Bonawitz 2017).

Degree. Bell et al. prove k = O(log n) suffices. We size k by a simple union bound over the n
clients, for a fraction `gamma` of clients colluding with the server, a fraction `delta` dropping
out, statistical security sigma and correctness eta (all from the config). Each client's
neighbours are k clients drawn without replacement, and hypergeometric tails are bounded by the
binomial ones (Hoeffding 1963), so it is enough that k (even) and t = threshold(k + 1) satisfy:
  (privacy)      n * P[Bin(k, gamma) >= t]       <= 2^-sigma  (colluders never hold t shares of an
                                                               honest client's two secrets)
  (privacy)      n * (gamma + delta)^(k/2)       <= 2^-sigma  (no run of k/2 consecutive bad clients
                                                               on the ring, so the honest survivors
                                                               stay connected and masks only cancel
                                                               in their full sum)
  (correctness)  n * P[Bin(k+1, delta) > k+1-t]  <= 2^-eta    (every client keeps t live holders)
We take the smallest even k that meets all three, or the complete graph if none below n - 1 does.
The second condition is conservative: removing one run of k/2 neighbours of H(n, k) leaves a
connected path-power; disconnecting needs two such runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from .errors import SecAggConfigError


def resolve_threshold(threshold: int | float, holders: int) -> int:
    """Threshold t for a secret shared among `holders` parties (int: as is; float: a fraction)."""
    if isinstance(threshold, float):
        return max(2, math.ceil(threshold * holders - 1e-9))
    return int(threshold)


def binomial_tail(k: int, p: float, at_least: int) -> float:
    """P[Bin(k, p) >= at_least]."""
    if at_least <= 0:
        return 1.0
    if at_least > k:
        return 0.0
    return math.fsum(math.comb(k, j) * p**j * (1.0 - p) ** (k - j) for j in range(at_least, k + 1))


def sparse_degree_ok(
    n: int, k: int, t: int, sigma: int, eta: int, gamma: float, delta: float
) -> bool:
    """Whether (k, t) meets the three union-bound conditions of the module docstring."""
    if not 2 <= t <= k + 1:
        return False
    eps_sec, eps_cor = 2.0**-sigma, 2.0**-eta
    return (
        n * binomial_tail(k, gamma, t) <= eps_sec
        and n * (gamma + delta) ** (k // 2) <= eps_sec
        and n * binomial_tail(k + 1, delta, k + 2 - t) <= eps_cor
    )


def choose_degree(
    n: int,
    neighbours: int | str,
    threshold: int | float,
    sigma: int,
    eta: int,
    gamma: float,
    delta: float,
) -> tuple[int, int]:
    """(k, t) for n clients: degree (n - 1 means complete) and share threshold.

    `neighbours` is "auto" (the union-bound rule) or an int (rounded up to even when sparse).
    """
    if n < 2:
        raise SecAggConfigError(f"secure aggregation needs at least 2 clients, got {n}")
    if neighbours == "auto":
        k = _smallest_sparse_degree(n, threshold, sigma, eta, gamma, delta)
    else:
        k = int(neighbours)
        k = k + (k % 2)
        k = min(k, n - 1)
    t = resolve_threshold(threshold, k + 1)
    if t > k + 1:
        raise SecAggConfigError(
            f"threshold {t} exceeds the {k + 1} shares each secret is split into "
            f"(n={n} clients, {k} neighbours each)"
        )
    if t < 2:
        raise SecAggConfigError("threshold must be at least 2 (one share would reveal a secret)")
    return k, t


def _smallest_sparse_degree(
    n: int, threshold: int | float, sigma: int, eta: int, gamma: float, delta: float
) -> int:
    """The smallest even k < n - 1 that `sparse_degree_ok` accepts, else n - 1 (complete).

    Bounded work for any n, since n can come from another party (the roster a server sends):
    - an integer threshold t keeps t fixed while k grows, so P[Bin(k, gamma) >= t] only grows:
      once the first condition fails at a k with t <= k + 1, it fails for every larger k;
    - the exact binomial tail overflows a float past k ~ 1000 (math.comb grows beyond 1e308):
      a k that large is never needed by a sane security target, so the search stops there with
      the complete graph (a SecAgg+ graph that dense is plain SecAgg anyway).
    Both exits return what the full scan would have returned wherever that scan did not crash.
    """
    eps_sec = 2.0**-sigma
    for k in range(2, n - 1, 2):
        t = resolve_threshold(threshold, k + 1)
        try:
            if sparse_degree_ok(n, k, t, sigma, eta, gamma, delta):
                return k
            if isinstance(threshold, int) and 2 <= t <= k + 1 and n * binomial_tail(k, gamma, t) > eps_sec:
                break
        except OverflowError:
            break
    return n - 1


def _permutation(roster: Sequence[int], seed: bytes) -> list[int]:
    """Fisher-Yates shuffle of the sorted roster driven by SHA-256(seed || counter)."""
    order = sorted(roster)
    counter = 0

    def below(bound: int) -> int:  # uniform in [0, bound) by rejection from 64-bit words
        nonlocal counter
        limit = (1 << 64) - ((1 << 64) % bound)
        while True:
            word = hashlib.sha256(b"secagg-graph" + seed + counter.to_bytes(8, "big")).digest()
            counter += 1
            r = int.from_bytes(word[:8], "big")
            if r < limit:
                return r % bound

    for i in range(len(order) - 1, 0, -1):
        j = below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def neighbour_graph(roster: Sequence[int], degree: int, seed: bytes) -> dict[int, frozenset[int]]:
    """client id -> its neighbours (itself excluded); symmetric; complete when degree >= n - 1."""
    ids = _checked_ids(roster, degree)
    n = len(ids)
    if degree >= n - 1:
        return {u: frozenset(v for v in ids if v != u) for u in ids}
    ring = _permutation(ids, seed)
    half = degree // 2
    return {
        u: frozenset(ring[(pos + d) % n] for d in range(-half, half + 1) if d != 0)
        for pos, u in enumerate(ring)
    }


def neighbours_of(roster: Sequence[int], degree: int, seed: bytes, client: int) -> frozenset[int]:
    """`neighbour_graph(roster, degree, seed)[client]` in O(n) memory: what a client needs (the
    roster comes from the server, so the whole graph of a huge claimed roster must not be built)."""
    ids = _checked_ids(roster, degree)
    if client not in ids:
        raise ValueError(f"client {client} is not in the roster")
    n = len(ids)
    if degree >= n - 1:
        return frozenset(v for v in ids if v != client)
    ring = _permutation(ids, seed)
    pos, half = ring.index(client), degree // 2
    return frozenset(ring[(pos + d) % n] for d in range(-half, half + 1) if d != 0)


def _checked_ids(roster: Sequence[int], degree: int) -> list[int]:
    ids = sorted(set(roster))
    if len(ids) != len(roster):
        raise ValueError("roster has duplicate ids")
    if degree < len(ids) - 1 and degree % 2:
        raise ValueError("a sparse Harary graph needs an even degree")
    return ids
