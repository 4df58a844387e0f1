"""X.509 recipes: the federation CA, the coordinator's TLS server certificate, site client
certificates, and chain verification with ``cryptography.x509.verification`` (RFC 5280 / web
PKI rules, the same checks a TLS stack applies)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import DNSName, IPAddress, PolicyBuilder, Store

ORG = "sovereign-fl"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _name(common_name: str, unit: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def party_uri(federation_id: str, role: str, name: str) -> str:
    """SPIFFE-style identity carried as a URI SAN: ``spiffe://sovfl-<fed>/<role>/<name>``."""
    return f"spiffe://sovfl-{federation_id}/{role}/{name}"


def make_ca(key: ec.EllipticCurvePrivateKey, federation_id: str, days: int) -> x509.Certificate:
    now = _now()
    name = _name(f"sovereign-fl federation CA {federation_id}", "federation-ca")
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    public_key: ec.EllipticCurvePublicKey,
    subject: x509.Name,
    sans: Sequence[x509.GeneralName],
    usage: x509.ObjectIdentifier,
    days: int,
) -> x509.Certificate:
    now = _now()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def host_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """IP literals become IPAddress SANs, the rest DNSName SANs."""
    out: list[x509.GeneralName] = []
    for host in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def make_server_cert(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, public_key: ec.EllipticCurvePublicKey,
    *, federation_id: str, name: str, hosts: Sequence[str], days: int,
) -> x509.Certificate:
    sans = [*host_names(hosts), x509.UniformResourceIdentifier(party_uri(federation_id, "coordinator", name))]
    return _leaf(ca_cert, ca_key, public_key, _name(name, "coordinator"), sans, ExtendedKeyUsageOID.SERVER_AUTH, days)


def make_client_cert(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, public_key: ec.EllipticCurvePublicKey,
    *, federation_id: str, site: str, days: int,
) -> x509.Certificate:
    sans = [x509.UniformResourceIdentifier(party_uri(federation_id, "site", site))]
    return _leaf(ca_cert, ca_key, public_key, _name(site, "site"), sans, ExtendedKeyUsageOID.CLIENT_AUTH, days)


# -- verification ------------------------------------------------------------------------------


def verify_server_cert(cert: x509.Certificate, ca_cert: x509.Certificate, host: str) -> None:
    """Raise ``VerificationError`` unless ``cert`` chains to ``ca_cert`` and names ``host``."""
    try:
        subject: DNSName | IPAddress = IPAddress(ipaddress.ip_address(host))
    except ValueError:
        subject = DNSName(host)
    verifier = PolicyBuilder().store(Store([ca_cert])).build_server_verifier(subject)
    verifier.verify(cert, [])


def verify_client_cert(cert: x509.Certificate, ca_cert: x509.Certificate) -> list[str]:
    """Verify a site client certificate; return its URI SANs (the party identities)."""
    verifier = PolicyBuilder().store(Store([ca_cert])).build_client_verifier()
    verified = verifier.verify(cert, [])
    return [gn.value for gn in (verified.subjects or []) if isinstance(gn, x509.UniformResourceIdentifier)]
