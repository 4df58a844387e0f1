"""Remote attestation after RATS (RFC 9334): attesters, verifier plug-ins, policy, admission.

The relying party makes the nonce; evidence binds the nonce and the attester's public key;
results expire; a policy allowlists measurements and rejects debug; any failure raises an
:class:`AttestationError` with a ``reason`` code and closes the door. See README.md.
"""

from .attester import (
    ATTESTER_ENTRY_POINT_GROUP, Attester, TokenServiceAttester, UnknownAttester, available_attesters, create_attester,
)
from .eat_jwt import EatJwtConfig, EatJwtVerifier
from .errors import (
    AttestationError, BadCertificateChain, BadSignature, DebugEnabled, InsecureVerifierRefused, KeyBindingMismatch, MalformedEvidence,
    MeasurementNotAllowed, NonceMismatch, ReplayedToken, TokenExpired, TokenNotYetValid, TokenTooOld, UnknownSigningKey,
    UnknownVerifier, UnsupportedAlgorithm, UnsupportedCriticalHeader, UntrustedRoot, VerifierNotAllowed, WrongAudience,
    WrongIssuer, WrongKeyType,
)
from .gate import AttestationGate, appraise
from .insecure_dev import InsecureDevAttester, InsecureDevConfig, InsecureDevVerifier
from .jose import Jwks, verify_jws
from .models import AttestationResult, Challenge, Evidence, key_hash
from .nonces import NonceCache
from .policy import Policy
from .verifier import ENTRY_POINT_GROUP, Verifier, available_verifiers, create_verifier, load_verifier_class

__all__ = [
    "ATTESTER_ENTRY_POINT_GROUP", "UnknownAttester", "appraise", "available_attesters", "create_attester",
    "ENTRY_POINT_GROUP", "AttestationError", "AttestationGate", "AttestationResult", "Attester", "BadSignature",
    "Challenge", "DebugEnabled", "EatJwtConfig", "EatJwtVerifier", "Evidence", "InsecureDevAttester",
    "InsecureDevConfig", "InsecureDevVerifier", "InsecureVerifierRefused", "Jwks", "KeyBindingMismatch",
    "MalformedEvidence", "MeasurementNotAllowed", "NonceCache", "NonceMismatch", "Policy", "ReplayedToken",
    "TokenExpired", "TokenNotYetValid", "TokenServiceAttester", "TokenTooOld", "UnknownSigningKey", "UnknownVerifier",
    "UnsupportedAlgorithm", "Verifier", "VerifierNotAllowed", "WrongAudience", "WrongIssuer", "available_verifiers",
    "create_verifier", "key_hash", "load_verifier_class", "verify_jws", "BadCertificateChain",
    "UnsupportedCriticalHeader", "UntrustedRoot", "WrongKeyType",
]
