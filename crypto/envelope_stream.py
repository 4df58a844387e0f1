"""Envelopes made from a stream: the same version-1 envelope as `crypto.envelope.make_envelope`,
byte for byte in format, for a payload read piece by piece (a file) and a body written piece by
piece (another file), so the sender never holds more than a window of chunks.

Why two passes over the payload: the header carries the payload's tree digest and is signed, and
every sealed chunk's AAD binds the header's hash, so nothing can be encrypted before the whole
payload was hashed. Pass 1 hashes the leaves (`workers` chunks at a time, in threads: hashlib
releases the GIL); pass 2 reads each chunk again, encrypts it (or copies it when unsealed) and
writes it at its place in the body. Memory: about 2 x `workers` x `chunk_size` bytes, whatever the
payload's size. The receiver opens it with `crypto.envelope.open_envelope` as any other envelope.

Kept apart from crypto/envelope.py on purpose: that module's functions are unchanged; this one
only reuses its header, digest and nonce helpers.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from crypto.envelope import (
    DEFAULT_CHUNK, DEFAULT_WORKERS, DIGEST_ALGS, MAX_CHUNK, MIN_CHUNK, NONCE_BYTES, TAG_BYTES, EnvelopeHeader,
    _chunk_aad, _chunk_nonce, _derive_key, _leaf_digest, _raw, tree_root,
)

Read = Callable[[int, int], bytes | bytearray | memoryview]  # (offset, length) -> exactly `length` bytes
Write = Callable[[int, bytes | bytearray | memoryview], None]  # (offset in the body, bytes)


def _windows(n: int, chunk_size: int, workers: int):
    """Chunk indices in groups of `workers` (at least one chunk: an empty payload has one leaf)."""
    k = max(1, -(-n // chunk_size))
    step = max(1, workers)
    for start in range(0, k, step):
        yield k, list(range(start, min(k, start + step)))


def _read_chunk(read: Read, n: int, chunk_size: int, i: int):
    lo, hi = i * chunk_size, min(n, (i + 1) * chunk_size)
    data = read(lo, hi - lo) if hi > lo else b""
    if len(data) != hi - lo:
        raise ValueError(f"payload source returned {len(data)} bytes for [{lo}, {hi})")
    return data


def tree_digest_stream(read: Read, n: int, *, alg: str = "sha256", chunk_size: int = DEFAULT_CHUNK,
                       workers: int = DEFAULT_WORKERS, pool: ThreadPoolExecutor | None = None) -> bytes:
    """`crypto.envelope.tree_digest` of the `n` bytes `read` returns, a window of chunks at a time."""
    if alg not in DIGEST_ALGS:
        raise ValueError(f"digest must be one of {DIGEST_ALGS}")
    root = tree_root(alg, n, chunk_size)
    for _, idx in _windows(n, chunk_size, workers):
        pieces = [_read_chunk(read, n, chunk_size, i) for i in idx]
        leaves = (pool.map(lambda p: _leaf_digest(alg, memoryview(p)), pieces) if pool is not None and len(pieces) > 1
                  else [_leaf_digest(alg, memoryview(p)) for p in pieces])
        for leaf in leaves:
            root.update(leaf)
        del pieces
    return root.digest()


def body_length(n: int, chunk_size: int, sealed: bool) -> int:
    """The body's size for an `n`-byte payload: the payload, plus one tag per chunk when sealed."""
    return n + (TAG_BYTES * max(1, -(-n // chunk_size)) if sealed else 0)


def make_envelope_stream(
    read: Read,
    n: int,
    write: Write,
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
) -> tuple[bytes, bytes, int]:
    """Sign (and seal to `seal_to`) the `n`-byte payload `read` gives, writing the body with `write`.

    Returns (header bytes, signature, body length): with the body, an `Envelope` that
    `open_envelope` opens exactly as one `make_envelope` made.
    """
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise ValueError("chunk_size out of range")
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sovfl-envelope-stream") as pool:
        digest = tree_digest_stream(read, n, alg=digest_alg, chunk_size=chunk_size, workers=workers, pool=pool)
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
        aead = None
        if seal_to is not None and eph_priv is not None:
            aead = AESGCM(_derive_key(eph_priv.exchange(seal_to), header.ephemeral, header.recipient))
        hh = hashlib.sha256(hbytes).digest()
        for k, idx in _windows(n, chunk_size, workers):
            pieces = [_read_chunk(read, n, chunk_size, i) for i in idx]
            if aead is None:
                out = pieces
            else:
                def enc(j: int) -> bytes:
                    i = idx[j]
                    return aead.encrypt(_chunk_nonce(i), bytes(pieces[j]), _chunk_aad(hh, i, i == k - 1))

                out = list(pool.map(enc, range(len(idx)))) if len(idx) > 1 else [enc(0)]
            for i, data in zip(idx, out):
                if len(data):
                    write(i * chunk_size + (i * TAG_BYTES if aead is not None else 0), data)
            del pieces, out
    return hbytes, signature, header.body_len
