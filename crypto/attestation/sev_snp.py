"""``amd-sev-snp``: appraise a raw AMD SEV-SNP attestation report and its VCEK, offline.

Evidence (``Evidence.payload``) is the JSON ``{"report": b64url(1184 bytes), "vcek": b64url(DER)}``.
Everything is checked with ``cryptography`` against files the operator pinned, never a CLI or
the network:

1. the VCEK chains to a configured ASK -> ARK (AMD KDS ``cert_chain`` files), each signature
   RSASSA-PSS (SHA-384, MGF1-SHA-384, salt 48), and the ARK's SHA-256 is pinned per product
   (``data/amd_ark_sha256.json``, or ``ark_fingerprints`` in the config);
2. the report's ECDSA P-384 / SHA-384 signature over bytes 0x000-0x29F verifies with the VCEK
   (r and s little-endian, 72-byte fields; high bytes and the reserved tail must be zero);
3. the VCEK's TCB extensions equal the report's REPORTED_TCB and its hwID equals CHIP_ID (on
   Turin the hwID is CHIP_ID's first 8 bytes);
4. REPORT_DATA equals :func:`~crypto.attestation.models.binding` (nonce folded with the key
   hash) followed by 32 zero bytes, VMPL is the configured level (0), and the TCB is at least
   ``min_tcb``.

The result carries MEASUREMENT and HOST_DATA (and the ID/author key digests) as measurements
for the policy, and debug = POLICY bit 19. Report layout: AMD SEV-SNP ABI specification, table
"ATTESTATION_REPORT Structure".
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.x509.oid import SignatureAlgorithmOID
from pydantic import BaseModel, ConfigDict, Field

from .errors import (
    AttestationError, BadCertificateChain, BadSignature, MalformedEvidence, NonceMismatch, UnknownSigningKey,
    UnsupportedAlgorithm, UntrustedRoot, WrongKeyType,
)
from .models import AttestationResult, Evidence, b64url, binding, key_hash, load_json, unb64url, utcnow
from .verifier import Verifier

REPORT_SIZE = 0x4A0
SIGNED_SIZE = 0x2A0
_P384_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF581A0DB248B0A77AECEC196ACCC52973
DEBUG_POLICY_BIT = 19
_AMD_OID = "1.3.6.1.4.1.3704.1"
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
# TCB_VERSION byte -> field, per product family (Turin moved the fields and added FMC).
_TCB_LAYOUT = {
    "milan": {"bl": 0, "tee": 1, "snp": 6, "ucode": 7},
    "genoa": {"bl": 0, "tee": 1, "snp": 6, "ucode": 7},
    "turin": {"fmc": 0, "bl": 1, "tee": 2, "snp": 3, "ucode": 7},
}
_SPL_OID = {"bl": "3.1", "tee": "3.2", "snp": "3.3", "ucode": "3.8", "fmc": "3.9"}


class TcbMismatch(AttestationError):
    """The VCEK was issued for another TCB than the one the report says it runs."""
    reason = "tcb_mismatch"


class ChipIdMismatch(AttestationError):
    """The VCEK belongs to another chip than the one that made the report."""
    reason = "chip_id_mismatch"


class SignatureOutOfRange(AttestationError):
    """r or s is zero, not below the curve order, or its 72-byte field has non-zero high bytes."""
    reason = "signature_out_of_range"


class VmplNotAllowed(AttestationError):
    reason = "vmpl_not_allowed"


class TcbTooOld(AttestationError):
    reason = "tcb_too_old"


def packaged_ark_fingerprints() -> dict[str, str]:
    """Product -> SHA-256 (hex) of AMD's ARK for it, shipped with this package."""
    text = resources.files("crypto.attestation").joinpath("data/amd_ark_sha256.json").read_text()
    return {k: v.lower() for k, v in json.loads(text).items() if not k.startswith("_")}


