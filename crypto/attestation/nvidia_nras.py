"""``nvidia-nras``: NVIDIA Remote Attestation Service results for GPUs in confidential-computing mode.

Evidence (``Evidence.payload``) is NRAS's response to ``/v3/attest/gpu`` or ``/v4/attest/gpu``
as the site received it (from ``nvattest`` or NRAS directly): the JSON
``[["JWT", <overall token>], {"GPU-0": <detached token>, ...}]``. Checked offline:

- every token is ES384 (the list is configurable, never HS* or none) under a pinned NRAS JWKS
  file, with the exact issuer, ``exp``/``nbf``/``iat`` against the verifier's clock with bounded
  skew, and ``eat_nonce`` equal to the binding (nonce folded with the key hash, hex);
- the overall token's ``submods`` names exactly the detached tokens, each with the SHA-256 of
  that token (a token swapped between GPUs, added or dropped fails);
- ``x-nvidia-overall-att-result`` true, each GPU's ``measres`` "success", ``secboot`` true, the
  configured per-GPU claims (NVIDIA's v4 policy by default) and debug from ``dbgstat``.

Driver and VBIOS versions and ``hwmodel`` become measurements (one value when all GPUs agree,
and per GPU as ``GPU-n.<claim>``). NVIDIA's attestation SDK is not imported.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from .errors import (
    AttestationError, MalformedEvidence, NonceMismatch, WrongIssuer,
)
from .jose import PinnedTokenConfig, token_window, verify_jws
from .models import AttestationResult, Evidence, b64url, binding, key_hash, load_json, same_text, \
    unb64url, utcnow
from .verifier import Verifier

DEBUG_OFF = ("disabled", "disabled-since-boot", "disabled-permanently", "disabled-fully-and-permanently")
MEASUREMENT_CLAIMS = ("hwmodel", "x-nvidia-gpu-driver-version", "x-nvidia-gpu-vbios-version")
MAX_GPUS = 64
# Per-GPU claims that must hold, from NVIDIA's v4 remote policy (present in both the v2.0 and v3.0
# claim sets NRAS issues); measres, secboot and dbgstat are checked separately.
DEFAULT_DETACHED_CLAIMS: dict[str, Any] = {
    "x-nvidia-gpu-arch-check": True,
    "x-nvidia-gpu-attestation-report-parsed": True,
    "x-nvidia-gpu-attestation-report-nonce-match": True,
    "x-nvidia-gpu-attestation-report-signature-verified": True,
    "x-nvidia-gpu-driver-rim-schema-validated": True,
    "x-nvidia-gpu-driver-rim-signature-verified": True,
    "x-nvidia-gpu-driver-rim-measurements-available": True,
    "x-nvidia-gpu-vbios-rim-schema-validated": True,
    "x-nvidia-gpu-vbios-rim-signature-verified": True,
    "x-nvidia-gpu-vbios-rim-measurements-available": True,
    "x-nvidia-gpu-vbios-index-no-conflict": True,
}


class SubmodDigestMismatch(AttestationError):
    """A detached GPU token is not the one the overall token's ``submods`` names (swapped, added, dropped)."""
    reason = "submod_digest_mismatch"


class AppraisalFailed(AttestationError):
    """The service appraised the evidence and said no (overall result false, measres not success, a
    required claim not as required)."""
    reason = "appraisal_failed"


class SecureBootOff(AttestationError):
    reason = "secure_boot_off"


class NrasConfig(PinnedTokenConfig):
    """jwks/jwks_path: the NRAS token-signing keys."""

    issuer: str = "https://nras.attestation.nvidia.com"
    detached_issuer: str | None = None  # None: the same as issuer
    algorithms: list[str] = Field(default_factory=lambda: ["ES384"])
    min_gpus: int = Field(1, ge=1, le=MAX_GPUS)
    required_overall_claims: dict[str, Any] = Field(default_factory=lambda: {"x-nvidia-overall-att-result": True})
    required_detached_claims: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_DETACHED_CLAIMS))



def matches(value: Any, required: Any) -> bool:
    """``value`` satisfies ``required``: equal, with bools kept apart from ints, and for a mapping
    every required key matching recursively (extra keys allowed)."""
    if isinstance(required, dict):
        return isinstance(value, dict) and all(k in value and matches(value[k], v) for k, v in required.items())
    return isinstance(value, bool) == isinstance(required, bool) and type(value) is type(required) and value == required


