"""The amd-sev-snp attester over a fake /dev/sev-guest (the SNP_GET_REPORT ioctl, through real
pointers) and a fake configfs-tsm kernel, appraised by the real verifier."""

from __future__ import annotations

import os
import uuid

import pytest

from crypto.attestation import AttestationError, Policy, appraise, create_attester
from crypto.attestation.models import binding
from crypto.attestation.sev_snp import SevSnpVerifier
from crypto.attestation.sev_snp_attester import (
    VCEK_GUID, ConfigfsTsm, DeviceError, SevGuestIoctl, SevSnpAttester, make_cert_table, parse_cert_table,
)
from crypto.attestation.snp_testing import FakeConfigfsKernel, FakeSevGuestDevice, TestAmdChain


@pytest.fixture(scope="module")
def chip(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = TestAmdChain("Milan", rsa_bits=2048)
    d = tmp_path_factory.mktemp("chip")
    (d / "cert_chain.pem").write_bytes(c.cert_chain_pem())
    (d / "vcek.der").write_bytes(c.vcek_der())
    (d / "sev-guest").touch()  # the fake device node
    return c, d, SevSnpVerifier(c.verifier_config(d / "cert_chain.pem"))


def admit(verifier: SevSnpVerifier, attester: SevSnpAttester) -> None:
    nonce, key = os.urandom(32), os.urandom(32)
    evidence = attester.attest(nonce, key)
    result = appraise(evidence, nonce=nonce, public_key=key, verifiers={"amd-sev-snp": verifier},
                      policy=Policy(allowed_measurements={"measurement": ["a1" * 48]}))
    assert result.verifier == "amd-sev-snp" and result.debug is False


def test_ioctl_device(chip) -> None:  # type: ignore[no-untyped-def]
    c, d, verifier = chip
    device = FakeSevGuestDevice(c)
    attester = SevSnpAttester("coordinator", source=SevGuestIoctl(d / "sev-guest", ioctl=device.ioctl),
                              vcek_path=str(d / "vcek.der"))
    admit(verifier, attester)
    user_data, vmpl = device.requests[-1]
    assert vmpl == 0 and user_data[32:] == bytes(32) and len(user_data) == 64
    nonce, key = os.urandom(32), os.urandom(32)
    attester.attest(nonce, key)
    assert device.requests[-1][0] == binding(nonce, key) + bytes(32)  # what the guest asked the AMD-SP to sign


def test_ioctl_device_errors_are_reported(chip, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, d, _ = chip
    failing = SevSnpAttester("c", source=SevGuestIoctl(d / "sev-guest", ioctl=FakeSevGuestDevice(c, status=0x16).ioctl),
                             vcek_path=str(d / "vcek.der"))
    with pytest.raises(DeviceError, match="status 0x16"):
        failing.attest(os.urandom(32), os.urandom(32))
    with pytest.raises(DeviceError, match="cannot open"):
        SevSnpAttester("c", source=SevGuestIoctl(tmp_path / "absent")).attest(os.urandom(32), os.urandom(32))
    no_vcek = SevSnpAttester("c", source=SevGuestIoctl(d / "sev-guest", ioctl=FakeSevGuestDevice(c).ioctl))
    with pytest.raises(DeviceError, match="vcek_path") as exc:
        no_vcek.attest(os.urandom(32), os.urandom(32))
    assert exc.value.reason == "attester_device_error"


def test_configfs_tsm_with_the_hosts_certificate_table(chip, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, _, verifier = chip
    kernel = FakeConfigfsKernel(c)
    attester = SevSnpAttester("coordinator", source=ConfigfsTsm(tmp_path, mkdir=kernel.mkdir, rmdir=kernel.rmdir))
    admit(verifier, attester)  # no vcek_path: the VCEK came from auxblob
    assert kernel.entries and not any(e.exists() for e in kernel.entries)  # each request's entry removed
    assert not any(tmp_path.iterdir())


def test_configfs_auto_detection_and_a_foreign_provider(chip, tmp_path) -> None:  # type: ignore[no-untyped-def]
    att = create_attester("amd-sev-snp", "c", {"tsm_path": str(tmp_path), "device_path": "/nonexistent"})
    assert isinstance(att, SevSnpAttester) and isinstance(att.source, ConfigfsTsm)
    att2 = create_attester("amd-sev-snp", "c", {"tsm_path": str(tmp_path / "none"), "device_path": "/x"})
    assert isinstance(att2.source, SevGuestIoctl)  # type: ignore[attr-defined]
    c, _, _ = chip

    class TdxKernel(FakeConfigfsKernel):
        def mkdir(self, path):  # type: ignore[no-untyped-def]
            os.mkdir(path)
            (path / "provider").write_text("tdx_guest\n")

    k = TdxKernel(c)
    with pytest.raises(DeviceError, match="tdx_guest"):
        SevSnpAttester("c", source=ConfigfsTsm(tmp_path, mkdir=k.mkdir, rmdir=k.rmdir)).attest(b"n" * 32, b"k")


def test_cert_table_round_trip_and_bounds() -> None:
    other = uuid.uuid4()
    table = make_cert_table({VCEK_GUID: b"vcek-der", other: b"x" * 10})
    assert parse_cert_table(table) == {VCEK_GUID: b"vcek-der", other: b"x" * 10}
    broken = bytearray(table)
    broken[16:20] = (10**6).to_bytes(4, "little")
    with pytest.raises(DeviceError):
        parse_cert_table(bytes(broken))


def test_a_debug_guest_and_a_wrong_vcek_are_refused(chip, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, d, verifier = chip
    saved = TestAmdChain.save(c, tmp_path / "dbg", policy=0x30000 | 1 << 19)
    att = create_attester("amd-sev-snp-fake", "c", {"chip_dir": str(saved)})
    nonce, key = os.urandom(32), os.urandom(32)
    with pytest.raises(AttestationError) as exc:
        appraise(att.attest(nonce, key), nonce=nonce, public_key=key, verifiers={"amd-sev-snp": verifier},
                 policy=Policy(allowed_measurements={"measurement": ["a1" * 48]}))
    assert exc.value.reason == "debug_enabled"
    (tmp_path / "other.der").write_bytes(c.vcek_der(c.make_vcek(chip_id=os.urandom(64))))
    wrong = SevSnpAttester("c", source=SevGuestIoctl(d / "sev-guest", ioctl=FakeSevGuestDevice(c).ioctl),
                           vcek_path=str(tmp_path / "other.der"))
    with pytest.raises(AttestationError) as exc:
        verifier.verify(wrong.attest(nonce, key), nonce=nonce)
    assert exc.value.reason == "chip_id_mismatch"
