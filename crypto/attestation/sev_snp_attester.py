"""``amd-sev-snp`` attester: the guest asks its AMD-SP for a report whose REPORT_DATA binds the
verifier's nonce and the key to trust, and sends it with its VCEK.

Two kernel interfaces, both read here without any CLI:
- configfs-tsm (Linux 6.7+): ``mkdir /sys/kernel/config/tsm/report/<name>``, write ``privlevel``
  and the 64-byte ``inblob``, read ``outblob`` (the report) and ``auxblob`` (the host's certificate
  table, when it provides one), check ``generation`` did not move, ``rmdir``;
- ``/dev/sev-guest``: the ``SNP_GET_REPORT`` ioctl (``struct snp_guest_request_ioctl`` with
  pointers to an ``snp_report_req`` and a 4000-byte response holding MSG_REPORT_RSP).

The VCEK comes from the certificate table when the host supplies it, otherwise from
``vcek_path`` (fetched once from AMD KDS for this chip and TCB; the verifier checks that it
matches the report, so a wrong file fails closed).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .attester import Attester
from .errors import AttestationError
from .models import Evidence, b64url, binding
from .sev_snp import REPORT_SIZE, snp_evidence_payload

VCEK_GUID = uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd")
ASK_GUID = uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782")
ARK_GUID = uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae")
REQ_SIZE, RESP_SIZE = 96, 4000


def _iowr(type_: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (type_ << 8) | nr


IOCTL_ARG = struct.Struct("<B7xQQQ")  # msg_version, req_data, resp_data, exitinfo2
SNP_GET_REPORT = _iowr(ord("S"), 0x0, IOCTL_ARG.size)


class DeviceError(AttestationError):
    """The guest could not get a report from its AMD-SP (no device, firmware error, host error)."""
    reason = "attester_device_error"


def parse_cert_table(aux: bytes) -> dict[uuid.UUID, bytes]:
    """The GUID table the host appends to an extended report: (GUID, offset, length) entries, offsets
    from the table's start, ended by an all-zero entry."""
    out: dict[uuid.UUID, bytes] = {}
    for pos in range(0, len(aux) - 23, 24):
        guid, off, length = aux[pos:pos + 16], *struct.unpack_from("<II", aux, pos + 16)
        if not any(guid) and off == 0 and length == 0:
            break
        if off + length > len(aux):
            raise DeviceError("the certificate table points outside itself")
        out[uuid.UUID(bytes_le=guid)] = aux[off:off + length]
    return out


def make_cert_table(certs: dict[uuid.UUID, bytes]) -> bytes:
    """The inverse of :func:`parse_cert_table` (for fake devices and tests)."""
    header = 24 * (len(certs) + 1)
    table, body = b"", b""
    for guid, der in certs.items():
        table += guid.bytes_le + struct.pack("<II", header + len(body), len(der))
        body += der
    return table + bytes(24) + body


class ReportSource(ABC):
    """Where reports come from: ``get_report(report_data, vmpl) -> (report, certificate table or None)``."""

    @abstractmethod
    def get_report(self, report_data: bytes, vmpl: int) -> tuple[bytes, bytes | None]: ...


class ConfigfsTsm(ReportSource):
    """configfs-tsm. ``mkdir``/``rmdir`` are the calls configfs answers (a fake kernel in tests)."""

    def __init__(self, root: str | Path = "/sys/kernel/config/tsm/report",
                 mkdir: Callable[[Path], Any] = os.mkdir, rmdir: Callable[[Path], Any] = os.rmdir):
        self.root, self.mkdir, self.rmdir = Path(root), mkdir, rmdir

    def get_report(self, report_data: bytes, vmpl: int) -> tuple[bytes, bytes | None]:
        entry = self.root / f"sovfl-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            self.mkdir(entry)
        except OSError as exc:
            raise DeviceError(f"configfs-tsm: cannot create {entry}: {exc}") from None
        try:
            provider = entry / "provider"
            if provider.exists() and provider.read_text().strip() not in ("", "sev_guest"):
                raise DeviceError(f"configfs-tsm provider is {provider.read_text().strip()!r}, not sev_guest")
            (entry / "privlevel").write_text(str(vmpl))
            (entry / "inblob").write_bytes(report_data)
            before = self._generation(entry)
            report = (entry / "outblob").read_bytes()
            aux = (entry / "auxblob").read_bytes() if (entry / "auxblob").exists() else b""
            if self._generation(entry) != before:
                raise DeviceError("configfs-tsm: another writer changed the request while it was read")
            return report, aux or None
        except OSError as exc:
            raise DeviceError(f"configfs-tsm: {exc}") from None
        finally:
            try:
                self.rmdir(entry)
            except OSError:
                pass

    @staticmethod
    def _generation(entry: Path) -> str:
        g = entry / "generation"
        return g.read_text().strip() if g.exists() else ""


class SevGuestIoctl(ReportSource):
    """``SNP_GET_REPORT`` on ``/dev/sev-guest``. ``ioctl`` is :func:`fcntl.ioctl` (a fake device in tests)."""

    def __init__(self, path: str | Path = "/dev/sev-guest", ioctl: Callable[..., Any] = fcntl.ioctl):
        self.path, self.ioctl = Path(path), ioctl

    def get_report(self, report_data: bytes, vmpl: int) -> tuple[bytes, bytes | None]:
        req = ctypes.create_string_buffer(report_data + struct.pack("<I", vmpl) + bytes(28), REQ_SIZE)
        resp = ctypes.create_string_buffer(RESP_SIZE)
        arg = bytearray(IOCTL_ARG.pack(1, ctypes.addressof(req), ctypes.addressof(resp), 0))
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise DeviceError(f"cannot open {self.path}: {exc} (is this an SEV-SNP guest with sev-guest loaded?)") \
                from None
        try:
            self.ioctl(fd, SNP_GET_REPORT, arg, True)
        except OSError as exc:
            exitinfo = IOCTL_ARG.unpack(bytes(arg))[3]
            raise DeviceError(f"SNP_GET_REPORT failed: {exc} (fw_error {exitinfo & 0xFFFFFFFF:#x}, "
                              f"vmm_error {exitinfo >> 32:#x})") from None
        finally:
            os.close(fd)
        raw = resp.raw
        status, size = struct.unpack_from("<II", raw, 0)
        if status != 0 or size != REPORT_SIZE:
            raise DeviceError(f"MSG_REPORT_RSP status {status:#x}, report size {size}")
        return raw[0x20:0x20 + REPORT_SIZE], None


class SevSnpAttesterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interface: Literal["auto", "configfs-tsm", "ioctl"] = "auto"
    tsm_path: str = "/sys/kernel/config/tsm/report"
    device_path: str = "/dev/sev-guest"
    vcek_path: str | None = None  # the chip's VCEK (DER) when the host supplies no certificate table
    vmpl: int = Field(0, ge=0, le=3)


class SevSnpAttester(Attester):
    format = "amd-sev-snp"

    def __init__(self, party: str, source: ReportSource | None = None, vcek_path: str | None = None, vmpl: int = 0,
                 **interface: Any):
        super().__init__(party)
        cfg = SevSnpAttesterConfig(vcek_path=vcek_path, vmpl=vmpl, **interface)
        self.config = cfg
        if source is None:
            use_tsm = cfg.interface == "configfs-tsm" or (cfg.interface == "auto" and Path(cfg.tsm_path).is_dir())
            source = ConfigfsTsm(cfg.tsm_path) if use_tsm else SevGuestIoctl(cfg.device_path)
        self.source = source

    def attest(self, nonce: bytes, public_key: bytes) -> Evidence:
        report, aux = self.source.get_report(binding(nonce, public_key) + bytes(32), self.config.vmpl)
        if len(report) != REPORT_SIZE:
            raise DeviceError(f"the device returned {len(report)} bytes, not a {REPORT_SIZE}-byte report")
        vcek = parse_cert_table(aux).get(VCEK_GUID) if aux else None
        if vcek is None:
            if not self.config.vcek_path:
                raise DeviceError("the host supplied no VCEK with the report; set vcek_path to the chip's VCEK "
                                  "(DER from https://kdsintf.amd.com/vcek/v1/<product>/<chip id>?<TCB>)")
            vcek = Path(self.config.vcek_path).read_bytes()
        return Evidence(format=self.format, attester=self.party, nonce=b64url(nonce), public_key=b64url(public_key),
                        payload=snp_evidence_payload(report, vcek))
