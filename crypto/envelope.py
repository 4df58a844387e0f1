"""Update envelopes: every update signed by its site, optionally sealed to the coordinator.

Sender (a site, or the coordinator for messages to sites)::

    env = make_envelope(update_array, signing_key=site_key, federation_id=fed, run_id=run,
                        round=r, site="site-a", seal_to=coordinator_x25519_public)

Receiver::

    opened = open_envelope(env, trust=trust_store, replay=guard, federation_id=fed, run_id=run,
                           round=r, recipient_key=coordinator_x25519_private, require_sealed=True)
    update = opened.payload  # numpy uint8 buffer, verified; view it as the update's dtype

Construction (version 1):

- Header: canonical length-prefixed encoding of (federation id, run id, round, site, channel,
  16-byte random nonce, created-at, payload length, chunk size, digest algorithm, payload
  digest, sealed flag, recipient X25519 key, ephemeral X25519 key, caller metadata).
- Payload digest: a two-level tree hash (SHA-256 or BLAKE2b-256) over fixed-size chunks, so the
  leaves hash in parallel threads (hashlib and AES-GCM both release the GIL).
- Signature: Ed25519 by the sender's key over the header bytes.
- Seal: ephemeral X25519 with the recipient key, HKDF-SHA256 to an AES-256-GCM key, the payload
  encrypted in chunks; chunk i uses nonce = 0^32 || i (64-bit) and AAD = SHA-256(header) || i ||
  final-flag, so chunks cannot be reordered, dropped, or the stream cut short. A fresh
  ephemeral key per envelope makes counter nonces safe.

Every rejection raises an :class:`EnvelopeError` subclass whose ``reason`` is a stable code for
round metrics.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"SOVFL-ENVELOPE\x00\x01"
VERSION = 1
NONCE_BYTES = 16
TAG_BYTES = 16
DEFAULT_CHUNK = 4 << 20
MIN_CHUNK, MAX_CHUNK = 1 << 12, 1 << 30
DIGEST_ALGS = ("sha256", "blake2b")
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))


# -- errors ------------------------------------------------------------------------------------


class EnvelopeError(Exception):
    """Base of all envelope rejections; ``reason`` is a stable metric label."""

    reason = "envelope_error"

    def __init__(self, detail: str = ""):
        super().__init__(f"{self.reason}: {detail}" if detail else self.reason)
        self.detail = detail


class MalformedEnvelope(EnvelopeError):
    reason = "malformed"


class WrongFederation(EnvelopeError):
    reason = "wrong_federation"


class WrongRun(EnvelopeError):
    reason = "wrong_run"


class WrongRound(EnvelopeError):
    reason = "wrong_round"


class UnknownSite(EnvelopeError):
    reason = "unknown_site"


class RevokedSite(EnvelopeError):
    reason = "revoked_site"


class BadSignature(EnvelopeError):
    reason = "bad_signature"


class ReplayedEnvelope(EnvelopeError):
    reason = "replayed"


class ReplayedRound(ReplayedEnvelope):
    reason = "replayed_round"


class ReplayedNonce(ReplayedEnvelope):
    reason = "replayed_nonce"


class NotSealed(EnvelopeError):
    reason = "not_sealed"


class WrongRecipient(EnvelopeError):
    reason = "wrong_recipient"


class DecryptionFailed(EnvelopeError):
    reason = "decrypt_failed"


class DigestMismatch(EnvelopeError):
    reason = "digest_mismatch"


class PayloadTooLarge(EnvelopeError):
    reason = "payload_too_large"


# -- header ------------------------------------------------------------------------------------


def _u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def _bytes_of(value: Any, what: str) -> bytes:
    """Bytes of a received field, which may hold any type the sender chose: an int must not become
    ``bytes(n)`` (n zero bytes: a sender could ask for terabytes), so only buffers are taken."""
    try:
        return memoryview(value).tobytes()
    except (TypeError, ValueError):
        raise MalformedEnvelope(f"{what} is a {type(value).__name__}, not bytes") from None


@dataclass(frozen=True)
class EnvelopeHeader:
    """The signed part of an envelope. ``channel`` separates message kinds within a round."""

    federation_id: str
    run_id: str
    round: int
    site: str
    channel: str
    nonce: bytes
    created_at: int
    payload_len: int
    chunk_size: int
    digest_alg: str
    digest: bytes
    sealed: bool
    recipient: bytes = b""  # raw X25519 public key the payload is sealed to
    ephemeral: bytes = b""  # raw ephemeral X25519 public key
    meta: bytes = b""  # caller-defined (e.g. dtype/shape JSON); signed, not encrypted

    _FIELDS = ("federation_id", "run_id", "round", "site", "channel", "nonce", "created_at", "payload_len",
               "chunk_size", "digest_alg", "digest", "sealed", "recipient", "ephemeral", "meta")

    def encode(self) -> bytes:
        parts = [MAGIC]
        for name in self._FIELDS:
            v = getattr(self, name)
            raw = (v.encode() if isinstance(v, str) else bytes([v]) if isinstance(v, bool)
                   else _u64(v) if isinstance(v, int) else bytes(v))
            parts += [struct.pack(">I", len(raw)), raw]
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> "EnvelopeHeader":
        """Strict parse: exact field lengths, no trailing bytes, canonical re-encoding."""
        data = _bytes_of(data, "envelope header")
        if not data.startswith(MAGIC):
            raise MalformedEnvelope("bad magic or unsupported version")
        pos, raw = len(MAGIC), []
        for _ in cls._FIELDS:
            if pos + 4 > len(data):
                raise MalformedEnvelope("header truncated")
            (n,) = struct.unpack_from(">I", data, pos)
            pos += 4
            if pos + n > len(data):
                raise MalformedEnvelope("header truncated")
            raw.append(data[pos:pos + n])
            pos += n
        if pos != len(data):
            raise MalformedEnvelope("trailing bytes after header")
        try:
            def u64(b: bytes) -> int:
                if len(b) != 8:
                    raise ValueError("integer field is not 8 bytes")
                return struct.unpack(">Q", b)[0]

            if len(raw[11]) != 1 or raw[11][0] not in (0, 1):
                raise ValueError("bad sealed flag")
            hdr = cls(
                federation_id=raw[0].decode(), run_id=raw[1].decode(), round=u64(raw[2]), site=raw[3].decode(),
                channel=raw[4].decode(), nonce=raw[5], created_at=u64(raw[6]), payload_len=u64(raw[7]),
                chunk_size=u64(raw[8]), digest_alg=raw[9].decode(), digest=raw[10], sealed=bool(raw[11][0]),
                recipient=raw[12], ephemeral=raw[13], meta=raw[14],
            )
        except (UnicodeDecodeError, ValueError) as exc:
            raise MalformedEnvelope(str(exc)) from exc
        hdr._validate()
        return hdr

    def _validate(self) -> None:
        if len(self.nonce) != NONCE_BYTES:
            raise MalformedEnvelope("nonce must be 16 bytes")
        if self.digest_alg not in DIGEST_ALGS or len(self.digest) != 32:
            raise MalformedEnvelope(f"unsupported digest {self.digest_alg!r}")
        if not MIN_CHUNK <= self.chunk_size <= MAX_CHUNK:
            raise MalformedEnvelope("chunk size out of range")
        if self.sealed and (len(self.recipient) != 32 or len(self.ephemeral) != 32):
            raise MalformedEnvelope("sealed envelope without X25519 keys")
        if not self.sealed and (self.recipient or self.ephemeral):
            raise MalformedEnvelope("unsealed envelope carries sealing keys")

    @property
    def n_chunks(self) -> int:
        return max(1, -(-self.payload_len // self.chunk_size))

    @property
    def body_len(self) -> int:
        return self.payload_len + (TAG_BYTES * self.n_chunks if self.sealed else 0)


@dataclass(frozen=True)
class Envelope:
    """What travels: header bytes and signature (small, e.g. in a ConfigRecord) plus the body
    (big, e.g. a uint8 array in an ArrayRecord): ciphertext if sealed, else the payload itself."""

    header: bytes
    signature: bytes
    body: Any  # numpy uint8 array, memoryview, or bytes

    def parsed(self) -> EnvelopeHeader:
        return EnvelopeHeader.decode(self.header)

    def to_bytes(self) -> bytes:
        """Single-blob wire form (copies the body; for small messages and files)."""
        return b"".join([struct.pack(">II", len(self.header), len(self.signature)), self.header, self.signature,
                         memoryview(self.body).cast("B") if not isinstance(self.body, bytes) else self.body])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "Envelope":
        try:
            mv = memoryview(data).cast("B")
        except (TypeError, ValueError):
            raise MalformedEnvelope(f"an envelope blob must be contiguous bytes, not {type(data).__name__}") from None
        if len(mv) < 8:
            raise MalformedEnvelope("blob too short")
        hl, sl = struct.unpack_from(">II", mv, 0)
        if 8 + hl + sl > len(mv):
            raise MalformedEnvelope("blob truncated")
        return cls(bytes(mv[8:8 + hl]), bytes(mv[8 + hl:8 + hl + sl]), mv[8 + hl + sl:])


@dataclass(frozen=True)
class OpenedEnvelope:
    header: EnvelopeHeader
    payload: np.ndarray  # uint8, verified plaintext (a view of the body when not sealed)


# -- buffers and hashing -----------------------------------------------------------------------


def as_bytes_view(obj: Any) -> memoryview:
    """A flat byte view of a C-contiguous buffer (numpy array, bytes, memoryview) without copying."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("payload array must be C-contiguous (use np.ascontiguousarray)")
        return memoryview(obj.reshape(-1).view(np.uint8))
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError("payload buffer must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _new_hash(alg: str) -> Any:
    return hashlib.sha256() if alg == "sha256" else hashlib.blake2b(digest_size=32)


def _leaf_digest(alg: str, chunk: memoryview) -> bytes:
    h = _new_hash(alg)
    h.update(b"\x00")
    h.update(chunk)
    return h.digest()


def _map(fn: Callable[[int], Any], n: int, workers: int) -> list[Any]:
    if workers <= 1 or n <= 1:
        return [fn(i) for i in range(n)]
    with ThreadPoolExecutor(max_workers=min(workers, n), thread_name_prefix="sovfl-envelope") as pool:
        return list(pool.map(fn, range(n)))


def tree_digest(data: Any, *, alg: str = "sha256", chunk_size: int = DEFAULT_CHUNK, workers: int = DEFAULT_WORKERS) -> bytes:
    """H(0x01 || tag || len || chunk_size || H(0x00 || chunk_0) || ...): parallel, well-defined."""
    if alg not in DIGEST_ALGS:
        raise ValueError(f"digest must be one of {DIGEST_ALGS}")
    mv = as_bytes_view(data)
    n = len(mv)
    n_chunks = max(1, -(-n // chunk_size))
    leaves = _map(lambda i: _leaf_digest(alg, mv[i * chunk_size:(i + 1) * chunk_size]), n_chunks, workers)
    root = tree_root(alg, n, chunk_size)
    for leaf in leaves:
        root.update(leaf)
    return root.digest()


def tree_root(alg: str, n: int, chunk_size: int) -> Any:
    """The tree digest's root hash before its leaves: bound to the payload's length and chunking,
    so one set of leaves cannot stand for another split. Feed it each chunk's leaf digest in order."""
    root = _new_hash(alg)
    root.update(b"\x01sovfl-tree-v1" + _u64(n) + _u64(chunk_size))
    return root


# -- sealing -----------------------------------------------------------------------------------


def _raw(key: x25519.X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _derive_key(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=ephemeral + recipient, info=b"sovfl-envelope-v1 aes-256-gcm").derive(shared)


def _chunk_nonce(i: int) -> bytes:
    return b"\x00\x00\x00\x00" + _u64(i)


def _chunk_aad(header_hash: bytes, i: int, final: bool) -> bytes:
    return header_hash + _u64(i) + (b"\x01" if final else b"\x00")


def make_envelope(
    payload: Any,
    *,
    signing_key: ed25519.Ed25519PrivateKey,
    federation_id: str,
    run_id: str | int,
    round: int,
    site: str,
    channel: str = "update",
    seal_to: x25519.X25519PublicKey | None = None,
    meta: bytes = b"",
    digest_alg: str = "sha256",
    chunk_size: int = DEFAULT_CHUNK,
    workers: int = DEFAULT_WORKERS,
    out: np.ndarray | None = None,
) -> Envelope:
    """Sign ``payload`` (and seal it to ``seal_to`` if given) without copying the input.

    Sealed output is one preallocated uint8 buffer (``out`` may supply it) of
    ``len(payload) + 16 * n_chunks`` bytes; unsealed, the body is a view of the payload.
    """
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise ValueError("chunk_size out of range")
    mv = as_bytes_view(payload)
    n = len(mv)
    digest = tree_digest(mv, alg=digest_alg, chunk_size=chunk_size, workers=workers)
    eph_priv = x25519.X25519PrivateKey.generate() if seal_to is not None else None
    header = EnvelopeHeader(
        federation_id=federation_id, run_id=str(run_id), round=int(round), site=site, channel=channel,
        nonce=os.urandom(NONCE_BYTES), created_at=int(time.time()), payload_len=n, chunk_size=chunk_size,
        digest_alg=digest_alg, digest=digest, sealed=seal_to is not None,
        recipient=_raw(seal_to) if seal_to is not None else b"",
        ephemeral=_raw(eph_priv.public_key()) if eph_priv is not None else b"", meta=bytes(meta),
    )
    header._validate()
    hbytes = header.encode()
    signature = signing_key.sign(hbytes)
    if seal_to is None or eph_priv is None:
        return Envelope(hbytes, signature, np.frombuffer(mv, dtype=np.uint8) if n else np.empty(0, np.uint8))

    aead = AESGCM(_derive_key(eph_priv.exchange(seal_to), header.ephemeral, header.recipient))
    hh = hashlib.sha256(hbytes).digest()
    total, k = header.body_len, header.n_chunks
    if out is None:
        out = np.empty(total, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or len(out) != total or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of {total} bytes")
    omv = memoryview(out)

    def enc(i: int) -> None:
        lo, hi = i * chunk_size, min(n, (i + 1) * chunk_size)
        dst = omv[lo + i * TAG_BYTES:hi + (i + 1) * TAG_BYTES]
        aead.encrypt_into(_chunk_nonce(i), mv[lo:hi], _chunk_aad(hh, i, i == k - 1), dst)

    _map(enc, k, workers)
    return Envelope(hbytes, signature, out)


# -- verification ------------------------------------------------------------------------------


class KeyLookup(Protocol):
    """What open_envelope needs from a trust store (crypto.pki.TrustStore implements it)."""

    def lookup(self, name: str) -> Any: ...  # -> object with .sign_public and .revoked, or None


class ReplayGuard:
    """Accept each (federation, run, round, site, channel) and each nonce once.

    A slot is reserved while an envelope is being opened and committed only when it verified,
    so a corrupted copy of a genuine envelope cannot burn the genuine one's slot.
    """

    def __init__(self, max_entries: int = 1_000_000):
        self._lock = threading.Lock()
        self._slots: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._pending: set[Any] = set()
        self._max = max_entries

    @staticmethod
    def _slot(h: EnvelopeHeader) -> tuple[str, ...]:
        return (h.federation_id, h.run_id, str(h.round), h.site, h.channel)

    def reserve(self, h: EnvelopeHeader) -> None:
        slot = self._slot(h)
        with self._lock:
            if slot in self._slots or slot in self._pending:
                raise ReplayedRound(f"{h.site} already sent {h.channel} for run {h.run_id} round {h.round}")
            if h.nonce in self._nonces or h.nonce in self._pending:
                raise ReplayedNonce(f"nonce {h.nonce.hex()} seen before")
            self._pending.update((slot, h.nonce))

    def release(self, h: EnvelopeHeader, *, accepted: bool) -> None:
        slot = self._slot(h)
        with self._lock:
            self._pending.discard(slot)
            self._pending.discard(h.nonce)
            if accepted:
                self._slots[slot] = None
                self._nonces[h.nonce] = None
                while len(self._slots) > self._max:
                    self._slots.popitem(last=False)
                while len(self._nonces) > self._max:
                    self._nonces.popitem(last=False)


def open_envelope(
    envelope: Envelope,
    *,
    trust: KeyLookup,
    federation_id: str,
    run_id: str | int | None = None,
    round: int | None = None,
    replay: ReplayGuard | None = None,
    recipient_key: x25519.X25519PrivateKey | None = None,
    require_sealed: bool = False,
    channels: Sequence[str] | None = None,
    max_payload: int | None = None,
    workers: int = DEFAULT_WORKERS,
    out: np.ndarray | None = None,
) -> OpenedEnvelope:
    """Verify (and unseal) an envelope; raise an :class:`EnvelopeError` subclass on any failure.

    Checks, cheapest first: header syntax, federation/run/round, sender known and not revoked,
    Ed25519 signature, replay, recipient, AES-GCM chunk tags, payload digest.
    """
    h, hbytes, body = _checked_header(envelope, trust=trust, federation_id=federation_id, run_id=run_id,
                                      round=round, require_sealed=require_sealed, channels=channels,
                                      max_payload=max_payload)
    if replay is not None:
        replay.reserve(h)
    accepted = False
    try:
        payload = _unseal(h, hbytes, body, recipient_key, workers, out) if h.sealed else np.frombuffer(body, np.uint8)
        if tree_digest(payload, alg=h.digest_alg, chunk_size=h.chunk_size, workers=workers) != h.digest:
            raise DigestMismatch("payload does not match the signed digest")
        accepted = True
        return OpenedEnvelope(h, payload)
    finally:
        if replay is not None:
            replay.release(h, accepted=accepted)


def _checked_header(
    envelope: Envelope, *, trust: KeyLookup, federation_id: str, run_id: str | int | None, round: int | None,
    require_sealed: bool, channels: Sequence[str] | None, max_payload: int | None,
) -> tuple[EnvelopeHeader, bytes, memoryview]:
    """Every check of an envelope short of its payload (see open_envelope): header, body view."""
    hbytes = _bytes_of(envelope.header, "envelope header")
    signature = _bytes_of(envelope.signature, "envelope signature")
    try:
        h = EnvelopeHeader.decode(hbytes)
    except MalformedEnvelope:
        raise
    except Exception as exc:  # hostile bytes never escape as anything else
        raise MalformedEnvelope(repr(exc)) from exc
    if h.federation_id != federation_id:
        raise WrongFederation(f"envelope for federation {h.federation_id!r}, expected {federation_id!r}")
    if run_id is not None and h.run_id != str(run_id):
        raise WrongRun(f"envelope for run {h.run_id!r}, expected {run_id!r}")
    if round is not None and h.round != round:
        raise WrongRound(f"envelope for round {h.round}, expected {round}")
    if channels is not None and h.channel not in channels:
        raise MalformedEnvelope(f"unexpected channel {h.channel!r}")
    rec = trust.lookup(h.site)
    if rec is None:
        raise UnknownSite(f"sender {h.site!r} is not in the trust store")
    if rec.revoked:
        raise RevokedSite(f"sender {h.site!r} is revoked")
    try:
        rec.sign_public.verify(signature, hbytes)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise BadSignature(f"signature by {h.site!r} does not verify") from exc
    if max_payload is not None and h.payload_len > max_payload:
        raise PayloadTooLarge(f"{h.payload_len} bytes > {max_payload}")
    if require_sealed and not h.sealed:
        raise NotSealed("this receiver accepts sealed envelopes only")
    try:
        body = as_bytes_view(envelope.body)
    except (TypeError, ValueError) as exc:  # not a buffer, or not contiguous
        raise MalformedEnvelope(f"envelope body: {exc}") from None
    if len(body) != h.body_len:
        raise MalformedEnvelope(f"body is {len(body)} bytes, header says {h.body_len} (truncated or padded)")
    return h, hbytes, body


def open_envelope_stream(
    envelope: Envelope,
    sink: Callable[[int, memoryview], None],
    *,
    trust: KeyLookup,
    federation_id: str,
    run_id: str | int | None = None,
    round: int | None = None,
    replay: ReplayGuard | None = None,
    recipient_key: x25519.X25519PrivateKey | None = None,
    require_sealed: bool = False,
    channels: Sequence[str] | None = None,
    max_payload: int | None = None,
    workers: int = DEFAULT_WORKERS,
    done_with: Callable[[int, int], None] | None = None,
) -> EnvelopeHeader:
    """`open_envelope` in a bounded window: the payload is handed to `sink(offset, bytes)` in order,
    `workers` chunks at a time, and never held whole, so a receiver can write a large update
    where it wants it (a file) without a plaintext copy of its size. `done_with(lo, hi)` is told
    each body range that was read (a receiver reading a mapped file drops those pages).

    The same checks and errors as `open_envelope`, but what reached `sink` is authenticated only
    when this returns: on any EnvelopeError the receiver must discard everything it was given
    (the tree digest over all chunks, and the final chunk's AAD flag, are checked at the end)."""
    h, hbytes, body = _checked_header(envelope, trust=trust, federation_id=federation_id, run_id=run_id,
                                      round=round, require_sealed=require_sealed, channels=channels,
                                      max_payload=max_payload)
    if replay is not None:
        replay.reserve(h)
    accepted = False
    try:
        n, cs, k = h.payload_len, h.chunk_size, h.n_chunks
        aead, hh = (_aead_of(h, recipient_key), hashlib.sha256(hbytes).digest()) if h.sealed else (None, b"")
        width = max(1, workers)
        tag = TAG_BYTES if h.sealed else 0
        windows = [np.empty(min(cs, n), np.uint8) for _ in range(min(width, k))] if aead is not None else []
        leaves: list[bytes] = []

        def one(j: int, i: int) -> tuple[memoryview, bytes]:
            lo, hi = i * cs, min(n, (i + 1) * cs)
            src = body[lo + i * tag:hi + (i + 1) * tag]
            if aead is None:
                plain = src
            else:
                plain = memoryview(windows[j])[:hi - lo]
                aead.decrypt_into(_chunk_nonce(i), src, _chunk_aad(hh, i, i == k - 1), plain)
            return plain, _leaf_digest(h.digest_alg, plain)

        try:
            for first in range(0, k, width):
                batch = list(range(first, min(k, first + width)))
                done = _map(lambda j: one(j, batch[j]), len(batch), workers)
                for i, (plain, leaf) in zip(batch, done):
                    leaves.append(leaf)
                    sink(i * cs, plain)
                if done_with is not None:
                    done_with(first * (cs + tag), min(len(body), (batch[-1] + 1) * (cs + tag)))
        except InvalidTag as exc:
            raise DecryptionFailed("AES-GCM tag check failed (tampered, reordered or truncated)") from exc
        finally:
            for w in windows:
                w[:] = 0  # no unauthenticated plaintext left behind in our buffers
        root = tree_root(h.digest_alg, n, cs)
        for leaf in leaves:
            root.update(leaf)
        if root.digest() != h.digest:
            raise DigestMismatch("payload does not match the signed digest")
        accepted = True
        return h
    finally:
        if replay is not None:
            replay.release(h, accepted=accepted)


def _aead_of(h: EnvelopeHeader, key: x25519.X25519PrivateKey | None) -> AESGCM:
    """The AES-GCM key a sealed envelope's chunks open with (WrongRecipient, MalformedEnvelope)."""
    if key is None:
        raise WrongRecipient("envelope is sealed and no recipient key was given")
    if _raw(key.public_key()) != h.recipient:
        raise WrongRecipient("envelope is sealed to another key")
    try:
        shared = key.exchange(x25519.X25519PublicKey.from_public_bytes(h.ephemeral))
    except ValueError as exc:  # low-order point
        raise MalformedEnvelope("invalid ephemeral key") from exc
    return AESGCM(_derive_key(shared, h.ephemeral, h.recipient))


def _unseal(
    h: EnvelopeHeader, hbytes: bytes, body: memoryview, key: x25519.X25519PrivateKey | None, workers: int,
    out: np.ndarray | None,
) -> np.ndarray:
    if key is None:
        raise WrongRecipient("envelope is sealed and no recipient key was given")
    if _raw(key.public_key()) != h.recipient:
        raise WrongRecipient("envelope is sealed to another key")
    try:
        shared = key.exchange(x25519.X25519PublicKey.from_public_bytes(h.ephemeral))
    except ValueError as exc:  # low-order point
        raise MalformedEnvelope("invalid ephemeral key") from exc
    aead = AESGCM(_derive_key(shared, h.ephemeral, h.recipient))
    hh = hashlib.sha256(hbytes).digest()
    n, cs, k = h.payload_len, h.chunk_size, h.n_chunks
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or len(out) != n or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of {n} bytes")
    omv = memoryview(out)

    def dec(i: int) -> None:
        lo, hi = i * cs, min(n, (i + 1) * cs)
        src = body[lo + i * TAG_BYTES:hi + (i + 1) * TAG_BYTES]
        aead.decrypt_into(_chunk_nonce(i), src, _chunk_aad(hh, i, i == k - 1), omv[lo:hi])

    try:
        _map(dec, k, workers)
    except InvalidTag as exc:
        out[:] = 0  # never hand out unauthenticated plaintext
        raise DecryptionFailed("AES-GCM tag check failed (tampered, reordered or truncated)") from exc
    return out
