"""amd-sev-snp: the genuine Milan report and VCEK under AMD's real ARK/ASK, a test chain in the same
formats for the cases real evidence cannot show, every single-bit flip refused, and hypothesis mutations."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto.attestation import AttestationError, Evidence, Policy, appraise, create_verifier
from crypto.attestation.models import b64url, binding
from crypto.attestation.sev_snp import (
    REPORT_SIZE, SevSnpVerifier, SnpReport, packaged_ark_fingerprints, snp_evidence_payload,
)
from crypto.attestation.snp_testing import TestAmdChain

# ../shared/fixtures/attestation from the repository root (CI checks shared/ out beside the clone)
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "attestation"
SEV = FIXTURES / "virtee-sev"
MILAN_TIME = dt.datetime(2026, 6, 1, tzinfo=dt.timezone.utc)  # inside every Milan certificate's validity


def _need_fixtures() -> None:
    assert SEV.is_dir(), f"genuine fixtures missing: expected {SEV} (shared/ beside the repository)"


def raw_pub() -> bytes:
    return x25519.X25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def evidence(report: bytes, vcek: bytes, nonce: bytes, key: bytes, party: str = "coordinator") -> Evidence:
    return Evidence(format="amd-sev-snp", attester=party, nonce=b64url(nonce), public_key=b64url(key),
                    payload=snp_evidence_payload(report, vcek))


# -- genuine evidence ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def milan() -> tuple[SevSnpVerifier, bytes, bytes]:
    _need_fixtures()
    verifier = create_verifier("amd-sev-snp", {"cert_chain_paths": [str(SEV / "cert_chain_milan")]})
    assert isinstance(verifier, SevSnpVerifier)
    return verifier, (SEV / "report_milan.bin").read_bytes(), (SEV / "vcek_milan.der").read_bytes()


def test_packaged_ark_pins_are_amds_roots() -> None:
    _need_fixtures()
    from cryptography import x509
    for product in ("milan", "genoa", "turin"):  # the pins are over each certificate's DER
        cert = x509.load_pem_x509_certificate((SEV / "builtin" / product / "ark.pem").read_bytes())
        assert hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest() == \
            packaged_ark_fingerprints()[product.capitalize()]
    for name in ("milan", "turin"):  # each KDS cert_chain is accepted as configuration
        v = SevSnpVerifier({"cert_chain_paths": [str(SEV / f"cert_chain_{name}")]})
        assert v.chains[0].product.lower() == name


def test_genuine_milan_report_passes_chain_and_signature_then_fails_the_nonce(milan) -> None:  # type: ignore[no-untyped-def]
    verifier, report, vcek = milan
    parsed = SnpReport.parse(report)
    assert parsed.vmpl == 0 and not parsed.debug and parsed.reported_tcb.hex() == "0300000000000873"
    # chain, TCB and chip ID of the genuine VCEK: accepted
    from crypto.attestation.sev_snp import load_cert
    chain, ext = verifier.check_vcek(load_cert(vcek, "vcek"), MILAN_TIME)
    assert chain.product == "Milan" and ext["hwid"] == parsed.chip_id and ext["spl"] == parsed.tcb("milan")
    nonce = os.urandom(32)
    with pytest.raises(AttestationError) as exc:
        verifier.verify(evidence(report, vcek, nonce, raw_pub()), nonce=nonce, now=MILAN_TIME)
    # REPORT_DATA answers someone else's nonce: the signature verified, the binding did not
    assert exc.value.reason == "nonce_mismatch", exc.value
    assert "REPORT_DATA" in str(exc.value)


def test_genuine_milan_vcek_with_a_turin_chain_or_expired_is_refused(milan) -> None:  # type: ignore[no-untyped-def]
    _, report, vcek = milan
    turin = SevSnpVerifier({"cert_chain_paths": [str(SEV / "cert_chain_turin")]})
    nonce = os.urandom(32)
    with pytest.raises(AttestationError) as exc:
        turin.verify(evidence(report, vcek, nonce, raw_pub()), nonce=nonce, now=MILAN_TIME)
    assert exc.value.reason == "untrusted_root"
    verifier = milan[0]
    with pytest.raises(AttestationError) as exc:
        verifier.verify(evidence(report, vcek, nonce, raw_pub()), nonce=nonce,
                        now=dt.datetime(2031, 1, 1, tzinfo=dt.timezone.utc))
    assert exc.value.reason == "bad_certificate_chain"
    # the Turin VCEK (genuine, under its genuine chain) is not the chip that signed the Milan report
    both = SevSnpVerifier({"cert_chain_paths": [str(SEV / "cert_chain_milan"), str(SEV / "cert_chain_turin")]})
    with pytest.raises(AttestationError) as exc:
        both.verify(evidence(report, (SEV / "vcek_turin.der").read_bytes(), nonce, raw_pub()), nonce=nonce,
                    now=MILAN_TIME)
    assert exc.value.reason in {"bad_signature", "tcb_mismatch", "chip_id_mismatch"}


def test_an_unpinned_root_is_refused_at_configuration(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _need_fixtures()
    with pytest.raises(ValueError, match="not pinned"):
        SevSnpVerifier({"cert_chain_paths": [str(SEV / "cert_chain_milan")], "ark_fingerprints": {"Milan": "00" * 32}})
    chain = TestAmdChain(rsa_bits=2048)
    (tmp_path / "chain.pem").write_bytes(chain.cert_chain_pem())
    with pytest.raises(ValueError, match="not pinned"):  # a test ARK is not one of AMD's
        SevSnpVerifier({"cert_chain_paths": [str(tmp_path / "chain.pem")]})


def test_every_single_bit_flip_of_the_genuine_report_is_refused_before_the_nonce(milan) -> None:  # type: ignore[no-untyped-def]
    """9472 flips; each must fail on format or signature (never reach the nonce check, never be accepted)."""
    verifier, report, vcek = milan
    nonce, key = os.urandom(32), raw_pub()
    reasons: dict[str, int] = {}
    for i in range(REPORT_SIZE * 8):
        flipped = bytearray(report)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(AttestationError) as exc:
            verifier.verify(evidence(bytes(flipped), vcek, nonce, key), nonce=nonce, now=MILAN_TIME)
        assert exc.value.reason != "nonce_mismatch", f"bit {i} flipped reached the nonce check"
        reasons[exc.value.reason] = reasons.get(exc.value.reason, 0) + 1
    assert reasons["bad_signature"] > 5000 and "signature_out_of_range" in reasons, reasons


def test_every_single_bit_flip_of_the_genuine_vcek_is_refused_before_the_nonce(milan) -> None:  # type: ignore[no-untyped-def]
    verifier, report, vcek = milan
    nonce, key = os.urandom(32), raw_pub()
    for i in range(len(vcek) * 8):
        flipped = bytearray(vcek)
        flipped[i // 8] ^= 1 << (i % 8)
        with pytest.raises(AttestationError) as exc:
            verifier.verify(evidence(report, bytes(flipped), nonce, key), nonce=nonce, now=MILAN_TIME)
        assert exc.value.reason != "nonce_mismatch", f"VCEK bit {i} flipped reached the nonce check"


# -- a test chain in AMD's formats -----------------------------------------------------------------

@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[TestAmdChain, SevSnpVerifier]:  # type: ignore[no-untyped-def]
    c = TestAmdChain("Milan")
    d = tmp_path_factory.mktemp("amd")
    (d / "cert_chain.pem").write_bytes(c.cert_chain_pem())
    return c, SevSnpVerifier(c.verifier_config(d / "cert_chain.pem"))


def test_test_chain_report_is_admitted_with_measurements(chain) -> None:  # type: ignore[no-untyped-def]
    c, verifier = chain
    nonce, key = os.urandom(32), raw_pub()
    report = c.report(binding(nonce, key) + bytes(32), host_data=b"\x07" * 32)
    policy = Policy(allowed_measurements={"measurement": ["a1" * 48], "host_data": ["07" * 32]})
    result = appraise(evidence(report, c.vcek_der(), nonce, key), nonce=nonce, public_key=key,
                      verifiers={"amd-sev-snp": verifier}, policy=policy)
    assert result.debug is False and result.measurements["measurement"] == "a1" * 48
    assert result.claims["product"] == "Milan" and result.claims["vmpl"] == 0


def _reason(chain, report: bytes, *, vcek: bytes | None = None, nonce: bytes, key: bytes,  # type: ignore[no-untyped-def]
            policy: Policy | None = None) -> str:
    c, verifier = chain
    with pytest.raises(AttestationError) as exc:
        appraise(evidence(report, vcek or c.vcek_der(), nonce, key), nonce=nonce, public_key=key,
                 verifiers={"amd-sev-snp": verifier},
                 policy=policy or Policy(allowed_measurements={"measurement": ["a1" * 48]}))
    return exc.value.reason


def test_each_bad_case_has_its_reason(chain) -> None:  # type: ignore[no-untyped-def]
    c, _ = chain
    nonce, key = os.urandom(32), raw_pub()
    good_data = binding(nonce, key) + bytes(32)
    good = c.report(good_data)
    assert _reason(chain, good[:-1], nonce=nonce, key=key) == "malformed_evidence"  # wrong length
    assert _reason(chain, good + b"\0", nonce=nonce, key=key) == "malformed_evidence"
    r_high = bytearray(good)
    r_high[0x2A0 + 60] = 1  # a byte above the 48 of a P-384 scalar
    assert _reason(chain, bytes(r_high), nonce=nonce, key=key) == "signature_out_of_range"
    s_zero = bytearray(good)
    s_zero[0x2A0 + 72:0x2A0 + 144] = bytes(72)
    assert _reason(chain, bytes(s_zero), nonce=nonce, key=key) == "signature_out_of_range"
    n_le = bytearray(good)  # r = n, the order of P-384: out of range
    n_le[0x2A0:0x2A0 + 48] = (0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF581A0DB248B0A77AECEC196ACCC52973
                              ).to_bytes(48, "little")
    assert _reason(chain, bytes(n_le), nonce=nonce, key=key) == "signature_out_of_range"
    other_chip = c.vcek_der(c.make_vcek(chip_id=os.urandom(64)))
    assert _reason(chain, good, vcek=other_chip, nonce=nonce, key=key) == "chip_id_mismatch"
    other_tcb = c.vcek_der(c.make_vcek(tcb={**c.tcb, "snp": 9}))
    assert _reason(chain, good, vcek=other_tcb, nonce=nonce, key=key) == "tcb_mismatch"
    stranger = TestAmdChain("Milan", rsa_bits=2048)  # same names, another (unpinned) ARK and ASK
    assert _reason(chain, stranger.report(good_data), vcek=stranger.vcek_der(), nonce=nonce,
                   key=key) == "bad_certificate_chain"
    assert _reason(chain, c.report(good_data, signing_key=ec.generate_private_key(ec.SECP384R1())),
                   nonce=nonce, key=key) == "bad_signature"
    assert _reason(chain, c.report(binding(os.urandom(32), key) + bytes(32)), nonce=nonce, key=key) == "nonce_mismatch"
    assert _reason(chain, c.report(binding(nonce, raw_pub()) + bytes(32)), nonce=nonce, key=key) == "nonce_mismatch"
    assert _reason(chain, c.report(binding(nonce, key) + b"\1" * 32), nonce=nonce, key=key) == "nonce_mismatch"
    assert _reason(chain, c.report(good_data, vmpl=1), nonce=nonce, key=key) == "vmpl_not_allowed"
    assert _reason(chain, c.report(good_data, policy=0x30000 | 1 << 19), nonce=nonce, key=key) == "debug_enabled"
    assert _reason(chain, c.report(good_data, measurement=b"\x66" * 48), nonce=nonce,
                   key=key) == "measurement_not_allowed"
    assert _reason(chain, c.report(good_data, version=1), nonce=nonce, key=key) == "malformed_evidence"
    alg = bytearray(good)
    alg[0x34] = 2
    assert _reason(chain, bytes(alg), nonce=nonce, key=key) == "unsupported_algorithm"


def test_min_tcb(chain, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, _ = chain
    (tmp_path / "chain.pem").write_bytes(c.cert_chain_pem())
    strict = SevSnpVerifier(c.verifier_config(tmp_path / "chain.pem", min_tcb={"snp": 9}))
    nonce, key = os.urandom(32), raw_pub()
    with pytest.raises(AttestationError) as exc:
        strict.verify(evidence(c.report(binding(nonce, key) + bytes(32)), c.vcek_der(), nonce, key), nonce=nonce)
    assert exc.value.reason == "tcb_too_old"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_evidence_is_never_accepted_and_never_crashes(chain, data) -> None:  # type: ignore[no-untyped-def]
    c, verifier = chain
    nonce, key = b"\x05" * 32, b"\x06" * 32
    report, vcek = _VALID.setdefault("r", c.report(binding(nonce, key) + bytes(32))), c.vcek_der()
    target = data.draw(st.sampled_from(["report", "vcek", "payload"]))
    original = {"report": report, "vcek": vcek, "payload": snp_evidence_payload(report, vcek).encode()}[target]
    blob = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    if blob == original:  # two flips that cancel
        return
    if target == "report":
        ev = evidence(bytes(blob), vcek, nonce, key)
    elif target == "vcek":
        ev = evidence(report, bytes(blob), nonce, key)
    else:
        ev = Evidence(format="amd-sev-snp", attester="c", nonce=b64url(nonce), public_key=b64url(key),
                      payload=blob.decode("utf-8", "replace"))
        if _parses(ev.payload) and json.loads(ev.payload) == json.loads(snp_evidence_payload(report, vcek)):
            return  # a mutation that leaves the same JSON value (whitespace) is the same evidence
    with pytest.raises(AttestationError):
        verifier.verify(ev, nonce=nonce)


_VALID: dict[str, bytes] = {}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_verifiers_are_registered_entry_points() -> None:
    """pyproject.toml registers each verifier in sovereign_fl.verifiers, and each name builds its class."""
    import tomllib

    from crypto.attestation import available_verifiers, load_verifier_class
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]["sovereign_fl.verifiers"]
    for name in ("amd-sev-snp", "azure-maa", "eat-jwt", "nvidia-nras"):
        assert name in eps and name in available_verifiers()
        module, _, cls = eps[name].partition(":")
        assert load_verifier_class(name).__name__ == cls and load_verifier_class(name).__module__ == module
    assert "attestation/data/*.json" in project["tool"]["setuptools"]["package-data"]["crypto"]
    from crypto.attestation.attester import ATTESTER_ENTRY_POINT_GROUP, BUILTIN_ATTESTERS
    for name in ("amd-sev-snp", "nvidia-nras"):
        assert project["project"]["entry-points"][ATTESTER_ENTRY_POINT_GROUP][name] == BUILTIN_ATTESTERS[name]
