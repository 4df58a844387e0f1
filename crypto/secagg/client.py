"""Client side of SecAgg+: one round's state object, set up one round ahead.

    client, setup = SecAggClient.setup(config, plan, my_id, channel_key)   # -> server (bytes), with
    advert = client.advert()                                               #    the signed advert
    for offset, words in client.masked_input(masked_input_request, update, weight):
        keep(offset, words.copy())                                         # stage 3 -> server
    shares = client.unmask(unmask_request)                                 # stage 4 -> server

Setup (Bonawitz et al. stages 1 and 2 in one message). From the round's plan (plan.py: members,
their long-term channel keys, the graph), the client draws a fresh mask key pair s_u and a fresh
self-mask seed b_u, splits both into Shamir shares for its neighbours and itself, and seals each
neighbour's pair of shares under a key derived from the two sites' long-term X25519 channel keys
(provisioned) and the round context. No round trip is needed between advertising keys and sharing
them, so a driver can send the setup of round r + 1 with the reply of round r.

Masked input (stage 3): the server relays, for each neighbour whose setup it holds and that takes
part (the live neighbours), its mask public key (which the driver checks against the neighbour's
signature) and its envelope to this client. The client opens the envelopes, adds its self mask and
one pairwise mask per live neighbour, and the encoded input, in the ring the server announces.

The object holds this round's secrets; `to_state()` / `from_state()` carry it between the
short-lived processes a Flower ClientApp runs in (keep that state on the site: it holds keys).
Each step runs once, in order: re-masking an input under the same masks, or answering two
unmask requests, would let the server learn an individual input. Every round has its own s_u and
b_u: a mask key the server may have rebuilt after a dropout is never used again. Signing is the
driver's part (signing.py): this object never sees the site's signing key.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from enum import IntEnum
from typing import Any

import numpy as np

from . import keys, ring, shamir, wire
from .config import RoundParams, SecAggConfig
from .context import RoundContext
from .encoding import FixedPointCodec, noise_key
from .errors import MalformedMessageError, ProtocolViolationError, SecAggAbort, SecAggConfigError
from .graph import neighbours_of
from .keys import KeyPair
from .plan import RoundPlan
from .prg import PIECE_WORDS, MaskExpander


class ClientStage(IntEnum):
    SHARED = 2  # set up: keys drawn, shares sealed
    MASKED = 3
    UNMASKED = 4


def seed_commitment(ctx: RoundContext, client_id: int, seed: bytes) -> bytes:
    """SHA-256 commitment to a self-mask seed: lets the server check a rebuilt seed."""
    return hashlib.sha256(b"self-mask-commitment" + ctx.digest() + client_id.to_bytes(8, "big") + seed).digest()


class SecAggClient:
    """One client's SecAgg+ state for one round (made by `setup`)."""

    config: SecAggConfig
    ctx: RoundContext
    id: int
    stage: ClientStage
    n_clients: int
    threshold: int
    neighbours: frozenset[int]
    params: RoundParams | None  # known from the masked-input request on

    @classmethod
    def setup(cls, config: SecAggConfig, plan: RoundPlan, client_id: int, channel_private: bytes) -> tuple[SecAggClient, bytes]:
        """Draw this round's secrets and seal their shares to the plan's neighbours; the client and
        its SETUP message. `channel_private`: this client's long-term X25519 channel key, whose
        public half the plan must hold for it (else ProtocolViolationError)."""
        me = plan.by_id.get(client_id)
        if me is None:
            raise ProtocolViolationError(f"client {client_id} is not a member of the plan of round {plan.ctx.round}")
        if keys.public_from_private(channel_private) != me.channel_pk:
            raise ProtocolViolationError("the plan holds another channel key for this client than its own")
        self = cls.__new__(cls)
        self.config, self.ctx, self.id = config, plan.ctx, client_id
        self.n_clients, self.threshold = len(plan.members), plan.threshold
        self.neighbours = neighbours_of(plan.ids, plan.degree, plan.ctx.graph_seed, client_id)  # O(n), not the graph
        self._s = KeyPair.generate()  # mask keys of this round only; the private half is secret-shared
        self._seed = os.urandom(32)  # self-mask seed b_u, secret-shared
        holders = sorted(self.neighbours | {client_id})
        seed_shares = shamir.split_secret(self._seed, plan.threshold, holders)
        key_shares = shamir.split_secret(self._s.private, plan.threshold, holders)
        self._channel: dict[int, bytes] = {}  # neighbour -> this round's AEAD key with it
        envelopes = {}
        for v in sorted(self.neighbours):
            k = keys.share_channel_key(channel_private, plan.by_id[v].channel_pk, plan.ctx, client_id, v)
            self._channel[v] = k
            envelopes[v] = wire.seal_envelope(k, plan.ctx, client_id, v, seed_shares[v] + key_shares[v])
        self._held: dict[int, tuple[bytes, bytes]] = {client_id: (seed_shares[client_id], key_shares[client_id])}
        self._peer_s: dict[int, bytes] = {}  # live neighbour -> its mask public key
        self.live_neighbours: frozenset[int] = frozenset()
        self.params = None
        self.stage = ClientStage.SHARED
        msg = wire.Setup(client_id, self._s.public, seed_commitment(plan.ctx, client_id, self._seed), envelopes)
        return self, wire.encode_setup(plan.ctx, msg)

    def advert(self) -> bytes:
        """(id, mask public key) for this round: what the driver signs and neighbours check."""
        return wire.encode_advert(self.ctx, wire.Advert(self.id, self._s.public))

    # ---- stage 3 ---------------------------------------------------------------------------
    def receive_shares(self, request: bytes) -> list[wire.Relayed]:
        """Stage 3, first half: check the ring and the relayed keys, open the live neighbours'
        envelopes. Returns what was relayed (the driver checks the signatures of its keys)."""
        self._expect(ClientStage.SHARED)
        spec, relayed = wire.decode_masked_input_request(self.ctx, request, self.id)
        stray = {x.client for x in relayed} - self.neighbours
        if stray:
            raise ProtocolViolationError(f"keys and envelopes of non-neighbours {sorted(stray)}")
        s_pks = [x.s_pk for x in relayed] + [self._s.public]
        if len(set(s_pks)) != len(s_pks):
            raise ProtocolViolationError("some relayed mask public keys are identical (or equal to ours)")
        if len(relayed) + 1 < self.threshold:
            raise SecAggAbort(
                f"client {self.id}: only {len(relayed)} live neighbours, threshold {self.threshold} cannot be met"
            )
        codec = FixedPointCodec(self.config.clip, spec.bits, spec.levels, spec.weight_bound)
        try:
            codec.check_round()
        except (SecAggConfigError, ValueError) as err:
            raise ProtocolViolationError(f"the announced ring is unusable: {err}") from None
        if spec.weight_bound > self.config.max_weight:
            raise ProtocolViolationError(f"weight bound {spec.weight_bound} above max_weight {self.config.max_weight}")
        held = {}
        for x in relayed:
            plain = wire.open_envelope(self._channel[x.client], self.ctx, x.client, self.id, x.envelope)
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise MalformedMessageError(f"envelope from {x.client} holds {len(plain)} bytes")
            held[x.client] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])
            for s in held[x.client]:
                if shamir.Share.from_bytes(s).x != shamir.x_for(self.id):
                    raise ProtocolViolationError(f"client {x.client} sent a share for another holder")
            keys.agree(self._s.private, x.s_pk)  # rejects a low-order key before it masks anything
        self._held.update(held)
        self._peer_s = {x.client: x.s_pk for x in relayed}
        self.live_neighbours = frozenset(self._peer_s)
        self.params = RoundParams(self.n_clients, len(self.neighbours), self.threshold, codec,
                                  self.config.chunk_words(codec.bits))
        self.stage = ClientStage.MASKED  # from here on the masks are fixed: mask once only
        return relayed

    def masked_input(
        self, request: bytes, update: np.ndarray, weight: int, rng: np.random.Generator | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Stage 3: receive the shares, then encode and mask `update` chunk by chunk.

        Yields (offset, uint32 words) over the ring vector [encoded update (P words), weight], at
        most `params.chunk_words` per chunk. The words are a view of one buffer that the next chunk
        overwrites: send or copy each chunk before drawing the next. `rng` drives stochastic
        rounding (its noise key is drawn from it; default: os.urandom).

        An update holding NaN raises ValueError when its chunk is reached (found in the encoded
        words, not by a scan beforehand): send a client's chunks only once the generator is
        exhausted, as the server cannot take a partial upload out of the sum again.
        """
        x = np.asarray(update).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"the update must be a float array, got {x.dtype}")
        return self.masked_input_from(request, x.shape[0], lambda offset, n: x[offset : offset + n], weight, rng)

    def masked_input_from(
        self, request: bytes, length: int, read: Callable[[int, int], np.ndarray], weight: int,
        rng: np.random.Generator | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Stage 3 as `masked_input`, for an update of `length` values that is never whole in memory:
        `read(offset, n)` gives values [offset, offset + n) as a float array (valid until the next
        call; asked for in increasing order, at most `prg.PIECE_WORDS` at a time). The chunks are
        bit for bit those `masked_input` yields for the vector `read` describes (same noise, same
        masks): a site can mask an update read a slice at a time from a file."""
        self._expect(ClientStage.SHARED)
        if isinstance(length, bool) or int(length) != length or length < 0:
            raise ValueError(f"the update length must be a non-negative integer, got {length!r}")
        spec, _ = wire.decode_masked_input_request(self.ctx, request, self.id)
        w = FixedPointCodec(self.config.clip, spec.bits, spec.levels, spec.weight_bound).check_weight(weight)
        self.receive_shares(request)
        assert self.params is not None
        encoder = _Encoder(self.params.codec, int(length), read, w, noise_key(rng))
        return self._mask_chunks(int(length) + 1, encoder.fill)

    def mask_encoded(self, request: bytes, ring_vector: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """Stage 3 for an input already encoded in the ring (any uint32 vector, values < 2^b);
        chunks as `masked_input` yields them."""
        self.receive_shares(request)
        vec = np.asarray(ring_vector, dtype=np.uint32).reshape(-1)

        def fill(offset: int, piece: np.ndarray, _: MaskExpander) -> None:
            piece[:] = vec[offset : offset + piece.shape[0]]

        return self._mask_chunks(vec.shape[0], fill)

    def _mask_chunks(
        self, length: int, fill: Callable[[int, np.ndarray, MaskExpander], None]
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Chunks of the masked ring vector; `fill` writes the plain words of each piece.

        One pass per cache-sized piece: `fill` encodes into it, then every mask is added in
        place. The streams are opened once and read in order, and all chunks share one buffer.
        """
        assert self.params is not None
        bits, cw = self.params.codec.bits, self.params.chunk_words
        masks = [(keys.self_mask_key(self._seed, self.ctx, self.id), 1)]
        for v in sorted(self.live_neighbours):
            k = keys.pairwise_mask_key(self._s.private, self._peer_s[v], self.ctx, self.id, v)
            masks.append((k, 1 if self.id < v else -1))  # + for the smaller id, - for the larger

        def gen() -> Iterator[tuple[int, np.ndarray]]:
            expander = MaskExpander()
            pw = expander.piece_words
            opened = expander.open_masks(masks, 0)
            buf = np.empty(min(cw, length), dtype=np.uint32)
            for offset in range(0, length, cw):
                words = buf[: min(cw, length - offset)]
                with np.errstate(invalid="ignore"):  # see FixedPointCodec.encode_into
                    for s in range(0, words.shape[0], pw):
                        piece = words[s : s + pw]
                        fill(offset + s, piece, expander)
                        opened.apply(piece)
                yield offset, ring.reduce_inplace(words, bits)

        return gen()

    # ---- stage 4 ---------------------------------------------------------------------------
    def unmask(self, request: bytes) -> bytes:
        """Stage 4: seed shares of survivors, s-key shares of dropped neighbours; never both."""
        self._expect(ClientStage.MASKED)
        survivors, dropped = wire.decode_unmask_request(self.ctx, request, self.id)
        s_set, d_set = set(survivors), set(dropped)
        if len(s_set) != len(survivors) or len(d_set) != len(dropped) or s_set & d_set:
            raise ProtocolViolationError("survivor and dropped lists overlap or repeat ids")
        if self.id not in s_set or self.id in d_set:
            raise ProtocolViolationError("this client sent its masked input but is not listed as a survivor")
        unknown = (s_set | d_set) - self.live_neighbours - {self.id}
        if unknown:
            raise ProtocolViolationError(f"unmask request names non-live-neighbours {sorted(unknown)}")
        if len(s_set) < self.threshold:
            raise SecAggAbort(
                f"client {self.id}: {len(s_set)} survivors among its neighbours, "
                f"fewer than the threshold {self.threshold}"
            )
        out = [(u, wire.ShareKind.SELF_MASK_SEED, self._held[u][0]) for u in sorted(s_set)]
        out += [(u, wire.ShareKind.MASK_KEY, self._held[u][1]) for u in sorted(d_set)]
        self.stage = ClientStage.UNMASKED
        return wire.encode_unmask_reply(self.ctx, self.id, out)

    # ---- persistence -----------------------------------------------------------------------
    def to_state(self) -> bytes:
        """This round's state (SECRET: mask key, seed, channel keys, shares) as bytes."""
        h = bytes.hex
        codec = self.params.codec if self.params else None
        doc = {
            "ctx": [self.ctx.run_id, self.ctx.round, h(self.ctx.graph_seed)],
            "id": self.id,
            "stage": int(self.stage),
            "n": self.n_clients,
            "t": self.threshold,
            "s": [h(self._s.private), h(self._s.public)],
            "seed": h(self._seed),
            "neighbours": sorted(self.neighbours),
            "channel": {str(k): h(v) for k, v in self._channel.items()},
            "held": {str(k): [h(a), h(b)] for k, (a, b) in self._held.items()},
            "peers": {str(k): h(v) for k, v in self._peer_s.items()},
            "ring": [codec.bits, codec.levels, codec.max_weight] if codec else None,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_state(cls, config: SecAggConfig, state: bytes) -> SecAggClient:
        """Inverse of `to_state` (the config must be the one the round was set up with)."""
        try:
            doc = json.loads(state)
            u = bytes.fromhex
            self = cls.__new__(cls)
            self.config, self.id = config, int(doc["id"])
            self.ctx = RoundContext(doc["ctx"][0], doc["ctx"][1], u(doc["ctx"][2]))
            self.stage = ClientStage(doc["stage"])
            self.n_clients, self.threshold = int(doc["n"]), int(doc["t"])
            self._s = KeyPair(u(doc["s"][0]), u(doc["s"][1]))
            self._seed = u(doc["seed"])
            self.neighbours = frozenset(doc["neighbours"])
            self._channel = {int(k): u(v) for k, v in doc["channel"].items()}
            self._held = {int(k): (u(a), u(b)) for k, (a, b) in doc["held"].items()}
            self._peer_s = {int(k): u(v) for k, v in doc["peers"].items()}
            self.live_neighbours = frozenset(self._peer_s)
            self.params = None
            if doc["ring"]:
                codec = FixedPointCodec(config.clip, *doc["ring"])
                self.params = RoundParams(self.n_clients, len(self.neighbours), self.threshold, codec,
                                          config.chunk_words(codec.bits))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise MalformedMessageError(f"unreadable SecAgg client state: {exc}") from None
        return self

    def _expect(self, stage: ClientStage) -> None:
        if self.stage != stage:
            raise ProtocolViolationError(
                f"client {self.id}: request arrived in stage {self.stage.name}, expected {stage.name}"
            )


class _Encoder:
    """Fills pieces of the plain ring vector [encode(x), weight] in increasing offset order."""

    def __init__(self, codec: FixedPointCodec, length: int, read: Callable[[int, int], np.ndarray], weight: int,
                 noise: bytes) -> None:
        self.codec, self.length, self.read, self.weight, self.noise_key = codec, length, read, weight, noise
        self.noise: Any = None  # rounding-noise stream: half-word i rounds parameter i
        self.scratch = np.empty(PIECE_WORDS)

    def fill(self, offset: int, piece: np.ndarray, expander: MaskExpander) -> None:
        m = max(0, min(piece.shape[0], self.length - offset))  # parameter words; the weight word follows
        if m:
            if self.noise is None:
                self.noise = expander.open(self.noise_key, offset // 2)  # offsets are multiples of 4
            r = expander.next(self.noise, (m + 1) // 2).view(np.uint16)[:m]  # used before the masks reuse the buffer
            x = np.asarray(self.read(offset, m))
            if x.shape != (m,) or not np.issubdtype(x.dtype, np.floating):
                raise ValueError(f"values [{offset}, {offset + m}) of the update: got {x.dtype} {x.shape}, "
                                 f"expected {m} floats")
            self.codec.encode_into(x, self.weight, piece[:m], r, self.scratch)
        if m < piece.shape[0]:
            piece[m] = self.weight
