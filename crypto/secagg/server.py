"""Server side of SecAgg+: routes keys and shares, sums masked chunks, removes the masks.

    server = SecAggServer(config, plan, vector_len=P)   # plan.py: the round's members, one round ahead
    # setup: for each client's setup    server.receive_setup(node, setup_bytes)
    live = server.close_setup(include, weight_bound, value_levels)   # U2 and the ring
    # then send server.masked_input_request(node) to each live client
    # stage 3: for each chunk           server.add_masked_chunk(node, offset, words)
    survivors = server.close_masked_input()   # then send server.unmask_request(node) to each
    # stage 4: for each reply           server.receive_unmask(node, reply_bytes)
    result = server.finish()            # result.decode() -> float32 weighted mean

Setups may arrive long before the round (a driver collects round r + 1's setups with round r's
replies). `close_setup` fixes U2: the clients whose setup arrived and that the driver still wants
(`include`: e.g. the sampled and admitted ones); a member left out never has its keys or envelopes
relayed, so nobody masks with it and nothing of it needs rebuilding.

Memory is O(P): one uint32 accumulator of P + 1 words (chunks are added as they arrive) plus
chunk-sized scratch. A `receive_*`/`add_*` call raises a `SecAggMessageError` for a bad message
and leaves the state untouched, so the driver can count it and treat the sender as dropped.
`close_*` and `finish` raise `SecAggAbort` when fewer than `threshold` clients or shares remain.

A client whose masked input arrived only in part cannot be taken out of the sum again (that
would need O(P) memory per client), so `close_masked_input` aborts in that case: drivers should
add a client's chunks once its whole upload has arrived (Flower delivers whole messages).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import keys, ring, shamir, wire
from .client import seed_commitment
from .config import RoundParams, SecAggConfig
from .plan import RoundPlan
from .context import RoundContext
from .encoding import FixedPointCodec
from .errors import (
    MalformedMessageError,
    ProtocolViolationError,
    ReconstructionError,
    SecAggAbort,
    SecAggConfigError,
    SecAggMessageError,
)
from .prg import MaskExpander

MAX_RECONSTRUCTION_TRIES = 256  # subsets of t shares tried when some shares are bad
DECODE_WORDS = 1 << 16  # decode in slices this long: the float64 temporary stays at 512 KiB


@dataclass
class SecAggResult:
    """Unmasked sum of the survivors' ring vectors and what is needed to decode it."""

    ring_sum: np.ndarray  # uint32, P + 1 words: sum of encoded updates, then the total weight
    weight_total: int
    contributors: list[int]
    dropped: list[int]
    codec: FixedPointCodec
    chunk_words: int

    def decode(self, out: np.ndarray | None = None) -> np.ndarray:
        """Float32 weighted mean of the contributors' clipped updates, decoded chunk by chunk."""
        p = self.ring_sum.shape[0] - 1
        out = np.empty(p, dtype=np.float32) if out is None else out
        step = min(self.chunk_words, DECODE_WORDS)
        for off in range(0, p, step):
            end = min(p, off + step)
            self.codec.decode_into(self.ring_sum[off:end], self.weight_total, out[off:end])
        return out

    def error_bound(self) -> float:
        """Per-coordinate bound on |decode() - weighted mean of the clipped inputs|."""
        return self.codec.error_bound(len(self.contributors), self.weight_total)


@dataclass
class _Upload:
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    words: int = 0


