"""Appraisal policy for attestation results (the RATS "appraisal policy for attestation results")."""

from __future__ import annotations

import datetime as dt
import logging

from pydantic import BaseModel, ConfigDict, Field

from .errors import (
    DebugEnabled, InsecureVerifierRefused, KeyBindingMismatch, MeasurementNotAllowed, NonceMismatch, TokenExpired,
    TokenTooOld, VerifierNotAllowed,
)
from .models import AttestationResult, b64url, key_hash, same_text, utcnow

log = logging.getLogger(__name__)


class Policy(BaseModel):
    """What a relying party accepts. Defaults are strict: debug off, fresh, nonce and key bound."""

    model_config = ConfigDict(extra="forbid")

    allowed_measurements: dict[str, list[str]] = Field(default_factory=dict, description="claim name -> allowed "
                                                       "values (hex compared case-insensitively); each listed claim "
                                                       "must be present")
    require_measurements: bool = Field(True, description="an empty allowlist admits nothing unless this is false")
    forbid_debug: bool = Field(True, description="refuse evidence of a debug-enabled TEE")
    require_debug_claim: bool = Field(True, description="evidence silent on debug state counts as debug")
    max_token_age_s: float = Field(300.0, gt=0, description="oldest attestation result accepted, in seconds")
    clock_skew_s: float = Field(60.0, ge=0, le=600, description="clock difference tolerated on token times")
    require_nonce: bool = Field(True, description="the result must bind the relying party's fresh nonce")
    require_key_binding: bool = Field(True, description="the evidence must bind the party's registered public key")
    allowed_verifiers: list[str] | None = Field(None, description="verifiers whose results count; unset: any "
                                                "registered")
    allow_insecure_dev: bool = Field(False, description="accept the insecure-dev verifier (tests only; no hardware "
                                     "root of trust)")

    def evaluate(
        self,
        result: AttestationResult,
        *,
        nonce: bytes | None,
        public_key: bytes | None,
        now: dt.datetime | None = None,
    ) -> AttestationResult:
        """Raise the matching :class:`AttestationError` or return ``result`` with a capped expiry."""
        now = now or utcnow()
        if self.allowed_verifiers is not None and result.verifier not in self.allowed_verifiers:
            raise VerifierNotAllowed(f"verifier {result.verifier!r} not in {self.allowed_verifiers}")
        if result.insecure:
            if not self.allow_insecure_dev:
                raise InsecureVerifierRefused("policy does not allow insecure-dev attestation")
            log.warning("INSECURE attestation accepted for %r (insecure-dev): no hardware root of trust", result.attester)
        if self.require_nonce and (nonce is None or not same_text(result.nonce, b64url(nonce))):
            raise NonceMismatch("result is not bound to the expected nonce")
        if self.require_key_binding and (
            public_key is None or not same_text(result.key_hash, b64url(key_hash(public_key)))
        ):
            raise KeyBindingMismatch("evidence is bound to a different public key than the party's")
        skew = dt.timedelta(seconds=self.clock_skew_s)
        if now > result.expires_at + skew:
            raise TokenExpired(f"result expired at {result.expires_at.isoformat()}")
        if now - result.issued_at > dt.timedelta(seconds=self.max_token_age_s) + skew:
            raise TokenTooOld(f"issued {result.issued_at.isoformat()}, older than {self.max_token_age_s:g}s")
        if self.require_measurements and not self.allowed_measurements:
            raise MeasurementNotAllowed("policy allowlists no measurements")
        for claim, allowed in self.allowed_measurements.items():
            got = result.measurements.get(claim)
            if got is None:
                raise MeasurementNotAllowed(f"evidence lacks measurement {claim!r}")
            if got.lower() not in {a.lower() for a in allowed}:
                raise MeasurementNotAllowed(f"{claim}={got} is not allowlisted")
        if self.forbid_debug and (result.debug or (result.debug is None and self.require_debug_claim)):
            raise DebugEnabled("debug mode is on" if result.debug else "evidence does not state that debug is off")
        cap = result.issued_at + dt.timedelta(seconds=self.max_token_age_s)
        return result.model_copy(update={"expires_at": min(result.expires_at, cap)})
