"""Remote attestation after RATS (RFC 9334): attesters, verifier plug-ins, policy, admission.

The relying party makes the nonce; evidence binds the nonce and the attester's public key;
results expire; a policy allowlists measurements and rejects debug; any failure raises an
:class:`AttestationError` with a ``reason`` code and closes the door. See README.md.
"""

import importlib

# Lazy (PEP 562): `from crypto.attestation import X` loads only X's module, so a process that needs
# one model (federation.config's policy, a ClientApp without attestation work) does not pay for
# JOSE and X.509 (federation/protocol/message_cost.py).
_WHERE = {
    **dict.fromkeys((
        "ATTESTER_ENTRY_POINT_GROUP", "Attester", "TokenServiceAttester", "UnknownAttester",
        "available_attesters", "create_attester"
    ), "attester"),
    **dict.fromkeys((
        "EatJwtConfig", "EatJwtVerifier"
    ), "eat_jwt"),
    **dict.fromkeys((
        "AttestationError", "BadCertificateChain", "BadSignature", "DebugEnabled",
        "InsecureVerifierRefused", "KeyBindingMismatch", "MalformedEvidence", "MeasurementNotAllowed",
        "NonceMismatch", "ReplayedToken", "TokenExpired", "TokenNotYetValid", "TokenTooOld",
        "UnknownSigningKey", "UnknownVerifier", "UnsupportedAlgorithm", "UnsupportedCriticalHeader",
        "UntrustedRoot", "VerifierNotAllowed", "WrongAudience", "WrongIssuer", "WrongKeyType"
    ), "errors"),
    **dict.fromkeys((
        "AttestationGate", "appraise"
    ), "gate"),
    **dict.fromkeys((
        "InsecureDevAttester", "InsecureDevConfig", "InsecureDevVerifier"
    ), "insecure_dev"),
    **dict.fromkeys((
        "Jwks", "verify_jws"
    ), "jose"),
    **dict.fromkeys((
        "AttestationResult", "Challenge", "Evidence", "key_hash"
    ), "models"),
    **dict.fromkeys((
        "NonceCache",
    ), "nonces"),
    **dict.fromkeys((
        "Policy",
    ), "policy"),
    **dict.fromkeys((
        "ENTRY_POINT_GROUP", "Verifier", "available_verifiers", "create_verifier", "load_verifier_class"
    ), "verifier"),
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


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
