"""SecAggConfig validation, the neighbour graph and its degree rule."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from crypto.secagg import SecAggConfig, SecAggConfigError, choose_degree, neighbour_graph
from crypto.secagg.graph import sparse_degree_ok


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold": 1},
        {"threshold": 0.0},
        {"threshold": 1.5},
        {"threshold": True},
        {"bits": 33},
        {"bits": 4},
        {"clip": 0.0},
        {"clip": float("inf")},
        {"chunk_bytes": 100},
        {"neighbours": 0},
        {"neighbours": "many"},
        {"unknown": 1},
    ],
)
def test_invalid_configs_are_refused(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError):
        SecAggConfig(**kwargs)


def test_round_resolution_checks_need_n() -> None:
    with pytest.raises(SecAggConfigError, match="threshold 6 exceeds"):
        SecAggConfig(threshold=6).resolve(5)
    with pytest.raises(SecAggConfigError, match="at least 2 clients"):
        SecAggConfig().resolve(1)
    with pytest.raises(SecAggConfigError, match="cannot hold"):
        SecAggConfig(bits=8, max_weight=100).resolve(10)
    p = SecAggConfig(threshold=0.5, chunk_bytes=1 << 20).resolve(10)
    assert (p.degree, p.threshold, p.chunk_words) == (9, 5, 1 << 18)
    assert SecAggConfig(threshold=1.0).resolve(4).threshold == 4


def test_config_round_trips_through_json() -> None:
    cfg = SecAggConfig(threshold=0.6, neighbours=8, clip=3.0, bits=28)
    assert SecAggConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_graph_is_symmetric_regular_and_deterministic() -> None:
    roster = [5, 1, 99, 7, 12, 40, 41, 3, 8, 77, 13]
    seed = bytes(range(32))
    g = neighbour_graph(roster, 4, seed)
    assert g == neighbour_graph(list(reversed(roster)), 4, seed)
    assert all(len(v) == 4 and u not in v for u, v in g.items())
    assert all(u in g[v] for u, vs in g.items() for v in vs)
    assert g != neighbour_graph(roster, 4, bytes(32))  # the seed matters
    full = neighbour_graph(roster, 10, seed)
    assert all(len(v) == 10 for v in full.values())


def test_auto_degree_is_logarithmic_and_meets_its_own_bounds() -> None:
    degrees = {}
    for n in [20, 100, 1000, 10_000, 100_000]:
        k, t = choose_degree(n, "auto", 0.5, 40, 20, 0.1, 0.1)
        degrees[n] = k
        if k < n - 1:
            assert k % 2 == 0 and sparse_degree_ok(n, k, t, 40, 20, 0.1, 0.1)
            assert not sparse_degree_ok(n, k - 2, math.ceil(0.5 * (k - 1)), 40, 20, 0.1, 0.1)
    assert degrees[20] == 19  # small n: complete graph
    assert degrees[100_000] < 80  # O(log n)
    assert degrees[100_000] - degrees[1000] < 20
    assert choose_degree(10, 4, 3, 40, 20, 0.1, 0.1) == (4, 3)
    assert choose_degree(10, 3, 3, 40, 20, 0.1, 0.1) == (4, 3)  # rounded up to even