class NrasVerifier(Verifier):
    name: ClassVar[str] = "nvidia-nras"
    config_model: ClassVar[type[BaseModel]] = NrasConfig
    config: NrasConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.jwks = self.config.pinned_jwks()

    def _token(self, token: Any, what: str, issuer: str, expected_nonce: str, now: dt.datetime
               ) -> tuple[dict[str, Any], dt.datetime, dt.datetime]:
        c = self.config
        _, claims = verify_jws(token, self.jwks, c.algorithms, understood_crit=c.understood_crit, now=now)
        if not same_text(claims.get("iss"), issuer):
            raise WrongIssuer(f"{what}: iss {str(claims.get('iss'))[:80]!r}, expected {issuer!r}")
        iat, exp = token_window(claims, now, c.clock_skew_s, what)
        got = claims.get("eat_nonce")
        if not (isinstance(got, str) and same_text(got.lower(), expected_nonce)):
            raise NonceMismatch(f"{what}: eat_nonce does not bind this challenge and key")
        return claims, iat, exp

    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult:
        c, now = self.config, now or utcnow()
        body = load_json(evidence.payload, "NRAS result")
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], list) and len(body[0]) == 2
                and body[0][0] == "JWT" and isinstance(body[0][1], str) and isinstance(body[1], dict)):
            raise MalformedEvidence('NRAS result is [["JWT", overall token], {"GPU-0": detached token, ...}]')
        overall_token, detached = body[0][1], body[1]
        if not c.min_gpus <= len(detached) <= MAX_GPUS or not all(isinstance(t, str) for t in detached.values()):
            raise MalformedEvidence(f"NRAS result holds {len(detached)} GPU token(s); between {c.min_gpus} and "
                                    f"{MAX_GPUS} strings expected")
        try:
            claimed_key, ev_nonce = evidence.public_key_bytes(), unb64url(evidence.nonce)
        except ValueError:
            raise MalformedEvidence("evidence nonce/public_key is not base64url") from None
        if ev_nonce != nonce:
            raise NonceMismatch("evidence answers another challenge")
        expected = binding(nonce, claimed_key).hex()

        overall, iat, exp = self._token(overall_token, "overall token", c.issuer, expected, now)
        submods = overall.get("submods")
        if not isinstance(submods, dict) or set(submods) != set(detached):
            raise SubmodDigestMismatch(f"submods names {sorted(submods)[:8] if isinstance(submods, dict) else None}, "
                                       f"the result carries {sorted(detached)[:8]}")
        for gpu, token in detached.items():
            entry = submods[gpu]
            ok = (isinstance(entry, list) and len(entry) == 2 and entry[0] == "DIGEST" and isinstance(entry[1], list)
                  and len(entry[1]) == 2 and entry[1][0] == "SHA-256" and isinstance(entry[1][1], str))
            if not ok:
                raise MalformedEvidence(f"submods[{gpu!r}] is not [\"DIGEST\", [\"SHA-256\", hex]]")
            if not same_text(entry[1][1].lower(), hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()):
                raise SubmodDigestMismatch(f"the token for {gpu} is not the one the overall token's submods digests")
        for claim, want in c.required_overall_claims.items():
            if not matches(overall.get(claim), want):
                raise AppraisalFailed(f"overall token: {claim} is {str(overall.get(claim))[:60]!r}, required {want!r}")

        gpus: dict[str, dict[str, Any]] = {}
        debug = False
        for gpu in sorted(detached):
            claims, g_iat, g_exp = self._token(detached[gpu], f"{gpu} token", c.detached_issuer or c.issuer,
                                               expected, now)
            iat, exp = max(iat, g_iat), min(exp, g_exp)
            if claims.get("measres") != "success":
                raise AppraisalFailed(f"{gpu}: measres is {str(claims.get('measres'))[:40]!r}, not 'success'")
            if claims.get("secboot") is not True:
                raise SecureBootOff(f"{gpu}: secboot is {str(claims.get('secboot'))[:20]!r}")
            for claim, want in c.required_detached_claims.items():
                if not matches(claims.get(claim), want):
                    raise AppraisalFailed(f"{gpu}: {claim} is {str(claims.get(claim))[:60]!r}, required {want!r}")
            dbg = claims.get("dbgstat")
            if dbg not in DEBUG_OFF:
                debug = True
            gpus[gpu] = claims

        measurements: dict[str, str] = {"gpu_count": str(len(gpus))}
        for name in MEASUREMENT_CLAIMS:
            values = {gpu: str(cl.get(name, "")).lower() for gpu, cl in gpus.items()}
            for gpu, v in values.items():
                measurements[f"{gpu}.{name}"] = v
            if len(set(values.values())) == 1 and "" not in values.values():
                measurements[name] = next(iter(values.values()))
        return AttestationResult(
            verifier=self.name, attester=evidence.attester, issuer=overall.get("iss"), nonce=b64url(nonce),
            key_hash=b64url(key_hash(claimed_key)), measurements=measurements, debug=debug, issued_at=iat,
            expires_at=exp, claims={"overall": overall, "gpus": gpus},
        )
