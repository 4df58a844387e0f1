"""Certificate revocation: a CA-signed X.509 CRL listing the serials of revoked parties."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import CRLEntryExtensionOID

from .errors import PkiMaterialError

CRL_FILE = "crl.pem"


@dataclass(frozen=True)
class Revoked:
    serial: int
    when: dt.datetime
    reason: x509.ReasonFlags


def build_crl(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, entries: list[Revoked], *, number: int, days: int
) -> x509.CertificateRevocationList:
    now = dt.datetime.now(dt.timezone.utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=days))
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    for entry in entries:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(entry.serial)
            .revocation_date(entry.when)
            .add_extension(x509.CRLReason(entry.reason), critical=False)
            .build()
        )
    return builder.sign(ca_key, hashes.SHA256())


def crl_entries(crl: x509.CertificateRevocationList) -> list[Revoked]:
    out = []
    for rc in crl:
        try:
            reason = rc.extensions.get_extension_for_oid(CRLEntryExtensionOID.CRL_REASON).value.reason
        except x509.ExtensionNotFound:
            reason = x509.ReasonFlags.unspecified
        out.append(Revoked(rc.serial_number, rc.revocation_date_utc, reason))
    return out


def crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def crl_pem(crl: x509.CertificateRevocationList) -> bytes:
    return crl.public_bytes(serialization.Encoding.PEM)


def load_verified_crl(path: Path, ca_cert: x509.Certificate) -> x509.CertificateRevocationList:
    """Load a CRL and check it is signed by the CA (a forged CRL could un-revoke a site)."""
    return parse_verified_crl(Path(path).read_bytes(), ca_cert, what=f"CRL {path}")


def parse_verified_crl(data: bytes, ca_cert: x509.Certificate, what: str = "CRL") -> x509.CertificateRevocationList:
    """A PEM CRL signed by the CA, with every entry readable; else PkiMaterialError."""
    try:
        crl = x509.load_pem_x509_crl(bytes(data))
    except (ValueError, TypeError, x509.InvalidVersion) as exc:  # InvalidVersion is no ValueError
        raise PkiMaterialError("malformed_crl", f"{what} is not a PEM X.509 CRL ({exc})") from None
    try:
        key = ca_cert.public_key()
        signed = crl.issuer == ca_cert.subject and crl.is_signature_valid(key)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:  # an unsupported signature algorithm or key type
        raise PkiMaterialError("bad_crl_signature", f"{what} cannot be checked against the CA ({exc})") from None
    if not signed:
        raise PkiMaterialError("bad_crl_signature", f"{what} is not signed by the federation CA")
    try:
        for rc in crl:  # entries are parsed lazily: read them all now, inside this check
            rc.serial_number, rc.revocation_date_utc  # noqa: B018
        crl.next_update_utc  # noqa: B018
    except ValueError as exc:
        raise PkiMaterialError("malformed_crl", f"{what} has an unreadable entry ({exc})") from None
    return crl
