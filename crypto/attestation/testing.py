"""A local attestation-token issuer for tests and demos: a generated key, its JWKS, and tokens
shaped like an attestation service's (EAT claims). Not a root of trust."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from .attester import Attester
from .jose import public_jwk, sign_jws
from .models import Evidence, b64url, binding, key_hash

log = logging.getLogger(__name__)
GOOD_MEASUREMENT = "a1" * 48  # a made-up 384-bit launch measurement


def _new_key(alg: str) -> Any:
    if alg.startswith("ES"):
        curve = {"ES256": ec.SECP256R1, "ES384": ec.SECP384R1, "ES512": ec.SECP521R1}[alg]()
        return ec.generate_private_key(curve)
    if alg.startswith(("RS", "PS")):
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return ed25519.Ed25519PrivateKey.generate()


class LocalTokenIssuer:
    """Mints signed EAT-style JWTs; ``jwks()`` is what a verifier config trusts."""

    def __init__(self, issuer: str = "https://attestation.test", alg: str = "ES256", kid: str = "test-key-1",
                 audience: str = "sovereign-fl"):
        self.issuer, self.alg, self.kid, self.audience = issuer, alg, kid, audience
        self.key = _new_key(alg)

    def save(self, directory: str | Path) -> Path:
        """Write the issuer's key (0600), its settings and its JWKS, for other processes to use."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        key = d / "issuer_key.pem"
        key.touch(mode=0o600)
        key.write_bytes(self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        (d / "issuer.json").write_text(json.dumps({"issuer": self.issuer, "alg": self.alg, "kid": self.kid,
                                                   "audience": self.audience}))
        (d / "jwks.json").write_text(json.dumps(self.jwks()))
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "LocalTokenIssuer":
        d = Path(directory)
        try:
            meta = json.loads((d / "issuer.json").read_text())
            key = serialization.load_pem_private_key((d / "issuer_key.pem").read_bytes(), None)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{d} is not a saved LocalTokenIssuer ({exc}); create one with LocalTokenIssuer().save(dir)") from None
        issuer = cls(meta["issuer"], meta["alg"], meta["kid"], meta["audience"])
        issuer.key = key
        return issuer

    def jwks(self) -> dict[str, Any]:
        return {"keys": [public_jwk(self.key, self.kid, self.alg)]}

    def verifier_config(self, **overrides: Any) -> dict[str, Any]:
        return {"jwks": self.jwks(), "issuer": self.issuer, "audience": self.audience, **overrides}

    def mint(self, *, nonce: bytes, public_key: bytes, measurement: str = GOOD_MEASUREMENT, debug: bool = False,
             lifetime_s: float = 300.0, iat: float | None = None, extra: dict[str, Any] | None = None,
             signing_key: Any = None, kid: str | None = None) -> str:
        iat = time.time() if iat is None else iat
        claims = {"iss": self.issuer, "aud": self.audience, "iat": int(iat), "nbf": int(iat),
                  "exp": int(iat + lifetime_s), "eat_nonce": b64url(nonce), "sovfl_key_hash": b64url(key_hash(public_key)),
                  "measurement": measurement, "dbgstat": "enabled" if debug else "disabled-since-boot",
                  "eat_profile": "tag:sovereign-fl,2025:test-issuer"}
        claims.update(extra or {})
        return sign_jws(claims, signing_key or self.key, self.alg, kid or self.kid)


class LocalTokenAttester(Attester):
    """Attester whose "TEE" is the local issuer: for end-to-end tests of the admission flow."""

    format = "eat-jwt"

    def __init__(self, party: str, issuer: LocalTokenIssuer, **mint_kwargs: Any):
        super().__init__(party)
        self.issuer, self.mint_kwargs = issuer, mint_kwargs

    @classmethod
    def from_config(cls, party: str, config: Mapping[str, Any]) -> "LocalTokenAttester":
        """``issuer_dir`` names a saved issuer; the rest (measurement, debug, lifetime_s) shapes its tokens."""
        opts = dict(config)
        if "issuer_dir" not in opts:
            raise TypeError("local-token needs issuer_dir (a directory written by LocalTokenIssuer.save)")
        unknown = set(opts) - {"issuer_dir", "measurement", "debug", "lifetime_s"}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; local-token takes issuer_dir, measurement, debug, "
                            "lifetime_s")
        log.warning("local-token attester for %r: tokens come from a local TEST issuer, not from a TEE", party)
        return cls(party, LocalTokenIssuer.load(opts.pop("issuer_dir")), **opts)

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        token = self.issuer.mint(nonce=nonce, public_key=public_key, **self.mint_kwargs)
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=token)


