"""Provisioning: one bundle per party, like NVFlare startup kits.

    out_dir/ca/                  offline material: CA key and certificate, CRL
    out_dir/coordinator/         TLS server cert+key, X25519 sealing key, Ed25519 signing key,
                                 CA-signed site registry, CRL
    out_dir/sites/<name>/        TLS client cert+key, Flower SuperNode auth key (OpenSSH),
                                 Ed25519 update-signing key, X25519 SecAgg+ channel key, the
                                 coordinator's public keys, a copy of the CA-signed site
                                 registry (to check peers' keys)
    out_dir/retired/             bundles replaced by an explicit rotation (never deleted)

Re-running is idempotent: existing bundles are kept and reported, new sites are issued from the
existing CA, and nothing is replaced unless its party is named in ``rotate`` (a site bundle made
before SecAgg+ channel keys existed gets one added, and is reported as refreshed). Each bundle is
built in a temporary directory and renamed into place, so a crash leaves no half bundle.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import BaseModel, Field

from crypto.durable import write_atomic

from . import certs
from .keys import (
    PEM, cert_fingerprint, load_cert, load_private, new_channel_key, new_sealing_key, new_signing_key,
    new_supernode_auth_key,
    new_tls_key, openssh_private, openssh_public, private_pem, public_key_fingerprint, public_pem, raw_public,
    write_json, write_private, write_public,
)
from .manifest import (
    MANIFEST, REGISTRY, BundleManifest, CoordinatorRecord, RegistryBody, SignedRegistry, SiteRecord, b64,
)
from .revocation import CRL_FILE, Revoked, build_crl, crl_entries, crl_number, crl_pem, load_verified_crl

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")

# File names inside bundles (also recorded in each manifest under "files").
CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.crt", "client.key"
SEAL_KEY, SEAL_PUB = "seal_x25519.key", "seal_x25519.pub"
SIGN_KEY, SIGN_PUB = "sign_ed25519.key", "sign_ed25519.pub"
AUTH_KEY, AUTH_PUB = "supernode_auth.key", "supernode_auth.pub"
COORD_SEAL_PUB, COORD_SIGN_PUB = "coordinator_seal_x25519.pub", "coordinator_sign_ed25519.pub"
CHANNEL_KEY, CHANNEL_PUB = "channel_x25519.key", "channel_x25519.pub"


class ProvisionReport(BaseModel):
    """What a provisioning run did; parties are "ca", "coordinator" or "site:<name>"."""

    out_dir: str
    federation_id: str
    created: list[str] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list)
    rotated: list[str] = Field(default_factory=list)
    refreshed: list[str] = Field(default_factory=list)  # public files updated (new coordinator keys)
    warnings: list[str] = Field(default_factory=list)


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def _serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"invalid party name {name!r}: lowercase letters, digits, '.', '_' or '-', at most 63")
    return name


class _CA:
    def __init__(self, root: Path):
        self.dir = root / "ca"
        self.cert = load_cert(self.dir / CA_CERT)
        key = load_private(self.dir / CA_KEY)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self.key = key
        self.manifest = BundleManifest.model_validate_json((self.dir / MANIFEST).read_text())
        self.federation_id = self.manifest.federation_id
        self.fingerprint = cert_fingerprint(self.cert)
        self.cert_pem = (self.dir / CA_CERT).read_bytes()


def _staging(parent: Path, name: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".staging-{name}-"))


def _commit(staging: Path, final: Path) -> None:
    os.rename(staging, final)  # atomic on one filesystem; fails if `final` exists


def _retire(root: Path, bundle: Path, label: str) -> Path:
    dest = root / "retired" / f"{label}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%fZ}"
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.rename(bundle, dest)
    return dest


def _create_ca(root: Path, federation_id: str, days: int, crl_days: int) -> None:
    staging = _staging(root, "ca")
    try:
        key = new_tls_key()
        cert = certs.make_ca(key, federation_id, days)
        write_private(staging / CA_KEY, private_pem(key))
        write_public(staging / CA_CERT, cert.public_bytes(PEM))
        write_public(staging / CRL_FILE, crl_pem(build_crl(cert, key, [], number=1, days=crl_days)))
        write_json(staging / MANIFEST, BundleManifest(
            party="ca", role="ca", federation_id=federation_id, ca_fingerprint=cert_fingerprint(cert),
            created_at=_now_iso(), files={"ca_cert": CA_CERT, "ca_key": CA_KEY, "crl": CRL_FILE},
            fingerprints={"ca_cert": cert_fingerprint(cert)},
        ).model_dump(mode="json", exclude_none=True))
        _commit(staging, root / "ca")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _create_coordinator(root: Path, ca: _CA, name: str, hosts: Sequence[str], days: int) -> None:
    staging = _staging(root, "coordinator")
    try:
        tls_key, seal_key, sign_key = new_tls_key(), new_sealing_key(), new_signing_key()
        cert = certs.make_server_cert(ca.cert, ca.key, tls_key.public_key(), federation_id=ca.federation_id,
                                      name=name, hosts=hosts, days=days)
        write_public(staging / CA_CERT, ca.cert_pem)
        write_public(staging / SERVER_CERT, cert.public_bytes(PEM))
        write_private(staging / SERVER_KEY, private_pem(tls_key))
        write_private(staging / SEAL_KEY, private_pem(seal_key))
        write_public(staging / SEAL_PUB, public_pem(seal_key.public_key()))
        write_private(staging / SIGN_KEY, private_pem(sign_key))
        write_public(staging / SIGN_PUB, public_pem(sign_key.public_key()))
        record = CoordinatorRecord(
            name=name, hosts=list(hosts), server_cert_serial=_serial_hex(cert),
            server_cert_fingerprint=cert_fingerprint(cert), seal_x25519=b64(raw_public(seal_key.public_key())),
            sign_ed25519=b64(raw_public(sign_key.public_key())), issued_at=_now_iso(),
        )
        write_json(staging / "coordinator.json", record.model_dump(mode="json"))
        _commit(staging, root / "coordinator")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _coordinator_record(root: Path) -> CoordinatorRecord:
    return CoordinatorRecord.model_validate_json((root / "coordinator" / "coordinator.json").read_text())


def _create_site(root: Path, ca: _CA, site: str, days: int) -> None:
    staging = _staging(root / "sites", site)
    try:
        tls_key, auth_key, sign_key = new_tls_key(), new_supernode_auth_key(), new_signing_key()
        cert = certs.make_client_cert(ca.cert, ca.key, tls_key.public_key(), federation_id=ca.federation_id,
                                      site=site, days=days)
        auth_pub = openssh_public(auth_key.public_key(), comment=f"sovfl-{site}")
        write_public(staging / CA_CERT, ca.cert_pem)
        write_public(staging / CLIENT_CERT, cert.public_bytes(PEM))
        write_private(staging / CLIENT_KEY, private_pem(tls_key))
        write_private(staging / AUTH_KEY, openssh_private(auth_key))
        write_public(staging / AUTH_PUB, auth_pub)
        write_private(staging / SIGN_KEY, private_pem(sign_key))
        write_public(staging / SIGN_PUB, public_pem(sign_key.public_key()))
        record = SiteRecord(
            name=site, client_cert_serial=_serial_hex(cert), client_cert_fingerprint=cert_fingerprint(cert),
            sign_ed25519=b64(raw_public(sign_key.public_key())), supernode_auth_openssh=auth_pub.decode().strip(),
            supernode_auth_fingerprint=public_key_fingerprint(auth_key.public_key()), issued_at=_now_iso(),
        )
        record = _write_channel_key(staging, record)
        write_json(staging / "site.json", record.model_dump(mode="json"))
        _commit(staging, root / "sites" / site)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_channel_key(bundle: Path, record: SiteRecord) -> SiteRecord:
    """A fresh SecAgg+ channel key into `bundle`; the site record that names its public half."""
    key = new_channel_key()
    write_private(bundle / CHANNEL_KEY, private_pem(key))
    write_public(bundle / CHANNEL_PUB, public_pem(key.public_key()))
    return record.model_copy(update={"channel_x25519": b64(raw_public(key.public_key()))})


def _add_missing_channel_key(root: Path, site: str) -> bool:
    """Give a site bundle made before channel keys existed its channel key; whether it had none."""
    rec = _site_record(root, site)
    if rec.channel_x25519 is not None:
        return False
    d = root / "sites" / site
    write_json(d / "site.json", _write_channel_key(d, rec).model_dump(mode="json"))
    return True


def _site_record(root: Path, site: str) -> SiteRecord:
    return SiteRecord.model_validate_json((root / "sites" / site / "site.json").read_text())


def existing_sites(root: Path) -> list[str]:
    base = Path(root) / "sites"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "site.json").exists())


def _copy_public(src: Path, dst: Path) -> None:
    write_atomic(dst, src.read_bytes(), 0o644)


def _write_site_public(root: Path, ca: _CA, site: str, coord: CoordinatorRecord) -> None:
    """(Re)write the public parts of a site bundle: coordinator keys, CRL, site registry, manifest."""
    d = root / "sites" / site
    rec = _site_record(root, site)
    write_public(d / COORD_SEAL_PUB, public_pem(coord.sealing_public_key()))
    write_public(d / COORD_SIGN_PUB, public_pem(coord.signing_public_key()))
    _copy_public(ca.dir / CRL_FILE, d / CRL_FILE)
    _copy_public(root / "coordinator" / REGISTRY, d / REGISTRY)
    write_json(d / MANIFEST, BundleManifest(
        party=site, role="site", federation_id=ca.federation_id, ca_fingerprint=ca.fingerprint,
        created_at=rec.issued_at,
        files={"ca_cert": CA_CERT, "tls_cert": CLIENT_CERT, "tls_key": CLIENT_KEY, "supernode_auth_key": AUTH_KEY,
               "supernode_auth_pub": AUTH_PUB, "sign_key": SIGN_KEY, "sign_pub": SIGN_PUB,
               "channel_key": CHANNEL_KEY, "channel_pub": CHANNEL_PUB,
               "coordinator_seal_pub": COORD_SEAL_PUB, "coordinator_sign_pub": COORD_SIGN_PUB, "crl": CRL_FILE,
               "registry": REGISTRY},
        fingerprints={"ca_cert": ca.fingerprint, "tls_cert": rec.client_cert_fingerprint,
                      "supernode_auth": rec.supernode_auth_fingerprint,
                      "coordinator_server_cert": coord.server_cert_fingerprint},
        coordinator=coord, site=rec,
    ).model_dump(mode="json", exclude_none=True))


def write_registry(root: Path, ca: _CA) -> None:
    """Rewrite the coordinator's CA-signed site registry, manifest and CRL copy."""
    d = root / "coordinator"
    coord = _coordinator_record(root)
    sites = {s: _site_record(root, s) for s in existing_sites(root)}
    body = RegistryBody(federation_id=ca.federation_id, ca_fingerprint=ca.fingerprint, issued_at=_now_iso(),
                        coordinator=coord, sites=sites)
    write_json(d / REGISTRY, SignedRegistry.sign(body, ca.key).model_dump(mode="json"))
    _copy_public(ca.dir / CRL_FILE, d / CRL_FILE)
    write_json(d / MANIFEST, BundleManifest(
        party=coord.name, role="coordinator", federation_id=ca.federation_id, ca_fingerprint=ca.fingerprint,
        created_at=coord.issued_at,
        files={"ca_cert": CA_CERT, "tls_cert": SERVER_CERT, "tls_key": SERVER_KEY, "seal_key": SEAL_KEY,
               "seal_pub": SEAL_PUB, "sign_key": SIGN_KEY, "sign_pub": SIGN_PUB, "registry": REGISTRY, "crl": CRL_FILE},
        fingerprints={"ca_cert": ca.fingerprint, "tls_cert": coord.server_cert_fingerprint},
        sites=sites,
    ).model_dump(mode="json", exclude_none=True))


