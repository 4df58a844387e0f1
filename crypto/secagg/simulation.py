"""An in-process reference driver: runs one round for many clients in one process.

It shows a protocol driver how the steps chain (what goes to whom, when to close a stage) and
lets tests and benchmarks exercise dropouts: `drop_after[client] = stage` makes that client
vanish after it has sent its message of that stage (0: it never sends its setup).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .client import SecAggClient
from .config import SecAggConfig
from .context import RoundContext
from .keys import KeyPair
from .plan import RoundPlan
from .server import SecAggResult, SecAggServer

SETUP, MASKED_INPUT, UNMASK = 2, 3, 4


@dataclass
class SimulatedRound:
    """The result plus the parties, for tests that want to look inside."""

    result: SecAggResult
    server: SecAggServer
    clients: dict[int, SecAggClient]
    encoded: dict[int, np.ndarray] = field(default_factory=dict)


def make_plan(config: SecAggConfig, ctx: RoundContext, ids: list[int]) -> tuple[RoundPlan, dict[int, bytes]]:
    """A plan of `ids` (named by their ids) with fresh channel keys; the plan and the private keys."""
    pairs = {i: KeyPair.generate() for i in ids}
    plan = RoundPlan.make(config, ctx, [wire.PlanMember(i, str(i), pairs[i].public) for i in ids])
    return plan, {i: p.private for i, p in pairs.items()}


def run_round(
    config: SecAggConfig,
    ctx: RoundContext,
    updates: Mapping[int, np.ndarray],
    weights: Mapping[int, int],
    drop_after: Mapping[int, int] | None = None,
    seeds: Mapping[int, int] | None = None,
    persist: bool = False,
    value_levels: int | None = None,
) -> SimulatedRound:
    """One SecAgg+ round over `updates` (client id -> float vector, all the same length).

    seeds: per-client seed of the stochastic-rounding generator; when given, the encoded ring
      vectors are recomputed and returned in `encoded` so tests can check exactness.
    persist: round-trip every client through `to_state`/`from_state` between stages, as a
      Flower ClientApp (a fresh process per message) would.
    """
    drop = dict(drop_after or {})
    ids = sorted(updates)
    p = next(iter(updates.values())).shape[0]
    plan, channel = make_plan(config, ctx, ids)
    server = SecAggServer(config, plan, vector_len=p)
    clients: dict[int, SecAggClient] = {}

    def alive(i: int, stage: int) -> bool:
        return drop.get(i, 99) >= stage

    def reload(i: int) -> SecAggClient:
        if persist:
            clients[i] = SecAggClient.from_state(config, clients[i].to_state())
        return clients[i]

    for i in ids:
        if alive(i, SETUP):
            clients[i], setup = SecAggClient.setup(config, plan, i, channel[i])
            server.receive_setup(i, setup)
    live = server.close_setup(weight_bound=max(weights.values()) or 1, value_levels=value_levels)
    encoded: dict[int, np.ndarray] = {}
    for i in live:
        if alive(i, MASKED_INPUT):
            rng = np.random.default_rng(seeds[i]) if seeds else None
            req = server.masked_input_request(i)
            for offset, words in reload(i).masked_input(req, updates[i], weights[i], rng=rng):
                server.add_masked_chunk(i, offset, words)
            if seeds:
                assert server.params is not None
                encoded[i] = server.params.codec.encode(updates[i], weights[i], np.random.default_rng(seeds[i]))
    survivors = server.close_masked_input()
    for i in survivors:
        if alive(i, UNMASK):
            server.receive_unmask(i, reload(i).unmask(server.unmask_request(i)))
    return SimulatedRound(server.finish(), server, clients, encoded)