class NrasTestIssuer:
    """Mints results in NRAS's shape (overall token + detached GPU tokens, ES384) under a TEST key, for
    tests of the ``nvidia-nras`` verifier; ``jwks()`` is what such a verifier pins. Not NVIDIA's."""

    def __init__(self, issuer: str = "https://nras.attestation.test", kid: str = "nras-test-1"):
        self.issuer, self.kid = issuer, kid
        self.key = ec.generate_private_key(ec.SECP384R1())

    def jwks(self) -> dict[str, Any]:
        return {"keys": [public_jwk(self.key, self.kid, "ES384")]}

    def verifier_config(self, **overrides: Any) -> dict[str, Any]:
        return {"jwks": self.jwks(), "issuer": self.issuer, **overrides}

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        key = d / "nras_key.pem"
        key.touch(mode=0o600)
        key.write_bytes(self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        (d / "nras.json").write_text(json.dumps({"issuer": self.issuer, "kid": self.kid}))
        (d / "nras_jwks.json").write_text(json.dumps(self.jwks()))
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "NrasTestIssuer":
        d = Path(directory)
        meta = json.loads((d / "nras.json").read_text())
        out = cls(meta["issuer"], meta["kid"])
        out.key = serialization.load_pem_private_key((d / "nras_key.pem").read_bytes(), None)
        return out

    def sign(self, claims: Mapping[str, Any], key: Any = None, kid: str | None = None, alg: str = "ES384") -> str:
        return sign_jws(claims, key or self.key, alg, kid or self.kid)

    def gpu_claims(self, nonce_hex: str, *, debug: bool = False, iat: float | None = None,
                   lifetime_s: float = 300.0) -> dict[str, Any]:
        from .nvidia_nras import DEFAULT_DETACHED_CLAIMS
        iat = int(time.time() if iat is None else iat)
        return {**DEFAULT_DETACHED_CLAIMS, "iss": self.issuer, "iat": iat, "nbf": iat, "exp": int(iat + lifetime_s),
                "eat_nonce": nonce_hex, "measres": "success", "secboot": True,
                "dbgstat": "enabled" if debug else "disabled", "hwmodel": "GH100 A01 GSP BROM",
                "x-nvidia-gpu-driver-version": "570.00", "x-nvidia-gpu-vbios-version": "96.00.9F.00.01"}

    def result(self, detached: Mapping[str, Mapping[str, Any] | str], overall: Mapping[str, Any] | None = None,
               *, nonce_hex: str | None = None) -> str:
        """The NRAS response JSON for these GPU claim sets (or already signed tokens)."""
        tokens = {g: c if isinstance(c, str) else self.sign(c) for g, c in detached.items()}
        first = next((c for c in detached.values() if not isinstance(c, str)), {})
        base = {"iss": self.issuer, "iat": first.get("iat", int(time.time())), "nbf": first.get("nbf", int(time.time())),
                "exp": first.get("exp", int(time.time()) + 300), "eat_nonce": nonce_hex or first.get("eat_nonce"),
                "x-nvidia-overall-att-result": True, "x-nvidia-ver": "3.0", "sub": "NVIDIA-PLATFORM-ATTESTATION"}
        claims = {**base, **(overall or {})}
        claims.setdefault("submods", {g: ["DIGEST", ["SHA-256", hashlib.sha256(t.encode()).hexdigest()]]
                                      for g, t in tokens.items()})
        return json.dumps([["JWT", self.sign(claims)], tokens])


class NrasTestAttester(Attester):
    """Attester whose "GPUs" are a saved :class:`NrasTestIssuer` (``issuer_dir``): end-to-end tests only."""

    format = "nvidia-nras"

    def __init__(self, party: str, issuer_dir: str, gpus: int = 1, debug: bool = False):
        super().__init__(party)
        self.issuer, self.gpus, self.debug = NrasTestIssuer.load(issuer_dir), gpus, debug
        log.warning("nras-test attester for %r: GPU tokens come from a local TEST issuer, not from NRAS", party)

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        n = binding(nonce, public_key).hex()
        payload = self.issuer.result({f"GPU-{i}": self.issuer.gpu_claims(n, debug=self.debug) for i in range(self.gpus)})
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=payload)
