"""``insecure-dev``: software-only attestation for development. It proves nothing.

The verifier refuses to exist unless its config says ``allow_insecure_dev: true`` and logs a
WARNING at every use; :class:`Policy` also has to allow it. Never configure it in production.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from .attester import Attester
from .errors import InsecureVerifierRefused, KeyBindingMismatch, MalformedEvidence, NonceMismatch, TokenExpired
from .models import AttestationResult, Evidence, b64url, key_hash, load_json, numeric_date, unb64url, utcnow
from .verifier import Verifier

log = logging.getLogger(__name__)
_BANNER = "INSECURE-DEV ATTESTATION in use: no hardware root of trust, evidence is self-asserted"


class InsecureDevAttester(Attester):
    format = "insecure-dev"

    def __init__(self, party: str, measurements: dict[str, str] | None = None, debug: bool = False,
                 lifetime_s: float = 300.0):
        super().__init__(party)
        self.measurements = measurements or {"measurement": "00" * 48}
        self.debug, self.lifetime_s = debug, lifetime_s

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        log.warning("%s (attester %r)", _BANNER, self.party)
        now = utcnow().timestamp()
        body = {"nonce": b64url(nonce), "key_hash": b64url(key_hash(public_key)), "measurements": self.measurements,
                "debug": self.debug, "iat": now, "exp": now + self.lifetime_s}
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=b64url(json.dumps(body).encode()))


class InsecureDevConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    allow_insecure_dev: bool = False
    clock_skew_s: float = Field(60.0, ge=0)


class InsecureDevVerifier(Verifier):
    name: ClassVar[str] = "insecure-dev"
    insecure: ClassVar[bool] = True
    config_model: ClassVar[type[BaseModel]] = InsecureDevConfig
    config: InsecureDevConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        if not self.config.allow_insecure_dev:
            raise InsecureVerifierRefused("insecure-dev verifier needs allow_insecure_dev=True in its config")
        log.warning(_BANNER)

    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult:
        log.warning("%s (verifying %r)", _BANNER, evidence.attester)
        now = now or utcnow()
        try:
            body = load_json(unb64url(evidence.payload), "insecure-dev evidence")
            if not isinstance(body, dict):
                raise TypeError("evidence is not a JSON object")
            exp, iat = numeric_date(body["exp"], "exp"), numeric_date(body["iat"], "iat")
            measurements = {str(k): str(v).lower() for k, v in dict(body["measurements"]).items()}
            khash = key_hash(evidence.public_key_bytes())
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedEvidence(f"bad insecure-dev evidence: {exc!r:.200}") from exc
        if body.get("nonce") != b64url(nonce) or evidence.nonce != b64url(nonce):
            raise NonceMismatch("insecure-dev evidence answers another challenge")
        if body.get("key_hash") != b64url(khash):
            raise KeyBindingMismatch("insecure-dev evidence binds another key")
        if now > exp + dt.timedelta(seconds=self.config.clock_skew_s):
            raise TokenExpired(f"expired at {exp.isoformat()}")
        return AttestationResult(verifier=self.name, attester=evidence.attester, nonce=b64url(nonce),
                                 key_hash=b64url(khash), measurements=measurements, debug=bool(body.get("debug")),
                                 issued_at=iat, expires_at=exp, insecure=True, claims=body)
