"""Attestation failures: one class per reason, each with a stable ``reason`` code for metrics.

Failure closes the door: callers treat any :class:`AttestationError` as "not admitted".
"""

from __future__ import annotations


class AttestationError(Exception):
    reason = "attestation_failed"

    def __init__(self, detail: str = ""):
        super().__init__(f"{self.reason}: {detail}" if detail else self.reason)
        self.detail = detail


class MalformedEvidence(AttestationError):
    reason = "malformed_evidence"


class UnsupportedAlgorithm(AttestationError):
    reason = "unsupported_algorithm"


class BadSignature(AttestationError):
    reason = "bad_signature"


class UnknownSigningKey(AttestationError):
    reason = "unknown_signing_key"


class WrongIssuer(AttestationError):
    reason = "wrong_issuer"


class WrongAudience(AttestationError):
    reason = "wrong_audience"


class TokenExpired(AttestationError):
    reason = "token_expired"


class TokenNotYetValid(AttestationError):
    reason = "token_not_yet_valid"


class TokenTooOld(AttestationError):
    reason = "token_too_old"


class NonceMismatch(AttestationError):
    reason = "nonce_mismatch"


class KeyBindingMismatch(AttestationError):
    reason = "key_binding_mismatch"


class MeasurementNotAllowed(AttestationError):
    reason = "measurement_not_allowed"


class DebugEnabled(AttestationError):
    reason = "debug_enabled"


class ReplayedToken(AttestationError):
    reason = "replayed_token"


class UnknownVerifier(AttestationError):
    reason = "unknown_verifier"


class VerifierNotAllowed(AttestationError):
    reason = "verifier_not_allowed"


class InsecureVerifierRefused(AttestationError):
    reason = "insecure_verifier_refused"


class WrongKeyType(AttestationError):
    """The pinned key for the token's kid is not a key for its alg (an RSA key offered for ES384)."""
    reason = "wrong_key_type"


class UnsupportedCriticalHeader(AttestationError):
    """``crit`` names an extension the verifier does not implement (RFC 7515 4.1.11: refuse)."""
    reason = "unsupported_critical_header"


class UntrustedRoot(AttestationError):
    """A certificate chain does not end at a pinned root."""
    reason = "untrusted_root"


class BadCertificateChain(AttestationError):
    """A certificate chain to a pinned root does not validate (signature, validity, structure)."""
    reason = "bad_certificate_chain"
