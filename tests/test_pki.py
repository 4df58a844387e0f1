"""Provisioning bundles, certificate chains, key files, rotation and revocation."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import VerificationError

from crypto.envelope import ReplayGuard, RevokedSite, make_envelope, open_envelope
from crypto.pki import (
    CoordinatorBundle, KeyFileExists, SiteBundle, TrustStore, provision, revoke, verify_bundle_certificate,
    verify_client_cert, verify_server_cert,
)
from crypto.pki.keys import load_cert, write_private
from system_packages import OPENSSL, install, need_packages

SITES = ["site-a", "site-b"]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    report = provision(out, SITES)
    assert report.created == ["ca", "coordinator", "site:site-a", "site:site-b"]
    return out


def _copy(fed: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "fed"
    shutil.copytree(fed, dst)
    return dst


def test_layout_and_manifests(fed: Path) -> None:
    for d in [fed / "ca", fed / "coordinator", *(fed / "sites" / s for s in SITES)]:
        manifest = json.loads((d / "manifest.json").read_text())
        assert (d / "ca.crt").read_bytes() == (fed / "ca" / "ca.crt").read_bytes()
        for name in manifest["files"].values():
            assert (d / name).exists(), (d, name)
    coord = json.loads((fed / "coordinator" / "manifest.json").read_text())
    assert coord["role"] == "coordinator" and sorted(coord["sites"]) == SITES
    assert coord["sites"]["site-a"]["sign_ed25519"]
    site = json.loads((fed / "sites" / "site-a" / "manifest.json").read_text())
    coordinator = json.loads((fed / "coordinator" / "coordinator.json").read_text())
    assert site["coordinator"]["seal_x25519"] == coordinator["seal_x25519"]
    assert site["site"]["sign_ed25519"] == coord["sites"]["site-a"]["sign_ed25519"]


def test_private_keys_mode_0600(fed: Path) -> None:
    keys = list(fed.rglob("*.key"))
    assert len(keys) == 1 + 3 + 4 * len(SITES)  # sites: TLS, SuperNode auth, signing, SecAgg channel
    for p in keys:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for p in fed.rglob("*.crt"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_write_private_never_overwrites(tmp_path: Path) -> None:
    write_private(tmp_path / "k", b"one")
    with pytest.raises(KeyFileExists):
        write_private(tmp_path / "k", b"two")
    assert (tmp_path / "k").read_bytes() == b"one"


def test_chains_verify_with_cryptography(fed: Path) -> None:
    ca = load_cert(fed / "ca" / "ca.crt")
    server = load_cert(fed / "coordinator" / "server.crt")
    for host in ["127.0.0.1", "localhost"]:
        verify_server_cert(server, ca, host)
    with pytest.raises(VerificationError):
        verify_server_cert(server, ca, "evil.example")
    uris = verify_client_cert(load_cert(fed / "sites" / "site-a" / "client.crt"), ca)
    assert uris and uris[0].endswith("/site/site-a")
    other_ca = provision(fed.parent / "other", ["x"]).out_dir
    with pytest.raises(VerificationError):
        verify_server_cert(server, load_cert(Path(other_ca) / "ca" / "ca.crt"), "127.0.0.1")


def test_chains_verify_with_openssl(fed: Path) -> None:
    need_packages(OPENSSL)
    certs = [fed / "coordinator" / "server.crt", *(fed / "sites" / s / "client.crt" for s in SITES)]
    out = subprocess.run(["openssl", "verify", "-x509_strict", "-CAfile", str(fed / "ca" / "ca.crt"), *map(str, certs)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": OK") == len(certs)


def test_python_ssl_mutual_tls_handshake(fed: Path) -> None:
    """Python's ssl (what uvicorn uses) accepts the P-256 certificates, both directions."""
    c, s = fed / "coordinator", fed / "sites" / "site-a"
    srv = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(c / "ca.crt"))
    srv.load_cert_chain(c / "server.crt", c / "server.key")
    srv.verify_mode = ssl.CERT_REQUIRED
    cli = ssl.create_default_context(cafile=str(s / "ca.crt"))
    cli.load_cert_chain(s / "client.crt", s / "client.key")
    a, b = socket.socketpair()
    seen: dict = {}

    def serve() -> None:
        with srv.wrap_socket(a, server_side=True) as t:
            seen["peer"] = t.getpeercert()
            t.sendall(b"ok")

    th = threading.Thread(target=serve)
    th.start()
    with cli.wrap_socket(b, server_hostname="127.0.0.1") as t:
        assert t.recv(2) == b"ok"
    th.join(5)
    assert ("commonName", "site-a") in [x[0] for x in seen["peer"]["subject"]]


def test_supernode_auth_key_formats(fed: Path) -> None:
    """flower-supernode loads the private key with load_ssh_private_key (an EC key);
    `flwr supernode register` loads the public key with load_ssh_public_key (NIST EC curve)."""
    d = fed / "sites" / "site-a"
    priv = serialization.load_ssh_private_key((d / "supernode_auth.key").read_bytes(), None)
    pub = serialization.load_ssh_public_key((d / "supernode_auth.pub").read_bytes())
    assert isinstance(priv, ec.EllipticCurvePrivateKey) and isinstance(pub, ec.EllipticCurvePublicKey)
    assert priv.public_key().public_numbers() == pub.public_numbers()
    assert CoordinatorBundle.load(fed / "coordinator").supernode_public_keys()["site-a"].startswith("ecdsa-sha2-nistp384 ")


