"""Client side of SecAgg+: a small per-round state object driven through the four stages.

    client = SecAggClient(config, ctx, my_id)
    advert = client.advertise_keys()                          # stage 1 -> server (bytes)
    reply = client.share_keys(share_keys_request)             # stage 2 -> server (bytes)
    for offset, words in client.masked_input(masked_input_request, update, weight):
        keep(offset, words.copy())                            # stage 3 -> server (uint32 chunks)
    shares = client.unmask(unmask_request)                    # stage 4 -> server (bytes)

The object holds this round's secrets; `to_state()` / `from_state()` carry it between the
short-lived processes a Flower ClientApp runs in (keep that state on the site: it holds keys).
Each stage runs once, in order: re-masking an input under the same masks, or answering two
unmask requests, would let the server learn an individual input. Signing the messages is the
driver's part (signing.py): this object never sees the site's long-term keys.
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
from .errors import MalformedMessageError, ProtocolViolationError, SecAggAbort
from .encoding import FixedPointCodec, noise_key
from .graph import neighbours_of
from .keys import KeyPair
from .prg import PIECE_WORDS, MaskExpander


class ClientStage(IntEnum):
    NEW = 0
    ADVERTISED = 1
    SHARED = 2
    MASKED = 3
    UNMASKED = 4


def seed_commitment(ctx: RoundContext, client_id: int, seed: bytes) -> bytes:
    """SHA-256 commitment to a self-mask seed: lets the server check a rebuilt seed."""
    return hashlib.sha256(b"self-mask-commitment" + ctx.digest() + client_id.to_bytes(8, "big") + seed).digest()


class SecAggClient:
    """One client's SecAgg+ state for one round."""

    def __init__(self, config: SecAggConfig, ctx: RoundContext, client_id: int) -> None:
        if not 0 <= client_id < 1 << 64:
            raise ValueError("client ids are unsigned 64-bit integers")
        self.config = config
        self.ctx = ctx
        self.id = client_id
        self.stage = ClientStage.NEW
        self._c = KeyPair.generate()  # channel keys for share envelopes
        self._s = KeyPair.generate()  # mask keys; the private half is secret-shared
        self._seed = os.urandom(32)  # self-mask seed b_u, secret-shared
        self.params: RoundParams | None = None
        self.neighbours: frozenset[int] = frozenset()
        self._peer_keys: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (c_pk, s_pk)
        self._held: dict[int, tuple[bytes, bytes]] = {}  # owner -> (seed share, s-key share)
        self.live_neighbours: frozenset[int] = frozenset()  # neighbours that shared (U2)

    # ---- stage 1 ---------------------------------------------------------------------------
    def advertise_keys(self) -> bytes:
        """Stage 1: the two public keys, to be signed and sent to the server."""
        self._expect(ClientStage.NEW)
        self.stage = ClientStage.ADVERTISED
        return wire.encode_advert(self.ctx, wire.Advert(self.id, self._c.public, self._s.public))

    # ---- stage 2 ---------------------------------------------------------------------------
    def share_keys(self, request: bytes) -> bytes:
        """Stage 2: check the neighbours' keys, secret-share b_u and s_u, seal one share each."""
        self._expect(ClientStage.ADVERTISED)
        roster, adverts = wire.decode_share_keys_request(self.ctx, request, self.id)
        if len(set(roster)) != len(roster) or self.id not in roster:
            raise ProtocolViolationError("the roster repeats ids or leaves this client out")
        params = self.config.resolve(len(roster))
        nbrs = neighbours_of(roster, params.degree, self.ctx.graph_seed, self.id)
        if len({a.client for a in adverts}) != len(adverts):
            raise ProtocolViolationError("the server forwarded two adverts for one client")
        peers = {a.client: (a.c_pk, a.s_pk) for a in adverts if a.client != self.id}
        if set(peers) != nbrs:
            raise ProtocolViolationError(
                f"server forwarded keys of {sorted(peers)}, but the round graph gives neighbours {sorted(nbrs)}"
            )
        own = [a for a in adverts if a.client == self.id]
        if any((a.c_pk, a.s_pk) != (self._c.public, self._s.public) for a in own):
            raise ProtocolViolationError("the server forwarded wrong keys for this client")
        all_pks = [pk for pair in peers.values() for pk in pair] + [self._c.public, self._s.public]
        if len(set(all_pks)) != len(all_pks):
            raise ProtocolViolationError("some advertised public keys are identical")
        holders = sorted(nbrs | {self.id})
        seed_shares = shamir.split_secret(self._seed, params.threshold, holders)
        key_shares = shamir.split_secret(self._s.private, params.threshold, holders)
        envelopes = {}
        for v in sorted(nbrs):
            k = keys.share_channel_key(self._c.private, peers[v][0], self.ctx, self.id, v)
            envelopes[v] = wire.seal_envelope(k, self.ctx, self.id, v, seed_shares[v] + key_shares[v])
        self._held[self.id] = (seed_shares[self.id], key_shares[self.id])
        self.params, self.neighbours, self._peer_keys = params, frozenset(nbrs), peers
        self.stage = ClientStage.SHARED
        return wire.encode_share_keys_reply(
            self.ctx, self.id, seed_commitment(self.ctx, self.id, self._seed), envelopes
        )

    # ---- stage 3 ---------------------------------------------------------------------------
    def receive_shares(self, request: bytes) -> None:
        """Stage 3, first half: open the envelopes of the neighbours that are still live."""
        self._expect(ClientStage.SHARED)
        envelopes = wire.decode_masked_input_request(self.ctx, request, self.id)
        stray = set(envelopes) - self.neighbours
        if stray:
            raise ProtocolViolationError(f"envelopes from non-neighbours {sorted(stray)}")
        assert self.params is not None
        if len(envelopes) + 1 < self.params.threshold:
            raise SecAggAbort(
                f"client {self.id}: only {len(envelopes)} live neighbours, "
                f"threshold {self.params.threshold} cannot be met"
            )
        held = {}
        for src, env in envelopes.items():
            k = keys.share_channel_key(self._c.private, self._peer_keys[src][0], self.ctx, self.id, src)
            plain = wire.open_envelope(k, self.ctx, src, self.id, env)
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise MalformedMessageError(f"envelope from {src} holds {len(plain)} bytes")
            held[src] = (plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES :])
            for s in held[src]:
                if shamir.Share.from_bytes(s).x != shamir.x_for(self.id):
                    raise ProtocolViolationError(f"client {src} sent a share for another holder")
        self._held.update(held)
        self.live_neighbours = frozenset(envelopes)
        self.stage = ClientStage.MASKED  # from here on the masks are fixed: mask once only

    def masked_input(
        self, request: bytes, update: np.ndarray, weight: int, rng: np.random.Generator | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Stage 3: receive the shares, then encode and mask `update` chunk by chunk.

        Yields (offset, uint32 words) over the ring vector [encoded update (P words), weight], at
        most `config.chunk_bytes` per chunk. The words are a view of one buffer that the next chunk
        overwrites: send or copy each chunk before drawing the next. `rng` drives stochastic
        rounding (its noise key is drawn from it; default: os.urandom).

        An update holding NaN raises ValueError when its chunk is reached (found in the encoded
        words, not by a scan beforehand): send a client's chunks only once the generator is
        exhausted, as the server cannot take a partial upload out of the sum again.
        """
        self._expect(ClientStage.SHARED)
        assert self.params is not None
        x = np.asarray(update).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"the update must be a float array, got {x.dtype}")
        w = self.params.codec.check_weight(weight)
        self.receive_shares(request)
        return self._mask_chunks(x.shape[0] + 1, _Encoder(self.params.codec, x, w, noise_key(rng)).fill)

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
            k = keys.pairwise_mask_key(self._s.private, self._peer_keys[v][1], self.ctx, self.id, v)
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
        assert self.params is not None
        survivors, dropped = wire.decode_unmask_request(self.ctx, request, self.id)
        s_set, d_set = set(survivors), set(dropped)
        if len(s_set) != len(survivors) or len(d_set) != len(dropped) or s_set & d_set:
            raise ProtocolViolationError("survivor and dropped lists overlap or repeat ids")
        if self.id not in s_set or self.id in d_set:
            raise ProtocolViolationError("this client sent its masked input but is not listed as a survivor")
        unknown = (s_set | d_set) - self.live_neighbours - {self.id}
        if unknown:
            raise ProtocolViolationError(f"unmask request names non-live-neighbours {sorted(unknown)}")
        if len(s_set) < self.params.threshold:
            raise SecAggAbort(
                f"client {self.id}: {len(s_set)} survivors among its neighbours, "
                f"fewer than the threshold {self.params.threshold}"
            )
        out = [(u, wire.ShareKind.SELF_MASK_SEED, self._held[u][0]) for u in sorted(s_set)]
        out += [(u, wire.ShareKind.MASK_KEY, self._held[u][1]) for u in sorted(d_set)]
        self.stage = ClientStage.UNMASKED
        return wire.encode_unmask_reply(self.ctx, self.id, out)

    # ---- persistence -----------------------------------------------------------------------
    def to_state(self) -> bytes:
        """This round's state (SECRET: private keys, seed, shares) as bytes for context.state."""
        h = bytes.hex
        doc = {
            "ctx": [self.ctx.run_id, self.ctx.round, h(self.ctx.graph_seed)],
            "id": self.id,
            "stage": int(self.stage),
            "c": [h(self._c.private), h(self._c.public)],
            "s": [h(self._s.private), h(self._s.public)],
            "seed": h(self._seed),
            "n": self.params.n_clients if self.params else 0,
            "neighbours": sorted(self.neighbours),
            "peers": {str(k): [h(a), h(b)] for k, (a, b) in self._peer_keys.items()},
            "held": {str(k): [h(a), h(b)] for k, (a, b) in self._held.items()},
            "live": sorted(self.live_neighbours),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_state(cls, config: SecAggConfig, state: bytes) -> SecAggClient:
        """Inverse of `to_state` (the config must be the one the round started with)."""
        try:
            doc = json.loads(state)
            u = bytes.fromhex
            ctx = RoundContext(doc["ctx"][0], doc["ctx"][1], u(doc["ctx"][2]))
            self = cls.__new__(cls)
            self.config, self.ctx, self.id = config, ctx, int(doc["id"])
            self.stage = ClientStage(doc["stage"])
            self._c = KeyPair(u(doc["c"][0]), u(doc["c"][1]))
            self._s = KeyPair(u(doc["s"][0]), u(doc["s"][1]))
            self._seed = u(doc["seed"])
            self.params = config.resolve(doc["n"]) if doc["n"] else None
            self.neighbours = frozenset(doc["neighbours"])
            self._peer_keys = {int(k): (u(a), u(b)) for k, (a, b) in doc["peers"].items()}
            self._held = {int(k): (u(a), u(b)) for k, (a, b) in doc["held"].items()}
            self.live_neighbours = frozenset(doc["live"])
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

    def __init__(self, codec: FixedPointCodec, x: np.ndarray, weight: int, noise: bytes) -> None:
        self.codec, self.x, self.weight, self.noise_key = codec, x, weight, noise
        self.noise: Any = None  # rounding-noise stream: half-word i rounds parameter i
        self.scratch = np.empty(PIECE_WORDS)

    def fill(self, offset: int, piece: np.ndarray, expander: MaskExpander) -> None:
        p = self.x.shape[0]
        m = max(0, min(piece.shape[0], p - offset))  # parameter words; the weight word follows
        if m:
            if self.noise is None:
                self.noise = expander.open(self.noise_key, offset // 2)  # offsets are multiples of 4
            r = expander.next(self.noise, (m + 1) // 2).view(np.uint16)[:m]  # used before the masks reuse the buffer
            self.codec.encode_into(self.x[offset : offset + m], self.weight, piece[:m], r, self.scratch)
        if m < piece.shape[0]:
            piece[m] = self.weight
