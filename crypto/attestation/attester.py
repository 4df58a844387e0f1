"""Attesters: produce evidence for a verifier-made nonce, bound to the attester's public key."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from .models import Evidence, b64url, key_hash


class Attester(ABC):
    """RATS attester role. ``public_key`` is the key the relying party will trust afterwards
    (the coordinator's X25519 sealing key, or a site's Ed25519 update key)."""

    format: str  # the verifier name that appraises this evidence

    def __init__(self, party: str):
        self.party = party

    @abstractmethod
    def attest(self, nonce: bytes, public_key: bytes) -> Evidence: ...


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
