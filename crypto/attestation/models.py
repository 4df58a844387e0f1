"""RATS (RFC 9334) conceptual messages as pydantic models: evidence in, attestation results out."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import MalformedEvidence


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


_B64URL = re.compile(r"[A-Za-z0-9_-]*")
# NumericDates are refused outside [1970, 9000): datetime ends at year 9999, and a skew or a
# policy's age limit is added to them; no attestation token is issued before 1970 or for millennia.
MAX_NUMERIC_DATE = 221845392000.0  # 9000-01-01T00:00:00Z


def is_b64url(text: Any) -> bool:
    """Unpadded base64url (as in JOSE): only the 64 URL-safe characters, in a decodable length."""
    return isinstance(text, str) and _B64URL.fullmatch(text) is not None and len(text) % 4 != 1


def unb64url(text: str) -> bytes:
    """Strict base64url without padding, in its one canonical form (unused trailing bits zero, so
    no two texts decode to the same bytes); ValueError otherwise."""
    if not is_b64url(text):
        raise ValueError("not unpadded base64url")
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if b64url(data) != text:
        raise ValueError("non-canonical base64url (unused bits set)")
    return data


def load_json(data: bytes | str, what: str) -> Any:
    """JSON from another party; MalformedEvidence (never RecursionError) when it does not parse."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise MalformedEvidence(f"{what} is not JSON ({type(exc).__name__})") from None


def numeric_date(value: Any, name: str) -> dt.datetime:
    """A JWT NumericDate (seconds since the epoch) as an aware datetime; MalformedEvidence if the
    value is not a finite number in [1970, 9000)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedEvidence(f"claim {name!r} is not a NumericDate")
    if not (isinstance(value, int) or math.isfinite(value)) or not 0 <= value < MAX_NUMERIC_DATE:
        raise MalformedEvidence(f"claim {name!r} = {value!r:.40} is not a date between 1970 and 9000")
    return dt.datetime.fromtimestamp(value, dt.timezone.utc)


def same_text(value: Any, expected: str) -> bool:
    """Constant-time equality of a received value with an expected string (any characters)."""
    return isinstance(value, str) and hmac.compare_digest(value.encode("utf-8", "surrogatepass"),
                                                          expected.encode("utf-8", "surrogatepass"))


def key_hash(public_key: bytes) -> bytes:
    """The key binding: SHA-256 of the attester's public key bytes (raw or DER, as exchanged)."""
    return hashlib.sha256(public_key).digest()


def binding(nonce: bytes, public_key: bytes) -> bytes:
    """The verifier nonce folded with the key hash, for evidence with a single user-data field
    (SEV-SNP REPORT_DATA, NRAS ``eat_nonce``, Azure's client payload): SHA-256(nonce ‖ SHA-256(key))."""
    return hashlib.sha256(nonce + key_hash(public_key)).digest()


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


def parse_evidence(data: bytes | str) -> Evidence:
    """Evidence from its JSON wire form (``Evidence.model_dump_json``); MalformedEvidence otherwise."""
    try:
        return Evidence.model_validate_json(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in err.errors()[:5])
        raise MalformedEvidence(f"evidence is not an Evidence JSON object: {problems}") from None


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
