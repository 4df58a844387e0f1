"""Admission: the relying party's whole RATS flow in one object.

    gate = AttestationGate({"eat-jwt": verifier}, policy)
    challenge = gate.challenge("site-a")                      # 1. verifier-made nonce
    evidence = attester.attest(challenge.nonce_bytes(), key)  # 2. at the attester
    result = gate.admit("site-a", evidence, public_key=key)   # 3. verify + policy, or raise

The same gate works in both directions: the coordinator admits sites, and a site admits the
coordinator (binding its X25519 sealing key) before sealing an update to it.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping

from .errors import AttestationError, MalformedEvidence, ReplayedToken, UnknownVerifier
from .models import AttestationResult, Challenge, Evidence, unb64url, utcnow
from .nonces import NonceCache
from .policy import Policy
from .verifier import Verifier

log = logging.getLogger(__name__)


class AttestationGate:
    def __init__(self, verifiers: Mapping[str, Verifier], policy: Policy, *, nonce_ttl_s: float = 120.0,
                 nonces: NonceCache | None = None):
        self.verifiers = dict(verifiers)
        self.policy = policy
        self.nonces = nonces or NonceCache(ttl_s=nonce_ttl_s)

    def challenge(self, party: str, now: dt.datetime | None = None) -> Challenge:
        return self.nonces.issue(party, now)

    def admit(self, party: str, evidence: Evidence, *, public_key: bytes, now: dt.datetime | None = None,
              nonce_party: str | None = None) -> AttestationResult:
        """Admit ``party`` iff ``evidence`` answers a challenge issued to it, binds ``public_key``
        (the key the relying party knows for it), verifies, and satisfies the policy.
        ``nonce_party``: the label the challenge was issued under, when it is not the party's name
        (e.g. the transport address it was sent to, before the party said who it is)."""
        now = now or utcnow()
        try:
            if evidence.attester != party:
                raise MalformedEvidence(f"evidence names attester {evidence.attester!r}, expected {party!r}")
            if self.nonces.seen_evidence(evidence.payload):
                raise ReplayedToken("this evidence was presented before")
            try:
                nonce = unb64url(evidence.nonce)
            except ValueError as exc:
                raise MalformedEvidence("evidence nonce is not base64url") from exc
            self.nonces.consume(nonce_party or party, nonce, now)
            result = appraise(evidence, nonce=nonce, public_key=public_key, verifiers=self.verifiers,
                              policy=self.policy, now=now)
        except AttestationError as exc:
            log.info("attestation of %r rejected: %s", party, exc)
            raise
        log.info("attestation of %r accepted by %s until %s", party, result.verifier, result.expires_at.isoformat())
        return result


def appraise(evidence: Evidence, *, nonce: bytes, public_key: bytes, verifiers: Mapping[str, Verifier],
             policy: Policy, now: dt.datetime | None = None) -> AttestationResult:
    """Verify ``evidence`` against a nonce the relying party made and already checked as fresh and
    unused, then apply ``policy``. The gate's nonce bookkeeping lives in memory; a relying party
    whose state lives elsewhere (a site's ClientApp, one process per message) calls this directly."""
    verifier = verifiers.get(evidence.format)
    if verifier is None:
        raise UnknownVerifier(f"no verifier configured for evidence format {evidence.format!r}")
    result = verifier.verify(evidence, nonce=nonce, now=now)
    return policy.evaluate(result, nonce=nonce, public_key=public_key, now=now)
