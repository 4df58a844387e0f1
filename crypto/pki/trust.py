"""Trust stores and bundle loaders: who is known, who is revoked, and which keys they hold.

A coordinator loads its bundle to learn every site's Ed25519 update key; a site loads its bundle
to learn the coordinator's sealing and signing keys and, from its copy of the CA-signed site
registry, its peers' signing keys (SecAgg+ sites check the keys their neighbours advertise).
Both consult the CA-signed CRL.
"""

from __future__ import annotations

import logging
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

from .errors import PkiMaterialError
from .keys import cert_fingerprint, load_cert, load_private, parse_cert
from .manifest import MANIFEST, REGISTRY, BundleManifest, parse_manifest, parse_signed_registry
from .revocation import CRL_FILE, parse_verified_crl

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PartyRecord:
    """A known party and the public keys that authenticate it."""

    name: str
    role: Literal["coordinator", "site"]
    sign_public: ed25519.Ed25519PublicKey
    cert_serial: int | None = None
    seal_public: x25519.X25519PublicKey | None = None
    revoked: bool = False
    channel_public: x25519.X25519PublicKey | None = None  # a site's SecAgg+ channel key


@dataclass
class TrustStore:
    """Answers: is this party known and not revoked, and what is its Ed25519 public key?"""

    federation_id: str
    parties: dict[str, PartyRecord]
    revoked_serials: frozenset[int] = frozenset()
    revoked_names: set[str] = field(default_factory=set)  # revocations known outside a CRL

    def lookup(self, name: str) -> PartyRecord | None:
        """The record (with ``revoked`` computed) or None if the party is unknown."""
        rec = self.parties.get(name)
        if rec is None:
            return None
        revoked = name in self.revoked_names or (rec.cert_serial is not None and rec.cert_serial in self.revoked_serials)
        if revoked != rec.revoked:
            rec = PartyRecord(rec.name, rec.role, rec.sign_public, rec.cert_serial, rec.seal_public, revoked,
                              rec.channel_public)
        return rec

    def is_trusted(self, name: str) -> bool:
        rec = self.lookup(name)
        return rec is not None and not rec.revoked

    def signing_key(self, name: str) -> ed25519.Ed25519PublicKey:
        rec = self.lookup(name)
        if rec is None:
            raise LookupError(f"unknown party {name!r}")
        if rec.revoked:
            raise PermissionError(f"party {name!r} is revoked")
        return rec.sign_public

    def revoke(self, name: str) -> None:
        """Revoke in memory (e.g. after a CRL push), effective for the next lookup."""
        self.revoked_names.add(name)

    @property
    def sites(self) -> list[str]:
        return sorted(n for n, r in self.parties.items() if r.role == "site")

    @classmethod
    def load(cls, bundle_dir: str | Path, *, ca_fingerprint: str | None = None) -> "TrustStore":
        """Load from a coordinator bundle (all sites) or a site bundle (the coordinator).

        ``ca_fingerprint`` pins the CA ("sha256:<hex>"), distributed out of band.
        """
        d = Path(bundle_dir)

        def read(name: str) -> bytes | None:
            try:
                return (d / name).read_bytes()
            except FileNotFoundError:
                return None

        return cls.from_files(read, ca_fingerprint=ca_fingerprint, source=str(d))

    @classmethod
    def from_files(cls, read: Callable[[str], bytes | None], *, ca_fingerprint: str | None = None,
                   source: str = "bundle") -> "TrustStore":
        """The trust store of a bundle whose files ``read(name)`` returns (None: absent).

        Everything in a bundle is checked before it is believed: the CA against the manifest's (and
        the pinned) fingerprint, the CRL and the site registry against the CA's signature. Damaged
        or forged material raises :class:`PkiMaterialError` with a reason.
        """

        def need(name: str) -> bytes:
            data = read(name)
            if data is None:
                raise PkiMaterialError("missing_file", f"{source} has no {name}")
            return data

        manifest = parse_manifest(need(MANIFEST), f"{source}/{MANIFEST}")
        ca_cert = parse_cert(need("ca.crt"), f"{source}/ca.crt")
        fp = cert_fingerprint(ca_cert)
        if fp != manifest.ca_fingerprint or (ca_fingerprint is not None and fp != ca_fingerprint):
            raise PkiMaterialError("ca_mismatch", f"CA certificate in {source} does not match the pinned fingerprint")
        crl = parse_verified_crl(need(CRL_FILE), ca_cert, f"CRL {source}/{CRL_FILE}")
        if crl.next_update_utc is not None and crl.next_update_utc < dt.datetime.now(dt.timezone.utc):
            log.warning("CRL in %s is past its next_update (%s): re-run revoke/provision to refresh", source,
                        crl.next_update_utc)
        revoked = frozenset(rc.serial_number for rc in crl)
        parties: dict[str, PartyRecord] = {}
        if manifest.role not in ("coordinator", "site"):
            raise PkiMaterialError("malformed_manifest",
                                   f"{source} is a {manifest.role} bundle; load a coordinator or site bundle")
        registry = read(REGISTRY)
        if manifest.role == "coordinator" or registry is not None:  # site bundles: peers' keys (SecAgg)
            body = parse_signed_registry(need(REGISTRY), ca_cert, f"{source}/{REGISTRY}")
            if body.federation_id != manifest.federation_id:
                raise PkiMaterialError("wrong_federation", "registry belongs to another federation")
            for name, s in body.sites.items():
                parties[name] = PartyRecord(name, "site", _key(s.signing_public_key, source, name),
                                            _serial(s.client_cert_serial, source, name),
                                            channel_public=_key(s.channel_public_key, source, name))
        if manifest.role == "site":
            c = manifest.coordinator
            if c is None or manifest.site is None:
                raise PkiMaterialError("malformed_manifest", f"site bundle {source} names no coordinator or site")
            parties[c.name] = PartyRecord(c.name, "coordinator", _key(c.signing_public_key, source, c.name),
                                          _serial(c.server_cert_serial, source, c.name),
                                          _key(c.sealing_public_key, source, c.name))
        return cls(manifest.federation_id, parties, revoked)


