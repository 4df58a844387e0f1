"""Verifier-made nonces, each accepted once (the attester never chooses its nonce)."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import threading
from collections import OrderedDict

from .errors import NonceMismatch, ReplayedToken
from .models import Challenge, b64url, utcnow


class NonceCache:
    """Issue nonces per party with a deadline; ``consume`` accepts each exactly once.

    Consumed nonces and accepted evidence digests are remembered (bounded), so a replayed token is
    reported as a replay rather than as an unknown nonce.
    """

    def __init__(self, ttl_s: float = 120.0, max_entries: int = 100_000, nonce_bytes: int = 32):
        self.ttl = dt.timedelta(seconds=ttl_s)
        self._lock = threading.Lock()
        self._issued: OrderedDict[bytes, tuple[str, dt.datetime]] = OrderedDict()
        self._used: OrderedDict[bytes, None] = OrderedDict()
        self._max = max_entries
        self._n = nonce_bytes

    def issue(self, party: str, now: dt.datetime | None = None) -> Challenge:
        nonce, now = os.urandom(self._n), now or utcnow()
        with self._lock:
            self._issued[nonce] = (party, now + self.ttl)
            while len(self._issued) > self._max:
                self._issued.popitem(last=False)
        return Challenge(party=party, nonce=b64url(nonce), expires_at=now + self.ttl)

    def consume(self, party: str, nonce: bytes, now: dt.datetime | None = None) -> None:
        now = now or utcnow()
        with self._lock:
            if nonce in self._used:
                raise ReplayedToken("nonce already used: evidence replayed")
            entry = self._issued.pop(nonce, None)
            if entry is None:
                raise NonceMismatch("nonce was not issued by this verifier (or was evicted)")
            self._mark(self._used, nonce)
        owner, deadline = entry
        if owner != party:
            raise NonceMismatch(f"nonce was issued to {owner!r}, not {party!r}")
        if now > deadline:
            raise NonceMismatch("nonce expired before the evidence arrived")

    def seen_evidence(self, payload: str) -> bool:
        """Record an evidence payload; True if it was seen before (token replay)."""
        digest = hashlib.sha256(payload.encode("utf-8", "surrogatepass")).digest()  # any str a party sent
        with self._lock:
            if digest in self._used:
                return True
            self._mark(self._used, digest)
            return False

    def _mark(self, table: OrderedDict[bytes, None], key: bytes) -> None:
        table[key] = None
        while len(table) > self._max:
            table.popitem(last=False)