def test_rerun_keeps_and_extends(fed: Path, tmp_path: Path) -> None:
    out = _copy(fed, tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*.key")}
    report = provision(out, [*SITES, "site-c"])
    assert report.created == ["site:site-c"] and "site:site-a" in report.kept and "ca" in report.kept
    assert all(p.read_bytes() == b for p, b in before.items())
    ca = load_cert(out / "ca" / "ca.crt")
    verify_client_cert(load_cert(out / "sites" / "site-c" / "client.crt"), ca)  # issued by the same CA
    assert TrustStore.load(out / "coordinator").sites == [*SITES, "site-c"]
    # existing sites' registry copies learn the new site (SecAgg+ sites check their peers' keys)
    assert sorted(report.refreshed) == [f"site:{s}" for s in SITES]
    assert SiteBundle.load(out / "sites" / "site-a").trust().sites == [*SITES, "site-c"]
    with pytest.raises(ValueError):
        provision(out, SITES, federation_id="another-federation")


def test_rotate_site_retires_and_revokes(fed: Path, tmp_path: Path) -> None:
    out = _copy(fed, tmp_path)
    old_key = (out / "sites" / "site-a" / "sign_ed25519.key").read_bytes()
    old_serial = TrustStore.load(out / "coordinator").lookup("site-a").cert_serial  # type: ignore[union-attr]
    report = provision(out, SITES, rotate=["site-a"])
    assert report.rotated == ["site:site-a"]
    assert (out / "sites" / "site-a" / "sign_ed25519.key").read_bytes() != old_key
    assert any((r / "sign_ed25519.key").read_bytes() == old_key for r in (out / "retired").iterdir())
    trust = TrustStore.load(out / "coordinator")
    assert trust.is_trusted("site-a") and old_serial in trust.revoked_serials


def test_revoke_and_trust_store(fed: Path, tmp_path: Path) -> None:
    out = _copy(fed, tmp_path)
    site_b = SiteBundle.load(out / "sites" / "site-b")
    env = make_envelope(b"update", signing_key=site_b.sign_key, federation_id=site_b.federation_id, run_id=1,
                        round=1, site="site-b")
    trust = TrustStore.load(out / "coordinator")
    assert trust.is_trusted("site-b") and not trust.is_trusted("site-x")
    open_envelope(env, trust=trust, federation_id=site_b.federation_id)
    revoke(out, "site-b")
    trust = TrustStore.load(out / "coordinator")
    assert not trust.is_trusted("site-b") and trust.is_trusted("site-a")
    with pytest.raises(RevokedSite):
        open_envelope(env, trust=trust, federation_id=site_b.federation_id, replay=ReplayGuard())
    if install(OPENSSL) is None:  # the revocation as a third-party tool sees it, where it can be had
        r = subprocess.run(["openssl", "verify", "-crl_check", "-CAfile", str(out / "ca" / "ca.crt"), "-CRLfile",
                            str(out / "ca" / "crl.pem"), str(out / "sites" / "site-b" / "client.crt")],
                           capture_output=True, text=True, check=False)
        assert r.returncode != 0 and "revoked" in (r.stdout + r.stderr)


def test_tampered_registry_or_crl_is_refused(fed: Path, tmp_path: Path) -> None:
    out = _copy(fed, tmp_path)
    reg = out / "coordinator" / "registry.json"
    doc = json.loads(reg.read_text())
    doc["body"]["sites"]["site-a"]["sign_ed25519"] = doc["body"]["sites"]["site-b"]["sign_ed25519"]
    reg.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="registry signature"):
        TrustStore.load(out / "coordinator")
    other = provision(tmp_path / "other", ["x"]).out_dir
    shutil.copyfile(Path(other) / "ca" / "crl.pem", out / "sites" / "site-a" / "crl.pem")
    with pytest.raises(ValueError, match="CRL"):
        TrustStore.load(out / "sites" / "site-a")


def test_bundle_loaders_and_site_trust(fed: Path) -> None:
    site = SiteBundle.load(fed / "sites" / "site-a")
    coord = CoordinatorBundle.load(fed / "coordinator")
    assert site.federation_id == coord.federation_id
    assert site.coordinator_seal_public.public_bytes_raw() == coord.seal_key.public_key().public_bytes_raw()
    assert site.trust().signing_key(coord.name).public_bytes_raw() == coord.sign_key.public_key().public_bytes_raw()
    verify_bundle_certificate(coord.tls_cert, coord.ca_cert)
    verify_bundle_certificate(site.tls_cert, site.ca_cert)


def test_rotate_coordinator_refreshes_site_bundles(fed: Path, tmp_path: Path) -> None:
    out = _copy(fed, tmp_path)
    report = provision(out, SITES, rotate=["coordinator"], hosts=("10.0.0.5", "coord.example"))
    assert report.rotated == ["coordinator"] and sorted(report.refreshed) == ["site:site-a", "site:site-b"]
    coord = CoordinatorBundle.load(out / "coordinator")
    site = SiteBundle.load(out / "sites" / "site-a")
    assert site.coordinator_seal_public.public_bytes_raw() == coord.seal_key.public_key().public_bytes_raw()
    verify_server_cert(load_cert(coord.tls_cert), load_cert(coord.ca_cert), "coord.example")
    assert provision(out, SITES, hosts=("10.0.0.5", "coord.example")).warnings == []  # same hosts
    assert provision(out, SITES, hosts=("127.0.0.1",)).warnings  # changed hosts need an explicit rotate