def _add_to_crl(ca: _CA, serials: Iterable[int], reason: x509.ReasonFlags, crl_days: int) -> None:
    crl = load_verified_crl(ca.dir / CRL_FILE, ca.cert)
    entries = crl_entries(crl)
    have = {e.serial for e in entries}
    now = dt.datetime.now(dt.timezone.utc)
    entries += [Revoked(s, now, reason) for s in serials if s not in have]
    new = build_crl(ca.cert, ca.key, entries, number=crl_number(crl) + 1, days=crl_days)
    write_public(ca.dir / CRL_FILE, crl_pem(new))


def provision(
    out_dir: str | os.PathLike[str],
    sites: Sequence[str],
    coordinator_name: str = "coordinator",
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    *,
    federation_id: str | None = None,
    rotate: Iterable[str] = (),
    ca_days: int = 3650,
    leaf_days: int = 365,
    crl_days: int = 365,
) -> ProvisionReport:
    """Create or extend a federation's bundles under ``out_dir``.

    ``rotate`` names parties ("coordinator" or site names) whose bundles are re-issued: the old
    bundle moves to ``retired/`` and its certificate is revoked. The CA itself is never rotated
    here; a new CA is a new federation (provision into a new directory).
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    sites = [check_name(s) for s in sites]
    if len(set(sites)) != len(sites):
        raise ValueError("duplicate site names")
    check_name(coordinator_name)
    if not hosts:
        raise ValueError("the coordinator certificate needs at least one host")
    rotate = set(rotate)
    if "ca" in rotate:
        raise ValueError("CA rotation means a new federation: provision into a new directory")
    unknown = rotate - {"coordinator", coordinator_name} - set(sites) - set(existing_sites(root))
    if unknown:
        raise ValueError(f"cannot rotate unknown parties: {sorted(unknown)}")

    report = ProvisionReport(out_dir=str(root), federation_id="")
    if (root / "ca").exists():
        ca = _CA(root)
        if federation_id is not None and federation_id != ca.federation_id:
            raise ValueError(f"{root} belongs to federation {ca.federation_id}, not {federation_id}")
        report.kept.append("ca")
    else:
        _create_ca(root, federation_id or uuid.uuid4().hex, ca_days, crl_days)
        ca = _CA(root)
        report.created.append("ca")
    report.federation_id = ca.federation_id

    coord_dir = root / "coordinator"
    coordinator_changed = False
    if coord_dir.exists() and ({"coordinator", coordinator_name} & rotate):
        old = _coordinator_record(root)
        _add_to_crl(ca, [int(old.server_cert_serial, 16)], x509.ReasonFlags.superseded, crl_days)
        _retire(root, coord_dir, "coordinator")
        _create_coordinator(root, ca, coordinator_name, hosts, leaf_days)
        report.rotated.append("coordinator")
        coordinator_changed = True
    elif coord_dir.exists():
        old = _coordinator_record(root)
        report.kept.append("coordinator")
        if old.name != coordinator_name or list(old.hosts) != list(hosts):
            report.warnings.append(
                f"coordinator bundle kept with name={old.name!r} hosts={old.hosts}; "
                f"pass rotate=['coordinator'] to re-issue for name={coordinator_name!r} hosts={list(hosts)}")
    else:
        _create_coordinator(root, ca, coordinator_name, hosts, leaf_days)
        report.created.append("coordinator")
        coordinator_changed = True

    touched: set[str] = set()
    for site in sorted(set(sites) | (rotate & set(existing_sites(root)))):
        sdir = root / "sites" / site
        if sdir.exists() and site in rotate:
            old_site = _site_record(root, site)
            _add_to_crl(ca, [int(old_site.client_cert_serial, 16)], x509.ReasonFlags.superseded, crl_days)
            _retire(root, sdir, f"site-{site}")
            _create_site(root, ca, site, leaf_days)
            report.rotated.append(f"site:{site}")
        elif sdir.exists():
            report.kept.append(f"site:{site}")
            if _add_missing_channel_key(root, site):  # an older bundle: re-published with its new key
                report.refreshed.append(f"site:{site}")
                touched.add(site)
            continue
        else:
            _create_site(root, ca, site, leaf_days)
            report.created.append(f"site:{site}")
        touched.add(site)

    write_registry(root, ca)
    coord = _coordinator_record(root)
    for site in existing_sites(root):  # every site's registry copy must know new or re-keyed sites
        if touched or coordinator_changed or report.rotated:
            _write_site_public(root, ca, site, coord)
            if site not in touched and f"site:{site}" not in report.refreshed:
                report.refreshed.append(f"site:{site}")
    return report


def revoke(
    out_dir: str | os.PathLike[str],
    site: str,
    *,
    reason: x509.ReasonFlags = x509.ReasonFlags.key_compromise,
    crl_days: int = 365,
) -> int:
    """Revoke a site's certificate (and with it its update-signing key in the TrustStore).

    Writes a new CA-signed CRL to ``ca/`` and copies it into every bundle; returns the serial.
    """
    root = Path(out_dir)
    ca = _CA(root)
    check_name(site)
    if site not in existing_sites(root):
        raise ValueError(f"unknown site {site!r}")
    serial = int(_site_record(root, site).client_cert_serial, 16)
    _add_to_crl(ca, [serial], reason, crl_days)
    write_registry(root, ca)
    coord = _coordinator_record(root)
    for s in existing_sites(root):
        _write_site_public(root, ca, s, coord)
    return serial