@dataclass(frozen=True)
class SnpReport:
    """The fields of an ATTESTATION_REPORT this verifier appraises (all integers little-endian)."""

    raw: bytes

    def _u32(self, off: int) -> int:
        return int.from_bytes(self.raw[off:off + 4], "little")

    def _u64(self, off: int) -> int:
        return int.from_bytes(self.raw[off:off + 8], "little")

    version = property(lambda self: self._u32(0x00))
    guest_svn = property(lambda self: self._u32(0x04))
    policy = property(lambda self: self._u64(0x08))
    family_id = property(lambda self: self.raw[0x10:0x20])
    image_id = property(lambda self: self.raw[0x20:0x30])
    vmpl = property(lambda self: self._u32(0x30))
    signature_algo = property(lambda self: self._u32(0x34))
    current_tcb = property(lambda self: self.raw[0x38:0x40])
    platform_info = property(lambda self: self._u64(0x40))
    flags = property(lambda self: self._u32(0x48))
    report_data = property(lambda self: self.raw[0x50:0x90])
    measurement = property(lambda self: self.raw[0x90:0xC0])
    host_data = property(lambda self: self.raw[0xC0:0xE0])
    id_key_digest = property(lambda self: self.raw[0xE0:0x110])
    author_key_digest = property(lambda self: self.raw[0x110:0x140])
    report_id = property(lambda self: self.raw[0x140:0x160])
    reported_tcb = property(lambda self: self.raw[0x180:0x188])
    chip_id = property(lambda self: self.raw[0x1A0:0x1E0])
    committed_tcb = property(lambda self: self.raw[0x1E0:0x1E8])
    launch_tcb = property(lambda self: self.raw[0x1F0:0x1F8])
    signed_bytes = property(lambda self: self.raw[:SIGNED_SIZE])
    debug = property(lambda self: bool(self.policy >> DEBUG_POLICY_BIT & 1))
    signing_key = property(lambda self: (self.flags >> 2) & 0x7)  # 0: VCEK, 1: VLEK, 7: none
    mask_chip_key = property(lambda self: bool(self.flags >> 1 & 1))

    @classmethod
    def parse(cls, raw: bytes) -> "SnpReport":
        if len(raw) != REPORT_SIZE:
            raise MalformedEvidence(f"SNP report is {len(raw)} bytes, an ATTESTATION_REPORT is {REPORT_SIZE}")
        rep = cls(bytes(raw))
        if not 2 <= rep.version <= 5:
            raise MalformedEvidence(f"SNP report version {rep.version} is not one this verifier reads (2-5)")
        if rep.signature_algo != 1:
            raise UnsupportedAlgorithm(f"SNP report signature algorithm {rep.signature_algo}; only 1 "
                                       "(ECDSA P-384 with SHA-384) is defined")
        return rep

    def signature(self) -> tuple[int, int]:
        """(r, s) from the little-endian 72-byte fields at 0x2A0; refuses non-canonical encodings."""
        sig = self.raw[SIGNED_SIZE:]
        r_field, s_field, tail = sig[:72], sig[72:144], sig[144:]
        if any(r_field[48:]) or any(s_field[48:]):
            raise SignatureOutOfRange("r or s has non-zero bytes above the 48 of a P-384 scalar")
        if any(tail):
            raise MalformedEvidence("the reserved bytes after the signature are not zero")
        r, s = int.from_bytes(r_field[:48], "little"), int.from_bytes(s_field[:48], "little")
        if not (0 < r < _P384_N and 0 < s < _P384_N):
            raise SignatureOutOfRange("r or s is not in [1, n-1] for P-384")
        return r, s

    def tcb(self, product: str, which: str = "reported") -> dict[str, int]:
        raw = {"reported": self.reported_tcb, "current": self.current_tcb, "committed": self.committed_tcb,
               "launch": self.launch_tcb}[which]
        return {name: raw[i] for name, i in _TCB_LAYOUT[product].items()}


# -- the AMD certificate chain ------------------------------------------------------------------

