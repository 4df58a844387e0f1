"""The privacy property of secure aggregation, stated directly, as the coordinator sees it.

The coordinator is honest-but-curious: it runs the protocol and keeps everything it legitimately
receives. The real Coordinator (SecAggRound) and the real ClientApp mods run in process
(federation/ops/inprocess.py); a tap on the grid records every message and reply as serialized on
the wire, and the test plays the curious coordinator with that record:

1. A round without dropouts: the coordinator rebuilds every survivor's self-mask seed from the
   shares it is sent for unmasking (that is what it must do), yet one site's masked vector minus
   its self mask is not that site's encoded input: it is indistinguishable from uniform words over
   the ring (the pairwise masks still hide it). A build without pairwise masks fails here.
2. A site that vanishes after its keys were shared has its pairwise secret rebuilt from its
   neighbours' shares. That secret must never serve again: in every later round the site
   advertises other public keys, and masks derived from the rebuilt secret do not open its later
   masked vectors (a build that kept a site's mask key across rounds fails here).

Only the extraction of those items from the wire (`WireRecord`) knows the message layout: it was
written against the four-stage protocol and adapted, assertions unchanged, to the pipelined one.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from crypto.secagg import RoundContext, member_id, shamir, wire
from crypto.secagg.keys import pairwise_mask_key, public_from_private, self_mask_key
from crypto.secagg.prg import expand
from federation.ops.inprocess import FunctionTrainer, InProcessGrid, InProcessSite, task_identity
from federation.protocol import message_keys as keys
from federation.protocol.secagg_records import Request, parse_chunks
from test_secagg_security import _chi_square_p_value

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._fedsim import RUN_ID, coordinator  # noqa: E402

SITES = ["a", "b", "c", "d"]
P = 8192  # enough words for a 256-bin uniformity test


class TappedGrid(InProcessGrid):
    """The in-process grid, keeping every (message, reply) pair as it crossed the wire."""

    def __init__(self, sites):
        super().__init__(sites, RUN_ID)
        self.log: list[tuple] = []

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids):
            self.log.append((msg, self.replies.get(mid)))
        return ids


class WireRecord:
    """What the curious coordinator extracts from the tapped messages (the layout lives here)."""

    def __init__(self, grid: TappedGrid, names: dict[int, str]):
        self.ctx: dict[int, RoundContext] = {}
        self.masked: dict[tuple[int, str], np.ndarray] = {}  # (round, site) -> masked ring vector
        self.adverts: dict[tuple[int, str], bytes] = {}  # (round, site) -> advertised mask public key
        self.ids: dict[str, int] = {name: member_id(name) for name in names.values()}
        self.unmask: dict[int, list[tuple[int, int, bytes]]] = defaultdict(list)  # round -> (owner, kind, share)
        for msg, reply in grid.log:
            if reply is None or reply.has_error():
                continue
            site = names[msg.metadata.dst_node_id]
            me = self.ids[site]
            if keys.SECAGG_SETUP in msg.content.config_records:
                req = Request.parse(msg, keys.SECAGG_SETUP)
                self.ctx[req.ctx.round] = req.ctx
                rec = reply.content.config_records[keys.SECAGG_SETUP]
                if "advert" in rec:
                    self.adverts[(req.ctx.round, site)] = wire.decode_advert(req.ctx, bytes(rec["advert"]), me).s_pk
            if keys.SECAGG not in msg.content.config_records:
                continue
            req = Request.parse(msg)
            rec = reply.content.config_records[keys.SECAGG]
            if req.stage == keys.MASKED_INPUT:
                length = int(req.record["vector_len"]) + 1
                chunks = parse_chunks(reply, length, int(rec["bits"]))
                self.masked[(req.ctx.round, site)] = np.concatenate([c.words for c in chunks])
            elif req.stage == keys.UNMASK:
                self.unmask[req.ctx.round] += wire.decode_unmask_reply(req.ctx, bytes(rec["data"]), me)

    def rebuilt(self, rnd: int, kind: int, owner: str, threshold: int) -> bytes | None:
        """A secret of `owner` rebuilt from the shares of this kind the coordinator received."""
        shares = [s for o, k, s in self.unmask[rnd] if o == self.ids[owner] and k == kind]
        return shamir.combine_secret(shares[:threshold], threshold) if len(shares) >= threshold else None


def federation(tmp_path: Path, rounds: int, faults: dict[str, str] | None = None):
    """Four in-process sites with a non-uniform update each; encoded ring vectors dumped (test hook)."""
    model = {"w": np.zeros((64, P // 64), np.float32)}

    def trainer(i: int) -> FunctionTrainer:
        def train(glob, config):
            rng = np.random.default_rng([i, config.round])
            return {"w": (rng.normal(size=glob["w"].shape) * 0.01).astype(np.float32)}, {}
        return FunctionTrainer(train, 100 + i, tmp_path / f"site-{i}")

    sites = [InProcessSite(name, i + 1, trainer(i), {"secagg-dump-dir": str(tmp_path / "ring" / name),
                                                      **({"secagg-fault": faults[name]} if faults and name in faults else {})},
                           RUN_ID) for i, name in enumerate(SITES)]
    grid = TappedGrid(sites)
    coord = coordinator(tmp_path, model, sites, rounds=rounds, evaluate=False,
                        secagg={"enabled": True, "threshold": 3, "clip": 0.5, "bits": 32})
    coord.grid = grid
    return coord, grid, {s.node_id: s.name for s in sites}


def encoded(tmp_path: Path, site: str, rnd: int) -> np.ndarray:
    return np.load(tmp_path / "ring" / site / f"round_{rnd:04d}.npy")


def assert_hidden(residual: np.ndarray, plain: np.ndarray) -> None:
    """`residual` (masked vector minus what the coordinator can remove) reveals nothing of `plain`."""
    assert residual.shape == plain.shape
    assert not np.array_equal(residual, plain)
    assert np.mean(residual == plain) < 0.01  # not even coordinate by coordinate
    assert _chi_square_p_value(np.bincount(residual >> np.uint32(24), minlength=256)) > 1e-6
    assert _chi_square_p_value(np.bincount(plain >> np.uint32(24), minlength=256)) < 1e-9


def test_self_mask_seeds_of_every_survivor_do_not_reveal_any_input(tmp_path):
    with task_identity(RUN_ID):
        coord, grid, names = federation(tmp_path, rounds=1)
        line = coord.run_round(1)
    assert line["status"] == "aggregated" and line["secagg"]["contributors"] == SITES
    seen = WireRecord(grid, names)
    t, ctx = line["secagg"]["threshold"], seen.ctx[1]
    for site in SITES:
        # a survivor's pairwise key is never sent in a no-dropout round, only its self-mask seed
        assert seen.rebuilt(1, wire.ShareKind.MASK_KEY, site, t) is None
        seed = seen.rebuilt(1, wire.ShareKind.SELF_MASK_SEED, site, t)
        assert seed is not None
        masked = seen.masked[(1, site)]
        self_mask = expand(self_mask_key(seed, ctx, seen.ids[site]), masked.shape[0])
        assert_hidden(masked - self_mask, encoded(tmp_path, site, 1))


def test_a_pairwise_secret_rebuilt_after_a_dropout_is_never_used_again(tmp_path):
    with task_identity(RUN_ID):
        coord, grid, names = federation(tmp_path, rounds=4, faults={"a": "round=2,after=setup"})
        lines = [coord.run_round(r) for r in range(1, 5)]
    assert [x["status"] for x in lines] == ["aggregated"] * 4
    assert lines[1]["secagg"]["dropped"] == ["a"]
    seen = WireRecord(grid, names)
    t = lines[1]["secagg"]["threshold"]
    old = seen.rebuilt(2, wire.ShareKind.MASK_KEY, "a", t)
    assert old is not None and public_from_private(old) == seen.adverts[(2, "a")]  # the coordinator holds it
    later = [r for r in (3, 4) if "a" in lines[r - 1]["secagg"]["contributors"]]
    assert later, "site a took part in no later round"
    for rnd in later:
        assert seen.adverts[(rnd, "a")] != seen.adverts[(2, "a")]
        ctx, me = seen.ctx[rnd], seen.ids["a"]
        masked = seen.masked[(rnd, "a")]
        residual = masked - expand(self_mask_key(seen.rebuilt(rnd, wire.ShareKind.SELF_MASK_SEED, "a", t), ctx, me),
                                   masked.shape[0])
        for other in SITES[1:]:  # every mask a pairwise key from the old secret would give
            v = seen.ids[other]
            mask = expand(pairwise_mask_key(old, seen.adverts[(rnd, other)], ctx, me, v), masked.shape[0])
            residual = residual - mask if me < v else residual + mask
        assert_hidden(residual, encoded(tmp_path, "a", rnd))


@pytest.fixture(autouse=True)
def _one_blas_thread():
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield
