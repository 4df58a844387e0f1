"""A TEST AMD key hierarchy for SEV-SNP: ARK -> ASK -> VCEK in AMD's formats, and reports signed
by the VCEK. For tests and demos of the ``amd-sev-snp`` verifier and attester; not a root of trust.

The certificates have AMD's shape (RSA-4096 ARK and ASK, RSASSA-PSS SHA-384 salt 48, a P-384
VCEK with productName, SPL and hwID extensions), so the verifier appraises them with the very
code that appraises genuine ones; only the pinned ARK fingerprint differs.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from .sev_snp import _AMD_OID, _SPL_OID, _TCB_LAYOUT, REPORT_SIZE, SIGNED_SIZE
from .sev_snp_attester import (
    ARK_GUID, ASK_GUID, IOCTL_ARG, REQ_SIZE, SNP_GET_REPORT, VCEK_GUID, SevGuestIoctl, SevSnpAttester, make_cert_table,
)

log = logging.getLogger(__name__)
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
DEFAULT_TCB = {"bl": 3, "tee": 0, "snp": 8, "ucode": 115}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Engineering"),
                      x509.NameAttribute(NameOID.COUNTRY_NAME, "US"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "TEST ONLY (not Advanced Micro Devices)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _der_int(v: int) -> bytes:
    body = v.to_bytes((v.bit_length() + 8) // 8 or 1, "big")
    return bytes([0x02, len(body)]) + body


def _ext(oid: str, value: bytes) -> x509.Extension[x509.UnrecognizedExtension]:
    return x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value)  # type: ignore[return-value]


class TestAmdChain:
    """ARK (self-signed) -> ASK -> VCEK for one test chip, with a VCEK private key to sign reports."""

    __test__ = False  # not a pytest class

    def __init__(self, product: str = "Milan", *, chip_id: bytes | None = None, tcb: dict[str, int] | None = None,
                 rsa_bits: int = 4096, days: int = 365):
        self.product, self.tcb = product, dict(tcb or DEFAULT_TCB)
        self.chip_id = chip_id if chip_id is not None else os.urandom(64)
        now = dt.datetime.now(dt.timezone.utc)
        self.ark_key = rsa.generate_private_key(public_exponent=65537, key_size=rsa_bits)
        self.ask_key = rsa.generate_private_key(public_exponent=65537, key_size=rsa_bits)
        self.vcek_key = ec.generate_private_key(ec.SECP384R1())
        self.ark = self._cert(f"ARK-{product}", self.ark_key, f"ARK-{product}", self.ark_key, now, days, ca=True)
        self.ask = self._cert(f"SEV-{product}", self.ask_key, f"ARK-{product}", self.ark_key, now, days, ca=True)
        self.vcek = self.make_vcek()

    @staticmethod
    def _cert(subject: str, key: Any, issuer: str, issuer_key: Any, now: dt.datetime, days: int, *, ca: bool,
              extensions: list[Any] = ()) -> x509.Certificate:  # type: ignore[assignment]
        b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=days)))
        if ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        for e in extensions:
            b = b.add_extension(e, critical=False)
        return b.sign(issuer_key, hashes.SHA384(), rsa_padding=_PSS)

    def make_vcek(self, *, chip_id: bytes | None = None, tcb: dict[str, int] | None = None,
                  product_name: str | None = None, key: Any = None) -> x509.Certificate:
        """A VCEK issued by this ASK (another chip or TCB when given: for negative tests)."""
        chip_id = self.chip_id if chip_id is None else chip_id
        tcb = self.tcb if tcb is None else tcb
        name = (product_name or (f"{self.product}-B0" if self.product != "Turin" else self.product)).encode()
        exts = [_ext(f"{_AMD_OID}.1", _der_int(0)), _ext(f"{_AMD_OID}.2", bytes([0x16, len(name)]) + name)]
        exts += [_ext(f"{_AMD_OID}.{_SPL_OID[k]}", _der_int(v)) for k, v in tcb.items()]
        hwid = chip_id[:8] if self.product == "Turin" else chip_id
        exts.append(_ext(f"{_AMD_OID}.4", hwid))
        k = key or self.vcek_key
        return self._cert("SEV-VCEK", k, f"SEV-{self.product}", self.ask_key, dt.datetime.now(dt.timezone.utc), 365,
                          ca=False, extensions=exts)

    def ark_fingerprint(self) -> str:
        return hashlib.sha256(self.ark.public_bytes(serialization.Encoding.DER)).hexdigest()

    def cert_chain_pem(self) -> bytes:
        """ASK then ARK, as AMD KDS serves ``cert_chain``."""
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in (self.ask, self.ark))

    def vcek_der(self, vcek: x509.Certificate | None = None) -> bytes:
        return (vcek or self.vcek).public_bytes(serialization.Encoding.DER)

    def verifier_config(self, cert_chain_path: str | Path, **overrides: Any) -> dict[str, Any]:
        return {"cert_chain_paths": [str(cert_chain_path)], "ark_fingerprints": {self.product: self.ark_fingerprint()},
                **overrides}

    def report(self, report_data: bytes, *, measurement: bytes = b"\xa1" * 48, host_data: bytes = bytes(32),
               policy: int = 0x30000, vmpl: int = 0, version: int = 2, tcb: dict[str, int] | None = None,
               chip_id: bytes | None = None, signing_key: Any = None) -> bytes:
        """A signed 1184-byte ATTESTATION_REPORT."""
        if len(report_data) != 64:
            raise ValueError("REPORT_DATA is 64 bytes")
        r = bytearray(REPORT_SIZE)
        le = lambda v, n: v.to_bytes(n, "little")  # noqa: E731
        r[0x00:0x04], r[0x08:0x10], r[0x30:0x34], r[0x34:0x38] = le(version, 4), le(policy, 8), le(vmpl, 4), le(1, 4)
        tcb_bytes = bytearray(8)
        for name, i in _TCB_LAYOUT[self.product.lower()].items():
            tcb_bytes[i] = (tcb or self.tcb)[name]
        for off in (0x38, 0x180, 0x1E0, 0x1F0):
            r[off:off + 8] = tcb_bytes
        r[0x40:0x48] = le(1, 8)
        r[0x50:0x90], r[0x90:0xC0], r[0xC0:0xE0] = report_data, measurement, host_data
        r[0x140:0x160] = os.urandom(32)
        r[0x160:0x180] = b"\xff" * 32
        r[0x1A0:0x1E0] = self.chip_id if chip_id is None else chip_id
        der = (signing_key or self.vcek_key).sign(bytes(r[:SIGNED_SIZE]), ec.ECDSA(hashes.SHA384()))
        rr, ss = decode_dss_signature(der)
        r[SIGNED_SIZE:SIGNED_SIZE + 72] = rr.to_bytes(72, "little")
        r[SIGNED_SIZE + 72:SIGNED_SIZE + 144] = ss.to_bytes(72, "little")
        return bytes(r)

    def save(self, directory: str | Path, *, measurement: bytes = b"\xa1" * 48, policy: int = 0x30000) -> Path:
        """cert_chain.pem, vcek.der, vcek_key.pem (0600) and chip.json, for a fake device in another process
        (whose reports carry ``measurement`` and ``policy``)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cert_chain.pem").write_bytes(self.cert_chain_pem())
        (d / "vcek.der").write_bytes(self.vcek_der())
        key = d / "vcek_key.pem"
        key.touch(mode=0o600)
        key.write_bytes(self.vcek_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
        (d / "chip.json").write_text(json.dumps({"product": self.product, "chip_id": self.chip_id.hex(),
                                                 "tcb": self.tcb, "ark_sha256": self.ark_fingerprint(),
                                                 "measurement": measurement.hex(), "policy": policy}))
        return d


class SavedTestChip:
    """What a fake SEV guest device needs from a saved :class:`TestAmdChain`: the VCEK and its key."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        meta = json.loads((d / "chip.json").read_text())
        self.product, self.chip_id, self.tcb = meta["product"], bytes.fromhex(meta["chip_id"]), meta["tcb"]
        self.vcek_der = (d / "vcek.der").read_bytes()
        self.vcek_key = serialization.load_pem_private_key((d / "vcek_key.pem").read_bytes(), None)
        self.cert_chain_path = d / "cert_chain.pem"
        self.ark_sha256 = meta["ark_sha256"]
        self.measurement, self.policy = meta.get("measurement", "a1" * 48), int(meta.get("policy", 0x30000))

    def report(self, report_data: bytes, *, vmpl: int = 0, measurement: bytes | None = None,
               policy: int | None = None) -> bytes:
        measurement = bytes.fromhex(self.measurement) if measurement is None else measurement
        policy = self.policy if policy is None else policy
        chain = TestAmdChain.__new__(TestAmdChain)
        chain.product, chain.tcb, chain.chip_id, chain.vcek_key = self.product, self.tcb, self.chip_id, self.vcek_key
        return chain.report(report_data, vmpl=vmpl, measurement=measurement, policy=policy)


class FakeSevGuestDevice:
    """A fake ``/dev/sev-guest``: answers ``SNP_GET_REPORT`` like the driver, reading the request and
    writing MSG_REPORT_RSP through the pointers in ``struct snp_guest_request_ioctl``; the report is
    signed by a test chip's VCEK. Pass ``.ioctl`` to :class:`SevGuestIoctl`."""

    def __init__(self, chip: "TestAmdChain | SavedTestChip", *, status: int = 0):
        self.chip, self.status, self.requests = chip, status, []  # type: list[tuple[bytes, int]]

    def ioctl(self, fd: int, request: int, arg: bytearray, mutate: bool = True) -> int:
        if request != SNP_GET_REPORT or not mutate:
            raise OSError(25, "Inappropriate ioctl for device")
        version, req_addr, resp_addr, _ = IOCTL_ARG.unpack(bytes(arg))
        if version != 1:
            raise OSError(22, "bad msg_version")
        req = ctypes.string_at(req_addr, REQ_SIZE)
        user_data, vmpl = req[:64], struct.unpack_from("<I", req, 64)[0]
        self.requests.append((user_data, vmpl))
        report = self.chip.report(user_data, vmpl=vmpl)
        resp = struct.pack("<II", self.status, len(report)) + bytes(24) + report
        ctypes.memmove(resp_addr, resp, len(resp))
        return 0


class FakeConfigfsKernel:
    """configfs-tsm as the kernel presents it: ``mkdir`` makes the entry with its attribute files,
    ``outblob`` (a FIFO) yields a report over the ``inblob`` written before it is read, ``auxblob``
    holds the certificate table, ``rmdir`` removes the entry. Pass ``.mkdir``/``.rmdir`` to ConfigfsTsm."""

    def __init__(self, chip: "TestAmdChain | SavedTestChip", *, with_certs: bool = True):
        self.chip, self.with_certs, self.entries = chip, with_certs, []  # type: list[Path]

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)
        self.entries.append(Path(path))
        (path / "provider").write_text("sev_guest\n")
        (path / "generation").write_text("1\n")
        vcek = self.chip.vcek_der if isinstance(self.chip, SavedTestChip) else self.chip.vcek_der()
        table = make_cert_table({VCEK_GUID: vcek, ASK_GUID: b"ask", ARK_GUID: b"ark"}) if self.with_certs else b""
        (path / "auxblob").write_bytes(table)
        os.mkfifo(path / "outblob")

        def answer() -> None:
            with open(path / "outblob", "wb") as out:  # blocks until the guest reads outblob
                privlevel = path / "privlevel"
                vmpl = int(privlevel.read_text() or 0) if privlevel.exists() else 0
                out.write(self.chip.report((path / "inblob").read_bytes(), vmpl=vmpl))

        threading.Thread(target=answer, daemon=True).start()

    def rmdir(self, path: Path) -> None:
        shutil.rmtree(path)


class FakeDeviceSnpAttester(SevSnpAttester):
    """``amd-sev-snp-fake``: the real :class:`SevSnpAttester` over :class:`FakeSevGuestDevice` for a saved
    test chip (``chip_dir``). For end-to-end tests only; the evidence is signed by a TEST VCEK."""

    @classmethod
    def from_config(cls, party: str, config: Any) -> "SevSnpAttester":
        opts = dict(config)
        d = Path(opts.pop("chip_dir"))
        chip = SavedTestChip(d)
        node = d / "sev-guest"
        node.touch()
        log.warning("amd-sev-snp-fake attester for %r: reports come from a TEST chip", party)
        return SevSnpAttester(party, source=SevGuestIoctl(node, ioctl=FakeSevGuestDevice(chip).ioctl),
                              vcek_path=str(d / "vcek.der"), **opts)
