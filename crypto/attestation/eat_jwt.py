"""Verifier for EAT attestation-result tokens in JWT form.

This is the shape NVIDIA NRAS, Microsoft Azure Attestation and Intel Trust Authority return:
a JWS signed by the attestation service, whose claims carry the nonce, measurements and debug
state. Claim names differ per service, so they are configuration.

Key binding, two ways (``key_binding``):
- ``claim``: a claim (``key_binding_claim``) holds base64url(SHA-256(attester public key)), and
  the nonce claim holds the verifier nonce.
- ``nonce_hash``: services that carry only a nonce get SHA-256(nonce || SHA-256(public key))
  as the nonce, which binds both at once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import (
    KeyBindingMismatch, MalformedEvidence, NonceMismatch, TokenExpired, TokenNotYetValid, WrongAudience, WrongIssuer,
)
from .jose import Jwks, check_algorithms, load_pem_roots, verify_jws
from .models import AttestationResult, Evidence, b64url, key_hash, numeric_date, same_text, unb64url, utcnow
from .verifier import Verifier

DEBUG_OFF_DBGSTAT = ["disabled", "disabled-since-boot", "disabled-permanently", "disabled-fully-and-permanently",
                     1, 2, 3, 4]


def claim_at(claims: dict[str, Any], path: str) -> Any:
    """Dotted-path lookup ("x-ms-isolation-tee.x-ms-sevsnpvm-is-debuggable"); None if absent."""
    if path in claims:
        return claims[path]
    cur: Any = claims
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


class EatJwtConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jwks: dict[str, Any] | None = None  # trusted service keys, inline ...
    jwks_path: str | None = None  # ... or from a file (air-gapped: no JWKS fetching)
    x5c_roots_path: str | None = None  # PEM roots an x5c header chain must end at (never the token's own)
    understood_crit: list[str] = Field(default_factory=list)  # header names a `crit` may list
    issuer: str
    audience: str | None = None
    algorithms: list[str] = Field(default_factory=lambda: ["ES256", "ES384", "RS256", "PS256", "EdDSA"])
    nonce_claims: list[str] = Field(default_factory=lambda: ["eat_nonce", "nonce"])
    nonce_encoding: Literal["base64url", "hex"] = "base64url"
    key_binding: Literal["claim", "nonce_hash"] = "claim"
    key_binding_claim: str = "sovfl_key_hash"
    measurement_claims: list[str] = Field(default_factory=lambda: ["measurement"])
    # claim -> the values that mean "debug is off"; any other value counts as debug on.
    debug_claims: dict[str, list[Any]] = Field(default_factory=lambda: {"dbgstat": DEBUG_OFF_DBGSTAT})
    clock_skew_s: float = Field(60.0, ge=0, le=600)
    require_iat: bool = True

    @field_validator("algorithms")
    @classmethod
    def _explicit_algorithms(cls, v: list[str]) -> list[str]:
        return check_algorithms(v)

    @model_validator(mode="after")
    def _one_jwks(self) -> "EatJwtConfig":
        if self.jwks is not None and self.jwks_path is not None:
            raise ValueError("give one of jwks or jwks_path, not both")
        if self.jwks is None and self.jwks_path is None and self.x5c_roots_path is None:
            raise ValueError("give jwks or jwks_path (pinned token keys) or x5c_roots_path (pinned roots)")
        return self


def _ts(claims: dict[str, Any], name: str) -> dt.datetime | None:
    v = claims.get(name)
    return None if v is None else numeric_date(v, name)


def _is_off(value: Any, off_values: list[Any]) -> bool:
    """Exact match that keeps bools and ints apart (True must not match 1)."""
    return any(isinstance(o, bool) == isinstance(value, bool) and o == value for o in off_values)


class EatJwtVerifier(Verifier):
    name: ClassVar[str] = "eat-jwt"
    config_model: ClassVar[type[BaseModel]] = EatJwtConfig
    config: EatJwtConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        c = self.config
        self.jwks = (Jwks.from_dict(c.jwks) if c.jwks is not None
                     else Jwks.from_file(Path(c.jwks_path)) if c.jwks_path is not None else None)
        self.x5c_roots = load_pem_roots(c.x5c_roots_path) if c.x5c_roots_path else []

    def _encode_nonce(self, raw: bytes) -> str:
        return raw.hex() if self.config.nonce_encoding == "hex" else b64url(raw)

    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult:
        c, now = self.config, now or utcnow()
        skew = dt.timedelta(seconds=c.clock_skew_s)
        _, claims = verify_jws(evidence.payload, self.jwks, c.algorithms, understood_crit=c.understood_crit,
                               x5c_roots=self.x5c_roots, now=now)

        if claims.get("iss") != c.issuer:
            raise WrongIssuer(f"iss {claims.get('iss')!r}, expected {c.issuer!r}")
        if c.audience is not None:
            aud = claims.get("aud")
            auds = aud if isinstance(aud, list) else [aud]
            if c.audience not in auds:
                raise WrongAudience(f"aud {aud!r} does not include {c.audience!r}")
        exp, nbf, iat = _ts(claims, "exp"), _ts(claims, "nbf"), _ts(claims, "iat")
        if exp is None:
            raise MalformedEvidence("token has no exp")
        if iat is None and c.require_iat:
            raise MalformedEvidence("token has no iat")
        if now > exp + skew:
            raise TokenExpired(f"expired at {exp.isoformat()}")
        if nbf is not None and now + skew < nbf:
            raise TokenNotYetValid(f"not before {nbf.isoformat()}")
        if iat is not None and now + skew < iat:
            raise TokenNotYetValid(f"issued in the future ({iat.isoformat()})")

        try:
            claimed_key = evidence.public_key_bytes()
            if unb64url(evidence.nonce) != nonce:
                raise NonceMismatch("evidence answers another challenge")
        except ValueError as exc:
            raise MalformedEvidence("evidence nonce/public_key is not base64url") from exc
        khash = key_hash(claimed_key)
        bound = nonce if c.key_binding == "claim" else hashlib.sha256(nonce + khash).digest()
        expected = self._encode_nonce(bound)
        token_nonces = [claim_at(claims, n) for n in c.nonce_claims]
        token_nonces = [v for t in token_nonces if t is not None for v in (t if isinstance(t, list) else [t])]
        if not token_nonces:
            raise NonceMismatch(f"token has none of the nonce claims {c.nonce_claims}")
        if not any(isinstance(v, str) and same_text(v.lower() if c.nonce_encoding == "hex" else v, expected)
                   for v in token_nonces):
            raise NonceMismatch("token nonce does not match the challenge" +
                                (" and key" if c.key_binding == "nonce_hash" else ""))
        if c.key_binding == "claim":
            bound_key = claim_at(claims, c.key_binding_claim)
            if not same_text(bound_key, b64url(khash)):
                raise KeyBindingMismatch(f"claim {c.key_binding_claim!r} does not bind the presented public key")

        measurements = {}
        for name in c.measurement_claims:
            v = claim_at(claims, name)
            if v is not None:
                measurements[name] = v.lower() if isinstance(v, str) else str(v)
        debug: bool | None = None
        for name, off_values in c.debug_claims.items():
            v = claim_at(claims, name)
            if v is None:
                continue
            debug = bool(debug) or not _is_off(v, off_values)
        return AttestationResult(
            verifier=self.name, attester=evidence.attester, issuer=claims.get("iss"), nonce=b64url(nonce),
            key_hash=b64url(khash), measurements=measurements, debug=debug, issued_at=iat or now,
            expires_at=exp, claims=claims,
        )
