"""Byte formats of the SecAgg+ messages, and the AEAD envelope that carries shares.

Every message starts with a header: magic, message type, run id, round, client id (the sender of
a client->server message, the addressee of a server->client one). Receivers check the header
against their own round before anything else, so a message from another run, round, stage or
client is rejected with `ReplayedMessageError` (the outer Ed25519 signature layer authenticates
whole messages). Parsing never raises anything but `MalformedMessageError` on hostile bytes.

Messages of a round (client.py has the flow):
  PLAN                  server -> clients   members: (id, name, long-term channel public key)
  SETUP                 client -> server    mask public key, seed commitment, one share envelope
                                            per neighbour
  ADVERT                client, signed      (id, mask public key): what neighbours check
  MASKED_INPUT_REQUEST  server -> client    the ring (bits, levels, weight bound) and, per live
                                            neighbour, its mask public key and its envelope
  ADVERT_SIGNATURES     server -> client    the neighbours' signatures over their ADVERTs
  UNMASK_REQUEST/REPLY                      survivors and dropped neighbours / their shares

Shares travel between neighbours in an envelope: header (run, round, sender, receiver, stage),
12-byte random nonce, AES-256-GCM ciphertext, with the whole header as associated data. The key
comes from the pair's X25519 agreement salted with the round context, so a replayed envelope
fails the header check or, if its header is forged, the tag check (`TamperedMessageError`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .context import RoundContext
from .errors import MalformedMessageError, ReplayedMessageError, TamperedMessageError

MAGIC = b"SAG2"
ENVELOPE_MAGIC = b"SAE2"
NONCE_BYTES = 12
MAX_COUNT = 1 << 20  # entries in any list: far above any realistic roster


class MsgType(IntEnum):
    ADVERT = 1  # client's signed mask public key, relayed to its neighbours
    PLAN = 2  # server -> clients: the round's members
    SETUP = 3  # client -> server: mask key, seed commitment, share envelopes (one round ahead)
    MASKED_INPUT_REQUEST = 4  # server -> client, stage 3
    UNMASK_REQUEST = 5  # server -> client, stage 4
    UNMASK_REPLY = 6  # client -> server, stage 4
    SHARE_ENVELOPE = 7  # client -> client through the server
    ADVERT_SIGNATURES = 8  # server -> client with stage 3: the neighbours' signed-advert proofs


class ShareKind(IntEnum):
    SELF_MASK_SEED = 1  # b_u: revealed for survivors
    MASK_KEY = 2  # s_u private key: revealed for dropped clients


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def u8(self, v: int) -> _Writer:
        self.parts.append(struct.pack(">B", v))
        return self

    def u32(self, v: int) -> _Writer:
        self.parts.append(struct.pack(">I", v))
        return self

    def u64(self, v: int) -> _Writer:
        self.parts.append(struct.pack(">Q", v))
        return self

    def raw(self, b: bytes) -> _Writer:
        self.parts.append(bytes(b))
        return self

    def blob(self, b: bytes) -> _Writer:
        return self.u32(len(b)).raw(b)

    def ids(self, ids: Sequence[int]) -> _Writer:
        self.u32(len(ids))
        for i in ids:
            self.u64(i)
        return self

    def done(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMessageError(f"expected bytes, got {type(data).__name__}")
        self.data = bytes(data)
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise MalformedMessageError("message truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(">Q", self.take(8))[0]

    def blob(self) -> bytes:
        return self.take(self.u32())

    def count(self) -> int:
        n = self.u32()
        if n > MAX_COUNT:
            raise MalformedMessageError(f"list of {n} entries is too long")
        return n

    def ids(self) -> list[int]:
        return [self.u64() for _ in range(self.count())]

    def end(self) -> None:
        if self.pos != len(self.data):
            raise MalformedMessageError(f"{len(self.data) - self.pos} trailing bytes")


def _header(w: _Writer, magic: bytes, kind: MsgType, ctx: RoundContext) -> _Writer:
    rid = ctx.run_id.encode()
    return w.raw(magic).u8(kind).u8(len(rid)).raw(rid).u64(ctx.round)


def _check_header(r: _Reader, magic: bytes, kind: MsgType, ctx: RoundContext) -> None:
    if r.take(len(magic)) != magic:
        raise MalformedMessageError("not a SecAgg+ message (bad magic)")
    got = r.u8()
    try:
        got_kind = MsgType(got)
    except ValueError:
        raise MalformedMessageError(f"unknown message type {got}") from None
    run_id = r.take(r.u8())
    rnd = r.u64()
    if run_id != ctx.run_id.encode() or rnd != ctx.round:
        raise ReplayedMessageError(
            f"{got_kind.name} message of run {run_id!r} round {rnd} rejected: "
            f"this is run {ctx.run_id!r} round {ctx.round} (replayed or misrouted)"
        )
    if got_kind != kind:
        raise ReplayedMessageError(f"expected a {kind.name} message, got {got_kind.name} (wrong stage)")


def _check_client(kind: MsgType, got: int, expected: int) -> None:
    if got != expected:
        raise ReplayedMessageError(f"{kind.name} message is for/from client {got}, expected {expected}")


# ---- stage messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class Advert:
    """A client's mask public key for one round (32 bytes), as it signs it."""

    client: int
    s_pk: bytes


