"""``azure-maa``: Microsoft Azure Attestation tokens for SEV-SNP and TDX confidential VMs.

Evidence (``Evidence.payload``) is the token MAA returned to the VM (guest attestation). Checked
offline: RS256 (configurable, never HS* or none) under the instance's signing keys pinned from a
file (``https://<instance>/certs``, saved once), the exact tenant issuer, ``exp``/``nbf``/``iat``
with bounded skew, the TEE type (``x-ms-attestation-type`` of ``x-ms-isolation-tee``, or of the
token itself for direct SNP attestation) in the allowed set, the compliance status, the debug
claims of that TEE false, and the nonce in ``x-ms-runtime.client-payload`` equal to the binding
(nonce folded with the key hash). Launch measurement and host data (SNP) or MRTD and RTMRs (TDX)
become measurements; the claim names are configuration.
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .eat_jwt import claim_at
from .errors import AttestationError, MalformedEvidence, NonceMismatch, WrongIssuer
from .jose import PinnedTokenConfig, token_window, verify_jws
from .models import AttestationResult, Evidence, b64url, binding, key_hash, same_text, unb64url, utcnow
from .verifier import Verifier


class WrongAttestationType(AttestationError):
    reason = "wrong_attestation_type"


class NotCompliant(AttestationError):
    reason = "not_compliant"


def _default_debug() -> dict[str, dict[str, Any]]:
    return {"sevsnpvm": {"x-ms-sevsnpvm-is-debuggable": False}, "tdxvm": {"tdx_td_attributes_debug": False}}


def _default_measurements() -> dict[str, list[str]]:
    return {"sevsnpvm": ["x-ms-sevsnpvm-launchmeasurement", "x-ms-sevsnpvm-hostdata"],
            "tdxvm": ["tdx_mrtd", "tdx_rtmr0", "tdx_rtmr1", "tdx_rtmr2", "tdx_rtmr3"]}


class AzureMaaConfig(PinnedTokenConfig):
    """jwks/jwks_path: the instance's signing keys (a file saved from https://<instance>/certs)."""

    issuer: str  # exactly the instance URL, e.g. https://myattest.weu.attest.azure.net
    algorithms: list[str] = Field(default_factory=lambda: ["RS256"])
    attestation_types: list[Literal["sevsnpvm", "tdxvm"]] = Field(default_factory=lambda: ["sevsnpvm", "tdxvm"])
    compliance_claim: str = "x-ms-compliance-status"
    allowed_compliance: list[str] = Field(default_factory=lambda: ["azure-compliant-cvm"])
    nonce_claim: str = "x-ms-runtime.client-payload.nonce"
    nonce_encoding: Literal["base64", "base64url", "hex"] = "base64"
    # TEE type -> claim -> the value that means "debug is off"; any other value (or none) is debug
    debug_claims: dict[str, dict[str, Any]] = Field(default_factory=_default_debug)
    measurement_claims: dict[str, list[str]] = Field(default_factory=_default_measurements)


class AzureMaaVerifier(Verifier):
    name: ClassVar[str] = "azure-maa"
    config_model: ClassVar[type[BaseModel]] = AzureMaaConfig
    config: AzureMaaConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.jwks = self.config.pinned_jwks()

    def encode_nonce(self, raw: bytes) -> str:
        enc = self.config.nonce_encoding
        return raw.hex() if enc == "hex" else b64url(raw) if enc == "base64url" else base64.b64encode(raw).decode()

    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult:
        c, now = self.config, now or utcnow()
        _, claims = verify_jws(evidence.payload, self.jwks, c.algorithms, understood_crit=c.understood_crit, now=now)
        if not same_text(claims.get("iss"), c.issuer):
            raise WrongIssuer(f"iss {str(claims.get('iss'))[:80]!r}, expected {c.issuer!r}")
        iat, exp = token_window(claims, now, c.clock_skew_s)

        tee = claims.get("x-ms-isolation-tee")
        tee = tee if isinstance(tee, dict) else claims  # guest attestation nests the TEE's claims
        kind = tee.get("x-ms-attestation-type")
        if kind not in c.attestation_types:
            raise WrongAttestationType(f"x-ms-attestation-type {str(kind)[:40]!r}, allowed {c.attestation_types}")
        status = tee.get(c.compliance_claim, claims.get(c.compliance_claim))
        if status not in c.allowed_compliance:
            raise NotCompliant(f"{c.compliance_claim} is {str(status)[:60]!r}, allowed {c.allowed_compliance}")

        try:
            claimed_key, ev_nonce = evidence.public_key_bytes(), unb64url(evidence.nonce)
        except ValueError:
            raise MalformedEvidence("evidence nonce/public_key is not base64url") from None
        if ev_nonce != nonce:
            raise NonceMismatch("evidence answers another challenge")
        got = claim_at(claims, c.nonce_claim)
        if got is None:
            raise NonceMismatch(f"token has no {c.nonce_claim} (no client payload carrying the nonce)")
        if not same_text(got, self.encode_nonce(binding(nonce, claimed_key))):
            raise NonceMismatch(f"{c.nonce_claim} does not bind this challenge and key")

        debug: bool | None = None
        for claim, off in c.debug_claims.get(kind, {}).items():
            if claim in tee:
                value = tee[claim]
                debug = bool(debug) or not (type(value) is type(off) and value == off)
        measurements = {name: str(tee[name]).lower() for name in c.measurement_claims.get(kind, []) if name in tee}
        measurements["attestation_type"] = kind
        return AttestationResult(
            verifier=self.name, attester=evidence.attester, issuer=claims.get("iss"), nonce=b64url(nonce),
            key_hash=b64url(key_hash(claimed_key)), measurements=measurements, debug=debug, issued_at=iat,
            expires_at=exp, claims=claims,
        )
