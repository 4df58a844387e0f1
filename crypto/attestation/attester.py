"""Attesters: produce evidence for a verifier-made nonce, bound to the attester's public key."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from .errors import AttestationError
from .models import Evidence, b64url, key_hash
from .plugins import available, load_class

ATTESTER_ENTRY_POINT_GROUP = "sovereign_fl.attesters"
BUILTIN_ATTESTERS = {
    "insecure-dev": "crypto.attestation.insecure_dev:InsecureDevAttester",
    "local-token": "crypto.attestation.testing:LocalTokenAttester",
    "nras-test": "crypto.attestation.testing:NrasTestAttester",
    "amd-sev-snp": "crypto.attestation.sev_snp_attester:SevSnpAttester",
    "nvidia-nras": "crypto.attestation.nvidia_nras_attester:NrasCommandAttester",
    "amd-sev-snp-fake": "crypto.attestation.snp_testing:FakeDeviceSnpAttester",
}


class UnknownAttester(AttestationError):
    reason = "unknown_attester"


class Attester(ABC):
    """RATS attester role. ``public_key`` is the key the relying party will trust afterwards
    (the coordinator's X25519 sealing key, or a site's Ed25519 update key)."""

    format: str  # the verifier name that appraises this evidence

    def __init__(self, party: str):
        self.party = party

    @abstractmethod
    def attest(self, nonce: bytes, public_key: bytes) -> Evidence: ...

    @classmethod
    def from_config(cls, party: str, config: Mapping[str, Any]) -> "Attester":
        """Build from a config mapping (what a party's attestation file names); override when the
        constructor needs more than keyword values."""
        return cls(party, **dict(config))


class TokenServiceAttester(Attester):
    """Evidence from an attestation service (NRAS, MAA, Intel Trust Authority, ...).

    ``fetch_token(nonce, key_hash)`` runs the platform-specific part: it gathers the TEE report
    with report data derived from (nonce, key hash), sends it to the service and returns the
    JWT. Which of the two binding modes the service supports decides how to pass them.
    """

    format = "eat-jwt"

    def __init__(self, party: str, fetch_token: Callable[[bytes, bytes], str]):
        super().__init__(party)
        self._fetch = fetch_token

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        token = self._fetch(nonce, key_hash(public_key))
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=token)


def available_attesters() -> dict[str, str]:
    return available(ATTESTER_ENTRY_POINT_GROUP, BUILTIN_ATTESTERS)


def create_attester(kind: str, party: str, config: Mapping[str, Any] | None = None) -> Attester:
    """An attester by name: a built-in or a ``sovereign_fl.attesters`` plug-in (SEV-SNP, TDX, ...)."""
    cls = load_class(kind, group=ATTESTER_ENTRY_POINT_GROUP, builtins=BUILTIN_ATTESTERS, base=Attester,
                     error=UnknownAttester)
    try:
        return cls.from_config(party, config or {})
    except TypeError as exc:
        raise UnknownAttester(f"attester {kind!r} does not accept config {sorted(config or {})}: {exc}") from None