def encode_advert(ctx: RoundContext, a: Advert) -> bytes:
    return _header(_Writer(), MAGIC, MsgType.ADVERT, ctx).u64(a.client).raw(a.s_pk).done()


def decode_advert(ctx: RoundContext, data: bytes, sender: int) -> Advert:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.ADVERT, ctx)
    client = r.u64()
    _check_client(MsgType.ADVERT, client, sender)
    a = Advert(client, r.take(32))
    r.end()
    return a


@dataclass(frozen=True)
class PlanMember:
    """One member of a round's plan: its client id, its name and its long-term channel key."""

    client: int
    name: str
    channel_pk: bytes


def encode_plan(ctx: RoundContext, members: Sequence[PlanMember]) -> bytes:
    """Server -> clients: who takes part in the round (the same bytes for every client)."""
    w = _header(_Writer(), MAGIC, MsgType.PLAN, ctx).u32(len(members))
    for m in members:
        w.u64(m.client).blob(m.name.encode()).raw(m.channel_pk)
    return w.done()


def decode_plan(ctx: RoundContext, data: bytes) -> list[PlanMember]:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.PLAN, ctx)
    members = []
    for _ in range(r.count()):
        client, name = r.u64(), r.blob()
        try:
            text = name.decode()
        except UnicodeDecodeError:
            raise MalformedMessageError("a plan member's name is not UTF-8") from None
        members.append(PlanMember(client, text, r.take(32)))
    r.end()
    return members


@dataclass(frozen=True)
class Setup:
    """Client -> server, one round ahead: mask public key, commitment to the self-mask seed, and
    an envelope of shares for each neighbour (receiver -> bytes)."""

    client: int
    s_pk: bytes
    commitment: bytes
    envelopes: dict[int, bytes]


def encode_setup(ctx: RoundContext, s: Setup) -> bytes:
    w = _header(_Writer(), MAGIC, MsgType.SETUP, ctx).u64(s.client).raw(s.s_pk).raw(s.commitment)
    w.u32(len(s.envelopes))
    for dst, env in s.envelopes.items():
        w.u64(dst).blob(env)
    return w.done()


def decode_setup(ctx: RoundContext, data: bytes, sender: int) -> Setup:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.SETUP, ctx)
    client = r.u64()
    _check_client(MsgType.SETUP, client, sender)
    s_pk, commitment = r.take(32), r.take(32)
    envs: dict[int, bytes] = {}
    for _ in range(r.count()):
        dst, env = r.u64(), r.blob()
        if dst in envs:
            raise MalformedMessageError(f"two envelopes for client {dst}")
        envs[dst] = env
    r.end()
    return Setup(client, s_pk, commitment, envs)


@dataclass(frozen=True)
class RingSpec:
    """The ring a round masks in, as the server announces it: Z_2^bits, `levels` quantization
    levels over [-clip, clip], integer weights at most `weight_bound`."""

    bits: int
    levels: int
    weight_bound: int


@dataclass(frozen=True)
class Relayed:
    """What the server relays to a client about one live neighbour: its mask public key and the
    envelope of shares it sealed to this client."""

    client: int
    s_pk: bytes
    envelope: bytes


def encode_masked_input_request(ctx: RoundContext, client: int, ring: RingSpec, relayed: Sequence[Relayed]) -> bytes:
    """Stage 3, server -> client: the round's ring and its live neighbours' keys and envelopes."""
    w = _header(_Writer(), MAGIC, MsgType.MASKED_INPUT_REQUEST, ctx).u64(client)
    w.u8(ring.bits).u32(ring.levels).u32(ring.weight_bound).u32(len(relayed))
    for x in relayed:
        w.u64(x.client).raw(x.s_pk).blob(x.envelope)
    return w.done()


def decode_masked_input_request(ctx: RoundContext, data: bytes, me: int) -> tuple[RingSpec, list[Relayed]]:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.MASKED_INPUT_REQUEST, ctx)
    _check_client(MsgType.MASKED_INPUT_REQUEST, r.u64(), me)
    ring = RingSpec(r.u8(), r.u32(), r.u32())
    relayed = [Relayed(r.u64(), r.take(32), r.blob()) for _ in range(r.count())]
    r.end()
    if len({x.client for x in relayed}) != len(relayed):
        raise MalformedMessageError("two entries for one neighbour")
    return ring, relayed


