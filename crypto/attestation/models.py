"""RATS (RFC 9334) conceptual messages as pydantic models: evidence in, attestation results out."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """Strict base64url without padding (as in JOSE)."""
    if not isinstance(text, str) or "=" in text or any(c in text for c in "+/ \n\r\t"):
        raise ValueError("not unpadded base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_hash(public_key: bytes) -> bytes:
    """The key binding: SHA-256 of the attester's public key bytes (raw or DER, as exchanged)."""
    return hashlib.sha256(public_key).digest()


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class Challenge(BaseModel):
    """A verifier-made nonce for one party (the attester never picks its own nonce)."""

    model_config = ConfigDict(frozen=True)
    party: str
    nonce: str  # base64url
    expires_at: dt.datetime

    def nonce_bytes(self) -> bytes:
        return unb64url(self.nonce)


class Evidence(BaseModel):
    """What an attester sends: for ``format`` (the verifier name), bound to ``nonce`` and ``public_key``."""

    model_config = ConfigDict(frozen=True)
    format: str
    attester: str
    nonce: str  # base64url, echoes the challenge
    public_key: str  # base64url of the key the evidence binds (e.g. the X25519 sealing key)
    payload: str  # the token (JWT compact form) or encoded raw evidence

    def public_key_bytes(self) -> bytes:
        return unb64url(self.public_key)


class AttestationResult(BaseModel):
    """A verifier's appraisal, before policy. ``key_hash``/``nonce`` are what the evidence proved."""

    model_config = ConfigDict(frozen=True)
    verifier: str
    attester: str
    issuer: str | None = None
    nonce: str  # base64url of the verifier nonce the evidence is bound to
    key_hash: str  # base64url SHA-256 of the bound public key
    measurements: dict[str, str] = Field(default_factory=dict)
    debug: bool | None = None  # None: the evidence does not say
    issued_at: dt.datetime
    expires_at: dt.datetime
    insecure: bool = False
    claims: dict[str, Any] = Field(default_factory=dict)

    def valid_at(self, now: dt.datetime | None = None) -> bool:
        return (now or utcnow()) < self.expires_at
