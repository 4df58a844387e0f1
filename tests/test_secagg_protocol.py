"""The steps end to end, in process: exactness, dropouts at every stage, aborts."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import secagg_to_stage3
from crypto.secagg import (
    SecAggAbort,
    SecAggConfig,
    new_context,
)
from crypto.secagg.simulation import MASKED_INPUT, SETUP, run_round

P = 203  # not a multiple of the chunk: exercises the ragged last chunk and the weight word


def _inputs(ids: list[int], seed: int = 0) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    rng = np.random.default_rng(seed)
    return (
        {i: rng.normal(0, 0.7, P).astype(np.float32) for i in ids},
        {i: int(rng.integers(1, 1000)) for i in ids},
    )


def _check(sim, xs, ws, contributors: list[int], clip: float) -> None:  # type: ignore[no-untyped-def]
    res = sim.result
    assert res.contributors == contributors
    want = np.zeros(P + 1, np.uint64)
    for i in contributors:
        want += sim.encoded[i]
    assert np.array_equal(res.ring_sum, (want % (1 << sim.server.params.codec.bits)).astype(np.uint32))
    assert res.weight_total == sum(ws[i] for i in contributors)
    mean = sum(ws[i] * np.clip(xs[i].astype(np.float64), -clip, clip) for i in contributors) / res.weight_total
    assert np.max(np.abs(res.decode() - mean)) <= res.error_bound()


CFG = SecAggConfig(threshold=3, neighbours="auto", clip=1.0, chunk_bytes=64)
SEEDS = {i: 100 + i for i in range(100)}


@pytest.mark.parametrize("bits", [32, 24])
def test_exact_sum_and_mean_complete_graph(bits: int) -> None:
    ids = [3, 9, 17, 40, 41]
    xs, ws = _inputs(ids)
    cfg = CFG.model_copy(update={"bits": bits})
    sim = run_round(cfg, new_context("run-a", 7), xs, ws, seeds=SEEDS)
    assert sim.server.params.degree == len(ids) - 1
    _check(sim, xs, ws, ids, 1.0)


def test_exact_sum_sparse_graph_with_client_state_persisted() -> None:
    ids = list(range(1, 13))
    xs, ws = _inputs(ids, 1)
    cfg = SecAggConfig(threshold=3, neighbours=4, clip=1.0, chunk_bytes=128)
    sim = run_round(cfg, new_context("run-a", 8), xs, ws, seeds=SEEDS, persist=True)
    assert sim.server.params.degree == 4
    assert all(len(v) == 4 for v in sim.server.graph.values())
    _check(sim, xs, ws, ids, 1.0)


@pytest.mark.parametrize(
    "stage, in_sum",
    [(0, False), (SETUP, False), (MASKED_INPUT, True)],
    ids=["never-sends-its-setup", "after-setup", "after-masked-input"],
)
def test_one_dropout_at_each_stage(stage: int, in_sum: bool) -> None:
    ids = list(range(1, 9))
    xs, ws = _inputs(ids, 2)
    cfg = SecAggConfig(threshold=3, neighbours=4, clip=1.0, chunk_bytes=64)
    sim = run_round(cfg, new_context("r", 1), xs, ws, drop_after={5: stage}, seeds=SEEDS)
    contributors = ids if in_sum else [i for i in ids if i != 5]
    _check(sim, xs, ws, contributors, 1.0)
    assert sim.result.dropped == ([] if stage == 0 else ([] if in_sum else [5]))


def test_several_dropouts_up_to_n_minus_t() -> None:
    ids = list(range(1, 7))  # complete graph, 6 shares, t = 3: three clients may drop
    xs, ws = _inputs(ids, 3)
    cfg = SecAggConfig(threshold=3, neighbours="auto", clip=1.0, chunk_bytes=64)
    sim = run_round(cfg, new_context("r", 2), xs, ws, drop_after={1: 0, 2: SETUP, 3: MASKED_INPUT}, seeds=SEEDS)
    _check(sim, xs, ws, [3, 4, 5, 6], 1.0)
    assert sim.result.dropped == [2]


@pytest.mark.parametrize(
    "drops, where",
    [
        ({1: 0, 2: 0, 3: 0, 4: 0}, "stage 2"),
        ({1: SETUP, 2: SETUP, 3: SETUP, 4: SETUP}, "stage 3"),
        ({1: MASKED_INPUT, 2: MASKED_INPUT, 3: MASKED_INPUT, 4: MASKED_INPUT}, "unmask"),
    ],
)
def test_below_threshold_aborts_cleanly(drops: dict[int, int], where: str) -> None:
    ids = list(range(1, 7))
    xs, ws = _inputs(ids, 4)
    cfg = SecAggConfig(threshold=3, neighbours="auto", clip=1.0, chunk_bytes=64)
    with pytest.raises(SecAggAbort, match=where):
        run_round(cfg, new_context("r", 3), xs, ws, drop_after=drops)


def test_partial_upload_aborts_instead_of_corrupting_the_sum() -> None:
    cfg = SecAggConfig(threshold=2, neighbours="auto", clip=1.0, chunk_bytes=64)
    ids = [1, 2, 3]
    ctx, clients, srv = secagg_to_stage3(cfg, ids, P, run="r", rnd=4)
    for i in ids:
        chunks = clients[i].masked_input(srv.masked_input_request(i), np.zeros(P, np.float32), 1)
        for n, (off, words) in enumerate(chunks):
            if i == 3 and n == 2:
                break
            srv.add_masked_chunk(i, off, words)
    with pytest.raises(SecAggAbort, match="part of their masked input"):
        srv.close_masked_input()


def test_weight_zero_client_and_float64_update() -> None:
    ids = [1, 2, 3, 4]
    xs, ws = _inputs(ids, 5)
    xs[2] = xs[2].astype(np.float64)
    ws[2] = 0
    sim = run_round(CFG, new_context("r", 5), xs, ws, seeds=SEEDS)
    _check(sim, xs, ws, ids, 1.0)


def test_server_prunes_a_client_whose_share_holders_vanished() -> None:
    """Sparse graph: if too few of a client's neighbours share keys, it is left out, not fatal."""
    ids = list(range(1, 13))
    xs, ws = _inputs(ids, 6)
    cfg = SecAggConfig(threshold=3, neighbours=4, clip=1.0, chunk_bytes=64)
    ctx = new_context("r", 6, graph_seed=bytes(range(32)))
    from crypto.secagg import neighbour_graph

    victim = 1
    nbrs = sorted(neighbour_graph(ids, 4, ctx.graph_seed)[victim])
    drops = {v: 0 for v in nbrs[:3]}  # 1 live neighbour + itself = 2 < t = 3
    sim = run_round(cfg, ctx, xs, ws, drop_after=drops, seeds=SEEDS)
    assert victim not in sim.server.live
    # pruning may cascade to clients that shared the dropped neighbours; the rest is exact
    contributors = sim.result.contributors
    assert victim not in contributors and not set(drops) & set(contributors) and len(contributors) >= 3
    _check(sim, xs, ws, contributors, 1.0)