def encode_unmask_request(ctx: RoundContext, client: int, survivors: Sequence[int], dropped: Sequence[int]) -> bytes:
    """Stage 4, server -> client: which neighbours (and itself) survived, which dropped."""
    return _header(_Writer(), MAGIC, MsgType.UNMASK_REQUEST, ctx).u64(client).ids(survivors).ids(dropped).done()


def decode_unmask_request(ctx: RoundContext, data: bytes, me: int) -> tuple[list[int], list[int]]:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.UNMASK_REQUEST, ctx)
    _check_client(MsgType.UNMASK_REQUEST, r.u64(), me)
    survivors, dropped = r.ids(), r.ids()
    r.end()
    return survivors, dropped


def encode_unmask_reply(ctx: RoundContext, client: int, shares: Sequence[tuple[int, ShareKind, bytes]]) -> bytes:
    """Stage 4, client -> server: (owner, kind, share) for each survivor / dropped neighbour."""
    w = _header(_Writer(), MAGIC, MsgType.UNMASK_REPLY, ctx).u64(client).u32(len(shares))
    for owner, kind, share in shares:
        w.u64(owner).u8(kind).blob(share)
    return w.done()


def decode_unmask_reply(ctx: RoundContext, data: bytes, sender: int) -> list[tuple[int, ShareKind, bytes]]:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.UNMASK_REPLY, ctx)
    _check_client(MsgType.UNMASK_REPLY, r.u64(), sender)
    out = []
    for _ in range(r.count()):
        owner, kind = r.u64(), r.u8()
        try:
            k = ShareKind(kind)
        except ValueError:
            raise MalformedMessageError(f"unknown share kind {kind}") from None
        out.append((owner, k, r.blob()))
    r.end()
    return out


def encode_advert_signatures(ctx: RoundContext, client: int, sigs: dict[int, tuple[bytes, bytes]]) -> bytes:
    """With stage 2, server -> client: the (signed header, signature) each neighbour sent with its
    advert, relayed so that the client can check them (see signing.py)."""
    w = _header(_Writer(), MAGIC, MsgType.ADVERT_SIGNATURES, ctx).u64(client).u32(len(sigs))
    for src, (header, signature) in sigs.items():
        w.u64(src).blob(header).blob(signature)
    return w.done()


def decode_advert_signatures(ctx: RoundContext, data: bytes, me: int) -> dict[int, tuple[bytes, bytes]]:
    r = _Reader(data)
    _check_header(r, MAGIC, MsgType.ADVERT_SIGNATURES, ctx)
    _check_client(MsgType.ADVERT_SIGNATURES, r.u64(), me)
    sigs: dict[int, tuple[bytes, bytes]] = {}
    for _ in range(r.count()):
        src, header, signature = r.u64(), r.blob(), r.blob()
        if src in sigs:
            raise MalformedMessageError(f"two advert signatures for client {src}")
        sigs[src] = (header, signature)
    r.end()
    return sigs


# ---- share envelopes (AEAD) -----------------------------------------------------------------


def _envelope_header(ctx: RoundContext, sender: int, receiver: int) -> bytes:
    return _header(_Writer(), ENVELOPE_MAGIC, MsgType.SHARE_ENVELOPE, ctx).u64(sender).u64(receiver).done()


def seal_envelope(key: bytes, ctx: RoundContext, sender: int, receiver: int, plaintext: bytes) -> bytes:
    """AES-256-GCM with the header (run, round, stage, sender, receiver) as associated data."""
    header = _envelope_header(ctx, sender, receiver)
    nonce = os.urandom(NONCE_BYTES)
    return header + nonce + AESGCM(key).encrypt(nonce, plaintext, header)


def open_envelope(key: bytes, ctx: RoundContext, sender: int, receiver: int, envelope: bytes) -> bytes:
    """Check the header is for this round and pair, then authenticate and decrypt."""
    r = _Reader(envelope)
    _check_header(r, ENVELOPE_MAGIC, MsgType.SHARE_ENVELOPE, ctx)
    got_sender, got_receiver = r.u64(), r.u64()
    if (got_sender, got_receiver) != (sender, receiver):
        raise ReplayedMessageError(
            f"share envelope from {got_sender} to {got_receiver} rejected: "
            f"expected from {sender} to {receiver}"
        )
    header = envelope[: r.pos]
    nonce = r.take(NONCE_BYTES)
    ct = envelope[r.pos :]
    try:
        return AESGCM(key).decrypt(nonce, ct, header)
    except InvalidTag:
        raise TamperedMessageError(
            f"share envelope from client {sender} to client {receiver} failed authentication "
            "(modified in transit, or sealed under another key)"
        ) from None
