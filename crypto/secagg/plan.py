"""The plan of a round: who takes part, known before anyone masks anything.

A plan is the round context (run, round, graph seed) and its members: each member's client id,
name and long-term X25519 channel public key (provisioned, in the federation's CA-signed registry).
The coordinator fixes it one round ahead and sends the same plan to every member; from it and the
config alone, every party derives the same degree, threshold and neighbour graph, so a client can
seal Shamir shares of its next round's secrets to its next round's neighbours before that round
starts (client.py), and check what the coordinator later relays against the graph.

Client ids are derived from names (`member_id`), not chosen by the coordinator, and are what the
client signs: a coordinator cannot give a site another site's id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from . import wire
from .config import SecAggConfig
from .context import RoundContext
from .errors import ProtocolViolationError
from .graph import neighbour_graph

_ID_TAG = b"sovfl-secagg-member/v1"


def member_id(name: str) -> int:
    """The SecAgg client id of the site named `name`: 64 bits of SHA-256, the same everywhere."""
    return int.from_bytes(hashlib.sha256(_ID_TAG + name.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class RoundPlan:
    """The members of one round and what follows from them (graph, threshold)."""

    ctx: RoundContext
    members: tuple[wire.PlanMember, ...]  # sorted by client id
    degree: int
    threshold: int

    @classmethod
    def make(cls, config: SecAggConfig, ctx: RoundContext, members: Iterable[wire.PlanMember]) -> RoundPlan:
        """A checked plan (ProtocolViolationError if members repeat; SecAggConfigError if the config
        cannot run with that many)."""
        ms = tuple(sorted(members, key=lambda m: m.client))
        for what, values in (("client ids", [m.client for m in ms]), ("names", [m.name for m in ms]),
                             ("channel keys", [m.channel_pk for m in ms])):
            if len(set(values)) != len(values):
                raise ProtocolViolationError(f"the plan of round {ctx.round} repeats {what}")
        degree, threshold = config.graph(len(ms))
        return cls(ctx, ms, degree, threshold)

    @classmethod
    def decode(cls, config: SecAggConfig, ctx: RoundContext, data: bytes) -> RoundPlan:
        """Inverse of `encode`, checked as `make` checks."""
        return cls.make(config, ctx, wire.decode_plan(ctx, data))

    def encode(self) -> bytes:
        """The plan's wire bytes (the same for every member)."""
        return wire.encode_plan(self.ctx, self.members)

    @cached_property
    def graph(self) -> dict[int, frozenset[int]]:
        """client id -> its neighbours."""
        return neighbour_graph([m.client for m in self.members], self.degree, self.ctx.graph_seed)

    @cached_property
    def by_id(self) -> dict[int, wire.PlanMember]:
        """client id -> member."""
        return {m.client: m for m in self.members}

    @property
    def ids(self) -> list[int]:
        """The members' client ids, sorted."""
        return [m.client for m in self.members]
