"""Manifests: the JSON that says who a bundle belongs to and which public keys it trusts.

The coordinator's site registry is signed by the federation CA, so a coordinator that pins the
CA fingerprint detects a registry edited behind its back.
"""

from __future__ import annotations

import base64
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, x25519
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import PkiMaterialError
from .keys import canonical_json

MANIFEST = "manifest.json"
REGISTRY = "registry.json"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SiteRecord(_Model):
    """What the coordinator knows about a site (public material only)."""

    name: str
    client_cert_serial: str  # hex, matches CRL entries
    client_cert_fingerprint: str
    sign_ed25519: str  # base64 raw public key: verifies update signatures
    supernode_auth_openssh: str  # for `flwr supernode register`
    supernode_auth_fingerprint: str
    issued_at: str
    # base64 raw X25519 public key: the long-term key SecAgg+ share envelopes are sealed with
    # (crypto/secagg/plan.py); None in bundles made before it existed (re-run provisioning)
    channel_x25519: str | None = None

    def signing_public_key(self) -> ed25519.Ed25519PublicKey:
        return ed25519.Ed25519PublicKey.from_public_bytes(unb64(self.sign_ed25519))

    def channel_public_key(self) -> x25519.X25519PublicKey | None:
        return None if self.channel_x25519 is None else x25519.X25519PublicKey.from_public_bytes(unb64(self.channel_x25519))


class CoordinatorRecord(_Model):
    """What a site knows about the coordinator."""

    name: str
    hosts: list[str]
    server_cert_serial: str
    server_cert_fingerprint: str
    seal_x25519: str  # base64 raw public key: sites seal updates to it
    sign_ed25519: str  # base64 raw public key: verifies coordinator-signed messages
    issued_at: str

    def sealing_public_key(self) -> x25519.X25519PublicKey:
        return x25519.X25519PublicKey.from_public_bytes(unb64(self.seal_x25519))

    def signing_public_key(self) -> ed25519.Ed25519PublicKey:
        return ed25519.Ed25519PublicKey.from_public_bytes(unb64(self.sign_ed25519))


class BundleManifest(_Model):
    """``manifest.json`` of one bundle (NVFlare-style startup kit)."""

    party: str
    role: Literal["ca", "coordinator", "site"]
    federation_id: str
    ca_fingerprint: str
    created_at: str
    files: dict[str, str]  # logical name -> file name in the bundle
    fingerprints: dict[str, str]
    coordinator: CoordinatorRecord | None = None  # site bundles
    site: SiteRecord | None = None  # site bundles: its own public record
    sites: dict[str, SiteRecord] | None = None  # coordinator bundle: all sites


class RegistryBody(_Model):
    federation_id: str
    ca_fingerprint: str
    issued_at: str
    coordinator: CoordinatorRecord
    sites: dict[str, SiteRecord]

    def signed_bytes(self) -> bytes:
        """What the CA signs: the canonical JSON of the body, where a site without a channel key
        has no `channel_x25519` member at all, so registries signed before that field existed
        still verify (they are refreshed by re-running provisioning)."""
        doc = self.model_dump(mode="json")
        for rec in doc["sites"].values():
            if rec.get("channel_x25519") is None:
                rec.pop("channel_x25519", None)
        return canonical_json(doc)


class SignedRegistry(_Model):
    body: RegistryBody
    signature: str  # base64 ECDSA-SHA256 (DER) by the CA key over canonical JSON of body

    @classmethod
    def sign(cls, body: RegistryBody, ca_key: ec.EllipticCurvePrivateKey) -> "SignedRegistry":
        sig = ca_key.sign(body.signed_bytes(), ec.ECDSA(hashes.SHA256()))
        return cls(body=body, signature=b64(sig))

    def verify(self, ca_cert: x509.Certificate) -> RegistryBody:
        key = ca_cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise PkiMaterialError("bad_registry_signature", "the federation CA key is not an EC key")
        try:
            key.verify(unb64(self.signature), self.body.signed_bytes(), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError) as exc:  # ValueError: signature not base64
            raise PkiMaterialError("bad_registry_signature",
                                   "site registry signature does not verify against the federation CA") from exc
        return self.body


def _parse(model: type[_Model], data: bytes | str, reason: str, what: str) -> _Model:
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in err.errors()[:5])
        raise PkiMaterialError(reason, f"{what} does not parse ({err.error_count()} problem(s)): {problems}") from None


def parse_manifest(data: bytes | str, what: str = MANIFEST) -> BundleManifest:
    """A bundle manifest from its JSON, or PkiMaterialError("malformed_manifest")."""
    return _parse(BundleManifest, data, "malformed_manifest", what)  # type: ignore[return-value]


def parse_signed_registry(data: bytes | str, ca_cert: x509.Certificate, what: str = REGISTRY) -> RegistryBody:
    """The body of a CA-signed site registry, once its signature verified; else PkiMaterialError."""
    signed = _parse(SignedRegistry, data, "malformed_registry", what)
    return signed.verify(ca_cert)  # type: ignore[attr-defined]