def _key(load: Callable[[], T], source: str, party: str) -> T:
    try:
        return load()
    except ValueError as exc:  # not base64, or not a 32-byte key
        raise PkiMaterialError("malformed_key", f"{source}: public key of {party!r} is unusable ({exc})") from None


def _serial(text: str, source: str, party: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        raise PkiMaterialError("malformed_registry", f"{source}: certificate serial of {party!r} is not hex") from None


@dataclass(frozen=True)
class SiteBundle:
    """A site's own keys plus what it needs to reach the coordinator."""

    dir: Path
    name: str
    federation_id: str
    sign_key: ed25519.Ed25519PrivateKey
    coordinator_name: str
    coordinator_seal_public: x25519.X25519PublicKey
    coordinator_sign_public: ed25519.Ed25519PublicKey
    ca_cert: Path
    tls_cert: Path
    tls_key: Path
    supernode_auth_key: Path
    supernode_auth_pub: Path
    channel_key: x25519.X25519PrivateKey | None = None  # SecAgg+ share channel (None: an older bundle)

    @classmethod
    def load(cls, bundle_dir: str | Path) -> "SiteBundle":
        d = Path(bundle_dir)
        m = BundleManifest.model_validate_json((d / MANIFEST).read_text())
        if m.role != "site" or m.coordinator is None:
            raise ValueError(f"{d} is not a site bundle")
        key = load_private(d / m.files["sign_key"])
        assert isinstance(key, ed25519.Ed25519PrivateKey)
        channel = load_private(d / m.files["channel_key"]) if "channel_key" in m.files else None
        assert channel is None or isinstance(channel, x25519.X25519PrivateKey)
        return cls(d, m.party, m.federation_id, key, m.coordinator.name, m.coordinator.sealing_public_key(),
                   m.coordinator.signing_public_key(), d / m.files["ca_cert"], d / m.files["tls_cert"],
                   d / m.files["tls_key"], d / m.files["supernode_auth_key"], d / m.files["supernode_auth_pub"],
                   channel)

    def trust(self) -> TrustStore:
        return TrustStore.load(self.dir)


@dataclass(frozen=True)
class CoordinatorBundle:
    """The coordinator's private keys, TLS files and its trust store of sites."""

    dir: Path
    name: str
    federation_id: str
    seal_key: x25519.X25519PrivateKey
    sign_key: ed25519.Ed25519PrivateKey
    ca_cert: Path
    tls_cert: Path
    tls_key: Path

    @classmethod
    def load(cls, bundle_dir: str | Path) -> "CoordinatorBundle":
        d = Path(bundle_dir)
        m = BundleManifest.model_validate_json((d / MANIFEST).read_text())
        if m.role != "coordinator":
            raise ValueError(f"{d} is not a coordinator bundle")
        seal, sign = load_private(d / m.files["seal_key"]), load_private(d / m.files["sign_key"])
        assert isinstance(seal, x25519.X25519PrivateKey) and isinstance(sign, ed25519.Ed25519PrivateKey)
        return cls(d, m.party, m.federation_id, seal, sign, d / m.files["ca_cert"], d / m.files["tls_cert"],
                   d / m.files["tls_key"])

    def trust(self) -> TrustStore:
        return TrustStore.load(self.dir)

    def supernode_public_keys(self) -> dict[str, str]:
        """site -> OpenSSH public key line, for `flwr supernode register`."""
        m = BundleManifest.model_validate_json((self.dir / MANIFEST).read_text())
        return {n: s.supernode_auth_openssh for n, s in (m.sites or {}).items()}


def verify_bundle_certificate(cert_path: Path, ca_path: Path) -> x509.Certificate:
    """Load a certificate and check its chain with cryptography's verifier (client or server)."""
    from . import certs

    cert, ca = load_cert(cert_path), load_cert(ca_path)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    if x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in eku:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(v) for v in san.get_values_for_type(x509.IPAddress)] + san.get_values_for_type(x509.DNSName)
        certs.verify_server_cert(cert, ca, hosts[0])
    else:
        certs.verify_client_cert(cert, ca)
    return cert