def _der_tlv(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at ``pos``."""
    if pos + 2 > len(data):
        raise ValueError("truncated DER")
    tag, first = data[pos], data[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if not 1 <= n <= 4 or pos + n > len(data):
            raise ValueError("bad DER length")
        length, pos = int.from_bytes(data[pos:pos + n], "big"), pos + n
    if pos + length > len(data):
        raise ValueError("truncated DER")
    return tag, pos, pos + length


def _canonical_outer(der: bytes) -> bool:
    """The parts of a certificate its signature does not cover: the outer signatureAlgorithm must
    equal the one inside the signed TBS, byte for byte (RFC 5280 4.1.1.2), and the signature BIT
    STRING has no unused bits and ends the certificate, which ends the input."""
    _, cert_start, cert_end = _der_tlv(der, 0)
    _, tbs_start, tbs_end = _der_tlv(der, cert_start)
    pos = tbs_start
    tag, _, end = _der_tlv(der, pos)
    if tag == 0xA0:  # [0] version
        pos = end
    _, _, pos = _der_tlv(der, pos)  # serialNumber
    _, _, inner_end = _der_tlv(der, pos)
    inner = der[pos:inner_end]
    _, _, outer_end = _der_tlv(der, tbs_end)
    tag, sig_start, sig_end = _der_tlv(der, outer_end)
    return (der[tbs_end:outer_end] == inner and tag == 0x03 and sig_start < sig_end and der[sig_start] == 0
            and sig_end == cert_end == len(der))


def load_cert(der_or_pem: bytes, what: str) -> x509.Certificate:
    try:
        with warnings.catch_warnings():  # AMD's certificates carry non-positive serials in places
            warnings.simplefilter("ignore")
            cert = (x509.load_pem_x509_certificate(der_or_pem) if der_or_pem.lstrip().startswith(b"-----")
                    else x509.load_der_x509_certificate(der_or_pem))
            if not der_or_pem.lstrip().startswith(b"-----") and not _canonical_outer(der_or_pem):
                raise ValueError("the unsigned outer fields are not canonical")
            # cryptography parses lazily: touch every field now so that bad DER fails here, as evidence
            _ = (cert.issuer, cert.subject, cert.extensions, cert.public_key(), cert.not_valid_before_utc,
                 cert.not_valid_after_utc, cert.signature_algorithm_oid, cert.signature_algorithm_parameters,
                 cert.signature_hash_algorithm, cert.tbs_certificate_bytes, cert.signature)
    except Exception as exc:  # noqa: BLE001 - any parser failure on untrusted DER (InvalidVersion, ...) is malformed
        raise MalformedEvidence(f"{what} is not a certificate: {exc}"[:300]) from None
    return cert


def _pss_signed_by(cert: x509.Certificate, issuer_key: Any, what: str) -> None:
    """``cert`` carries an RSASSA-PSS (SHA-384, MGF1-SHA-384, salt 48) signature by ``issuer_key``."""
    params = cert.signature_algorithm_parameters
    if (cert.signature_algorithm_oid != SignatureAlgorithmOID.RSASSA_PSS
            or not isinstance(cert.signature_hash_algorithm, hashes.SHA384)
            or not isinstance(params, padding.PSS)
            or getattr(params, "_salt_length", None) != 48
            or not isinstance(getattr(getattr(params, "_mgf", None), "_algorithm", None), hashes.SHA384)):
        raise BadCertificateChain(f"{what} is not signed with RSASSA-PSS SHA-384 / MGF1-SHA-384 / salt 48")
    if not isinstance(issuer_key, rsa.RSAPublicKey):
        raise BadCertificateChain(f"the issuer of {what} has no RSA key")
    try:
        issuer_key.verify(cert.signature, cert.tbs_certificate_bytes, _PSS, hashes.SHA384())
    except InvalidSignature:
        raise BadCertificateChain(f"the signature on {what} does not verify") from None


def _valid_at(cert: x509.Certificate, now: dt.datetime, what: str) -> None:
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise BadCertificateChain(f"{what} is valid {cert.not_valid_before_utc:%Y-%m-%d} .. "
                                  f"{cert.not_valid_after_utc:%Y-%m-%d}, not at {now:%Y-%m-%d}")


@dataclass(frozen=True)
class AmdChain:
    """One product's ASK and pinned ARK, checked when the verifier is configured."""

    product: str  # "Milan", "Genoa", "Turin", ...
    ask: x509.Certificate
    ark: x509.Certificate

    @classmethod
    def from_pem(cls, pem: bytes, fingerprints: dict[str, str], where: str) -> "AmdChain":
        certs = x509.load_pem_x509_certificates(pem)
        ark = [c for c in certs if c.subject == c.issuer]
        ask = [c for c in certs if c.subject != c.issuer]
        if len(ark) != 1 or len(ask) != 1:
            raise ValueError(f"{where}: expected one ASK and one self-signed ARK (AMD KDS cert_chain), "
                             f"found {len(certs)} certificate(s)")
        fp = hashlib.sha256(ark[0].public_bytes(serialization.Encoding.DER)).hexdigest()
        product = next((p for p, f in fingerprints.items() if f == fp), None)
        if product is None:
            raise ValueError(f"{where}: its ARK (sha256 {fp}) is not pinned for any product; pinned: "
                             f"{sorted(fingerprints)}")
        _pss_signed_by(ark[0], ark[0].public_key(), f"ARK-{product}")
        _pss_signed_by(ask[0], ark[0].public_key(), f"ASK-{product}")
        if ask[0].issuer != ark[0].subject:
            raise ValueError(f"{where}: the ASK is not issued by the ARK")
        return cls(product, ask[0], ark[0])


def _der_int(value: bytes) -> int:
    tag, start, end = _der_tlv(value, 0)
    if tag != 0x02 or end != len(value) or end - start > 2:
        raise ValueError("not a small DER INTEGER")
    return int.from_bytes(value[start:end], "big", signed=True)


def vcek_extensions(vcek: x509.Certificate) -> dict[str, Any]:
    """AMD's VCEK extensions: productName, the SPLs by name, hwID (raw bytes)."""
    out: dict[str, Any] = {"spl": {}}
    for ext in vcek.extensions:
        oid = ext.oid.dotted_string
        if not oid.startswith(_AMD_OID + "."):
            continue
        raw = getattr(ext.value, "value", b"")
        sub = oid[len(_AMD_OID) + 1:]
        try:
            if sub == "2":
                tag, start, end = _der_tlv(raw, 0)
                out["product_name"] = raw[start:end].decode("ascii")
            elif sub == "4":
                out["hwid"] = raw
            else:
                for name, s in _SPL_OID.items():
                    if sub == s:
                        out["spl"][name] = _der_int(raw)
        except (ValueError, UnicodeError):
            raise MalformedEvidence(f"VCEK extension {oid} does not decode") from None
    return out


# -- the verifier --------------------------------------------------------------------------------

class SevSnpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # AMD KDS cert_chain files (ASK then ARK, PEM), one per product the fleet runs on
    cert_chain_paths: list[str] = Field(min_length=1)
    # product -> SHA-256 hex of its ARK; None: the AMD roots shipped with this package
    ark_fingerprints: dict[str, str] | None = None
    vmpl: int = Field(0, ge=0, le=3)  # the VMPL the guest must run at (0: the most privileged)
    # minimum TCB SVNs by name (bl, tee, snp, ucode; fmc on Turin)
    min_tcb: dict[str, int] = Field(default_factory=dict)
    result_lifetime_s: float = Field(300.0, gt=0)  # a report carries no time: freshness is the nonce


class SevSnpVerifier(Verifier):
    name: ClassVar[str] = "amd-sev-snp"
    config_model: ClassVar[type[BaseModel]] = SevSnpConfig
    config: SevSnpConfig

    def __init__(self, config: Any = None):
        super().__init__(config)
        fps = {k: v.lower().replace(":", "") for k, v in
               (self.config.ark_fingerprints or packaged_ark_fingerprints()).items()}
        self.chains: list[AmdChain] = []
        for path in self.config.cert_chain_paths:
            self.chains.append(AmdChain.from_pem(Path(path).read_bytes(), fps, path))

    def check_vcek(self, vcek: x509.Certificate, now: dt.datetime) -> tuple[AmdChain, dict[str, Any]]:
        """The pinned chain that issued ``vcek`` and its AMD extensions, or an AttestationError."""
        chain = next((c for c in self.chains if c.ask.subject == vcek.issuer), None)
        if chain is None:
            raise UntrustedRoot(f"the VCEK's issuer {vcek.issuer.rfc4514_string()[:80]!r} is no configured ASK "
                                f"(products {[c.product for c in self.chains]})")
        _pss_signed_by(vcek, chain.ask.public_key(), "the VCEK")
        for cert, what in ((vcek, "the VCEK"), (chain.ask, f"ASK-{chain.product}"), (chain.ark, f"ARK-{chain.product}")):
            _valid_at(cert, now, what)
        ext = vcek_extensions(vcek)
        family = str(ext.get("product_name", "")).split("-")[0]
        if family.lower() != chain.product.lower():
            raise BadCertificateChain(f"VCEK product {ext.get('product_name')!r} under the {chain.product} chain")
        key = vcek.public_key()
        if not (isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP384R1)):
            raise WrongKeyType("the VCEK key is not ECDSA P-384")
        return chain, ext

    def verify(self, evidence: Evidence, *, nonce: bytes, now: dt.datetime | None = None) -> AttestationResult:
        now = now or utcnow()
        body = load_json(evidence.payload, "amd-sev-snp evidence")
        if not isinstance(body, dict) or set(body) != {"report", "vcek"}:
            raise MalformedEvidence('amd-sev-snp evidence is {"report": b64url, "vcek": b64url DER}')
        try:
            raw, vcek_der = unb64url(body["report"]), unb64url(body["vcek"])
            claimed_key, ev_nonce = evidence.public_key_bytes(), unb64url(evidence.nonce)
        except (ValueError, TypeError):
            raise MalformedEvidence("report, vcek, nonce or public_key is not base64url") from None
        if ev_nonce != nonce:
            raise NonceMismatch("evidence answers another challenge")
        report = SnpReport.parse(raw)
        if report.signing_key != 0 or report.mask_chip_key:
            raise UnknownSigningKey("the report is not signed by a VCEK (VLEK, none or masked chip key)")
        vcek = load_cert(vcek_der, "the VCEK")
        chain, ext = self.check_vcek(vcek, now)

        r, s = report.signature()
        try:
            vcek.public_key().verify(encode_dss_signature(r, s), report.signed_bytes, ec.ECDSA(hashes.SHA384()))
        except InvalidSignature:
            raise BadSignature("the report signature does not verify with the VCEK") from None

        product = chain.product.lower()
        if product not in _TCB_LAYOUT:
            raise TcbMismatch(f"no TCB layout known for product {chain.product}")
        tcb = report.tcb(product)
        if any(ext["spl"].get(k) != v for k, v in tcb.items()):
            raise TcbMismatch(f"VCEK is for TCB {ext['spl']}, the report states REPORTED_TCB {tcb}")
        hwid = ext.get("hwid", b"")
        chip = report.chip_id[:8] if product == "turin" else report.chip_id
        if not hwid or hwid != chip:
            raise ChipIdMismatch("the VCEK's hwID is not the report's CHIP_ID")

        khash = key_hash(claimed_key)
        if report.report_data != binding(nonce, claimed_key) + bytes(32):
            raise NonceMismatch("REPORT_DATA does not bind this challenge and key "
                                "(expected SHA-256(nonce || SHA-256(key)) and 32 zero bytes)")
        if report.vmpl != self.config.vmpl:
            raise VmplNotAllowed(f"report made at VMPL {report.vmpl}, VMPL {self.config.vmpl} required")
        low = {k: (tcb.get(k), v) for k, v in self.config.min_tcb.items() if tcb.get(k, -1) < v}
        if low:
            raise TcbTooOld(f"TCB below the minimum: {low} (got, required)")
        measurements = {"measurement": report.measurement.hex(), "host_data": report.host_data.hex(),
                        "id_key_digest": report.id_key_digest.hex(), "author_key_digest": report.author_key_digest.hex(),
                        "family_id": report.family_id.hex(), "image_id": report.image_id.hex(),
                        "guest_svn": str(report.guest_svn)}
        claims = {"product": chain.product, "version": report.version, "policy": f"{report.policy:#x}",
                  "vmpl": report.vmpl, "reported_tcb": tcb, "platform_info": f"{report.platform_info:#x}",
                  "chip_id": report.chip_id.hex(), "report_id": report.report_id.hex(),
                  "vcek_product_name": ext.get("product_name")}
        return AttestationResult(
            verifier=self.name, attester=evidence.attester, issuer=f"AMD ARK-{chain.product}", nonce=b64url(nonce),
            key_hash=b64url(khash), measurements=measurements, debug=report.debug, issued_at=now,
            expires_at=now + dt.timedelta(seconds=self.config.result_lifetime_s), claims=claims,
        )


def snp_evidence_payload(report: bytes, vcek_der: bytes) -> str:
    """The ``Evidence.payload`` of an ``amd-sev-snp`` attester."""
    return json.dumps({"report": b64url(report), "vcek": b64url(vcek_der)})