class SecAggServer:
    """The server's SecAgg+ state for one round (honest-but-curious: follows the protocol)."""

    def __init__(self, config: SecAggConfig, plan: RoundPlan, vector_len: int) -> None:
        if vector_len < 1:
            raise ValueError("vector_len must be at least 1")
        self.config, self.plan, self.ctx = config, plan, plan.ctx
        self.length = vector_len + 1  # ring vector: P parameter words + the weight word
        self.graph = plan.graph
        self.roster = plan.ids
        self.setups: dict[int, wire.Setup] = {}
        self.params: RoundParams | None = None
        self.live: list[int] = []  # U2
        self._live_set: frozenset[int] = frozenset()
        self._acc: np.ndarray | None = None
        self._uploads: dict[int, _Upload] = {}
        self.survivors: list[int] = []  # U3
        self._requests: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._seed_shares: dict[int, list[bytes]] = {}
        self._key_shares: dict[int, list[bytes]] = {}
        self._answered: set[int] = set()
        self._stage = 2

    # ---- setup (stages 1 and 2 of Bonawitz et al., in one message) -----------------------------
    def receive_setup(self, sender: int, data: bytes) -> None:
        """Take one member's setup: its mask key, seed commitment and envelopes to its neighbours."""
        self._expect(2)
        if sender not in self.graph:
            raise ProtocolViolationError(f"client {sender} is not a member of this round's plan")
        if sender in self.setups:
            raise ProtocolViolationError(f"client {sender} sent its setup twice")
        setup = wire.decode_setup(self.ctx, data, sender)
        if set(setup.envelopes) != self.graph[sender]:
            raise ProtocolViolationError(
                f"client {sender} sent envelopes to {sorted(setup.envelopes)}, its neighbours are "
                f"{sorted(self.graph[sender])}"
            )
        if setup.s_pk in {s.s_pk for s in self.setups.values()}:
            raise ProtocolViolationError(f"client {sender} advertised a public key already in use")
        keys.agree(keys.KeyPair.generate().private, setup.s_pk)  # rejects low-order points early
        self.setups[sender] = setup

    def close_setup(self, include: Iterable[int] | None = None, weight_bound: int | None = None,
                    value_levels: int | None = None) -> list[int]:
        """End the setup: U2 = members whose setup arrived (and in `include`, when given), pruned
        until each keeps t - 1 live neighbours; the ring for at most |U2| inputs of weight <=
        weight_bound (config.codec)."""
        self._expect(2)
        t = self.plan.threshold
        live = set(self.setups) if include is None else set(self.setups) & set(include)
        while True:  # a client whose shares too few live neighbours hold can never be unmasked
            weak = {u for u in live if len(self.graph[u] & live) + 1 < t}
            if not weak:
                break
            live -= weak
        if len(live) < t:
            raise SecAggAbort(
                f"stage 2: {len(live)} clients can continue (of {len(self.setups)} with a setup), "
                f"fewer than the threshold {t}"
            )
        try:
            codec = self.config.codec(len(live), weight_bound, value_levels)
        except SecAggConfigError as exc:
            raise SecAggAbort(f"stage 2: {exc}") from exc
        self.params = RoundParams(len(self.roster), self.plan.degree, t, codec, self.config.chunk_words(codec.bits))
        self.live = sorted(live)
        self._live_set = frozenset(live)
        self._stage = 3
        return list(self.live)

    def masked_input_request(self, client: int) -> bytes:
        """The ring and the client's live neighbours' keys and envelopes to it."""
        self._expect(3)
        if client not in self._live_set:
            raise ProtocolViolationError(f"client {client} is not live in stage 3")
        assert self.params is not None
        c = self.params.codec
        relayed = [wire.Relayed(v, self.setups[v].s_pk, self.setups[v].envelopes[client])
                   for v in sorted(self.graph[client] & self._live_set)]
        return wire.encode_masked_input_request(self.ctx, client, wire.RingSpec(c.bits, c.levels, c.max_weight), relayed)

    # ---- stage 3 ---------------------------------------------------------------------------
    @property
    def accumulator(self) -> np.ndarray:
        if self._acc is None:
            self._acc = np.zeros(self.length, dtype=np.uint32)
        return self._acc

    def add_masked_chunk(self, sender: int, offset: int, words: np.ndarray) -> None:
        """Add one masked chunk (uint32 words of the sender's ring vector at `offset`)."""
        self._expect(3)
        if sender not in self._live_set:
            raise ProtocolViolationError(f"client {sender} is not live in stage 3")
        if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.ndim != 1:
            raise MalformedMessageError("a masked chunk must be a 1-D uint32 array")
        n = words.shape[0]
        if not 0 <= offset or offset + n > self.length or n == 0:
            raise MalformedMessageError(f"chunk [{offset}, {offset + n}) outside the vector of {self.length} words")
        assert self.params is not None
        bits = self.params.codec.bits
        if bits < 32 and int(words.max()) >> bits:
            raise MalformedMessageError(f"chunk words outside the ring Z_2^{bits}")
        up = self._uploads.setdefault(sender, _Upload())
        i = bisect.bisect_left(up.starts, offset)
        if (i < len(up.starts) and up.starts[i] < offset + n) or (i > 0 and up.ends[i - 1] > offset):
            raise ProtocolViolationError(f"client {sender} sent overlapping chunks at offset {offset}")
        acc = self.accumulator[offset : offset + n]
        np.add(acc, words, out=acc)
        up.starts.insert(i, offset)
        up.ends.insert(i, offset + n)
        up.words += n

    def close_masked_input(self) -> list[int]:
        """End stage 3: U3 = clients whose whole masked vector arrived."""
        self._expect(3)
        assert self.params is not None
        partial = sorted(u for u, up in self._uploads.items() if up.words != self.length)
        if partial:
            raise SecAggAbort(
                f"stage 3: clients {partial} sent part of their masked input; it is in the sum and "
                "cannot be removed without it (add a client's chunks only once all have arrived)"
            )
        t = self.params.threshold
        u3 = set(self._uploads)
        live = set(self.live)
        if len(u3) < t:
            raise SecAggAbort(f"stage 3: {len(u3)} masked inputs arrived, fewer than the threshold {t}")
        for u in sorted(live):  # every secret we must rebuild needs t holders among U3
            holders = len(self.graph[u] & u3) + (u in u3)
            if holders < t:
                raise SecAggAbort(
                    f"stage 3: only {holders} of client {u}'s share holders sent masked inputs, "
                    f"threshold {t}: its masks could not be removed"
                )
        self.survivors = sorted(u3)
        dropped = live - u3
        self._requests = {
            u: (frozenset((self.graph[u] & u3) | {u}), frozenset(self.graph[u] & dropped)) for u in self.survivors
        }
        self._stage = 4
        return list(self.survivors)

    def unmask_request(self, client: int) -> bytes:
        self._expect(4)
        s, d = self._requests[client]
        return wire.encode_unmask_request(self.ctx, client, sorted(s), sorted(d))

    # ---- stage 4 ---------------------------------------------------------------------------
    def receive_unmask(self, sender: int, data: bytes) -> None:
        self._expect(4)
        if sender not in self._requests:
            raise ProtocolViolationError(f"client {sender} was not asked to unmask")
        if sender in self._answered:
            raise ProtocolViolationError(f"client {sender} answered the unmask request twice")
        entries = wire.decode_unmask_reply(self.ctx, data, sender)
        s, d = self._requests[sender]
        want = {(u, wire.ShareKind.SELF_MASK_SEED) for u in s} | {(u, wire.ShareKind.MASK_KEY) for u in d}
        got = [(u, k) for u, k, _ in entries]
        if len(set(got)) != len(got) or not set(got) <= want:
            raise ProtocolViolationError(f"client {sender} answered shares that were not requested")
        x = shamir.x_for(sender)
        for _, _, share in entries:
            if shamir.Share.from_bytes(share).x != x:
                raise MalformedMessageError(f"client {sender} sent a share with another holder's x")
        self._answered.add(sender)
        for u, kind, share in entries:
            store = self._seed_shares if kind == wire.ShareKind.SELF_MASK_SEED else self._key_shares
            store.setdefault(u, []).append(share)

    def finish(self) -> SecAggResult:
        """Rebuild the secrets, remove all masks chunk by chunk, return the unmasked sum."""
        self._expect(4)
        assert self.params is not None
        t, bits, cw = self.params.threshold, self.params.codec.bits, self.params.chunk_words
        u3 = set(self.survivors)
        dropped = sorted(set(self.live) - u3)
        masks: list[tuple[bytes, int]] = []
        for u in self.survivors:
            seed = self._rebuild(
                u, self._seed_shares.get(u, []), t, "self-mask seed",
                lambda s, u=u: seed_commitment(self.ctx, u, s) == self.setups[u].commitment,
            )
            masks.append((keys.self_mask_key(seed, self.ctx, u), -1))
        for u in dropped:
            s_pk = self.setups[u].s_pk
            sk = self._rebuild(
                u, self._key_shares.get(u, []), t, "mask key",
                lambda s, pk=s_pk: _public_matches(s, pk),
            )
            for v in sorted(self.graph[u] & u3):  # v added +mask if v < u, -mask otherwise
                k = keys.pairwise_mask_key(sk, self.setups[v].s_pk, self.ctx, u, v)
                masks.append((k, -1 if v < u else 1))
        acc = self.accumulator
        expander = MaskExpander()
        for off in range(0, self.length, cw):
            view = acc[off : off + cw]
            expander.apply_masks(view, masks, off)
            ring.reduce_inplace(view, bits)
        self._stage = 5
        return SecAggResult(acc, int(acc[-1]), list(self.survivors), dropped, self.params.codec, cw)

    @staticmethod
    def _rebuild(owner: int, shares: Sequence[bytes], t: int, what: str, ok: Callable[[bytes], bool]) -> bytes:
        """A secret from t shares that passes `ok`; tries other subsets if some shares are bad."""
        if len(shares) < t:
            raise SecAggAbort(f"unmask: {len(shares)} shares of client {owner}'s {what} arrived, threshold {t}")
        for subset in itertools.islice(itertools.combinations(shares, t), MAX_RECONSTRUCTION_TRIES):
            try:
                secret = shamir.combine_secret(subset, t)
            except SecAggMessageError:
                continue
            if ok(secret):
                return secret
        raise ReconstructionError(
            f"unmask: no {t} of the {len(shares)} shares of client {owner}'s {what} rebuild the committed value"
        )

    def _expect(self, stage: int) -> None:
        if self._stage != stage:
            names = {2: "setup", 3: "masked input", 4: "unmask", 5: "finished"}
            raise ProtocolViolationError(f"server is in stage '{names[self._stage]}', not '{names[stage]}'")


def _public_matches(private: bytes, public: bytes) -> bool:
    try:
        return keys.public_from_private(private) == public
    except ValueError:
        return False
