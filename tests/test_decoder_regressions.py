"""Explicit tests for decoder bugs that fuzzing (or reading the decoders for it) found in crypto/ and
that a corpus file cannot carry (typed record fields, Python-built objects), plus the proofs that
the fixes kept the results for valid input. Corpus-borne regressions: tests/fuzz_corpus/*/regress-*."""

from __future__ import annotations

import datetime as dt
import itertools
import os

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from crypto.attestation import AttestationError, AttestationGate, MalformedEvidence, Policy
from crypto.attestation.jws import Jwks
from crypto.attestation.models import Evidence, numeric_date, parse_evidence, unb64url
from crypto.envelope import Envelope, MalformedEnvelope, make_envelope, open_envelope
from crypto.pki import PartyRecord, PkiMaterialError, TrustStore
from crypto.pki.manifest import parse_signed_registry
from crypto.secagg import SecAggConfigError
from crypto.secagg.graph import choose_degree, neighbour_graph, neighbours_of, resolve_threshold, sparse_degree_ok

KEY = ed25519.Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
TRUST = TrustStore("fed", {"site-a": PartyRecord("site-a", "site", KEY.public_key())})


def _envelope() -> Envelope:
    return make_envelope(b"payload!", signing_key=KEY, federation_id="fed", run_id=1, round=1, site="site-a")


@pytest.mark.parametrize("field, value", [
    ("header", None), ("header", 2**40), ("header", "text"), ("signature", 2**40), ("signature", 1.5),
    ("body", None), ("body", 2**40), ("body", np.zeros(16, np.uint8)[::2]),
], ids=["header-None", "header-int", "header-str", "signature-int", "signature-float", "body-None", "body-int",
        "body-strided"])
def test_envelope_fields_of_any_type_are_malformed(field: str, value: object) -> None:
    """A message record can carry any type in each field; an int must not become bytes(n)."""
    env = _envelope()
    fields = {"header": env.header, "signature": env.signature, "body": env.body, field: value}
    with pytest.raises(MalformedEnvelope):
        open_envelope(Envelope(**fields), trust=TRUST, federation_id="fed")


def test_gate_takes_any_str_as_evidence_payload() -> None:
    """Evidence built from a Python dict may hold lone surrogates (JSON parsers refuse them)."""
    gate = AttestationGate({}, Policy())
    ev = Evidence(format="eat-jwt", attester="site-a", nonce="AAAA", public_key="AAAA", payload="\ud800")
    with pytest.raises(AttestationError):
        gate.admit("site-a", ev, public_key=b"k")


def test_parse_evidence_and_jwks_json_raise_malformed_evidence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for bad in (b"", b"[" * 5000, b'{"format": 1}', b"\xff"):
        with pytest.raises(MalformedEvidence):
            parse_evidence(bad)
    (tmp_path / "jwks.json").write_text("{not json")
    with pytest.raises(MalformedEvidence):
        Jwks.from_file(tmp_path / "jwks.json")


def test_unb64url_takes_only_the_url_safe_alphabet() -> None:
    assert unb64url("aGVsbG8") == b"hello"
    for bad in ("aGV!sbG8", "aGVsbG8=", "a", "aGVs bG8", "\u00e9\u00e9\u00e9\u00e9"):
        with pytest.raises(ValueError):
            unb64url(bad)


@pytest.mark.parametrize("value", [1e300, float("inf"), float("nan"), -1, 10**30, 253402300799, True, "1"])
def test_numeric_dates_out_of_range_are_malformed(value: object) -> None:
    with pytest.raises(MalformedEvidence):
        numeric_date(value, "exp")
    assert numeric_date(1_700_000_000, "exp") == dt.datetime.fromtimestamp(1_700_000_000, dt.timezone.utc)


def test_registry_signed_by_a_non_ec_ca_is_refused_not_asserted() -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not an EC CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)).sign(key, None))
    from fuzzing.fixtures import pki_files

    with pytest.raises(PkiMaterialError) as err:
        parse_signed_registry(pki_files()["coordinator"]["registry.json"], cert)
    assert err.value.reason == "bad_registry_signature"


def _reference_degree(n: int, neighbours: object, threshold: int | float, *p: float) -> int:
    """choose_degree's scan before the fix (every even k below n - 1), for comparison."""
    if neighbours != "auto":
        return -1
    return next((k for k in range(2, n - 1, 2)
                 if sparse_degree_ok(n, k, resolve_threshold(threshold, k + 1), *p)), n - 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold, sigma, eta, gamma, delta", [
    (3, 40, 20, 0.1, 0.1), (2, 20, 10, 0.05, 0.05), (5, 30, 20, 0.01, 0.2), (0.5, 40, 20, 0.1, 0.1),
    (0.3, 20, 10, 0.2, 0.1), (0.05, 40, 20, 0.1, 0.1), (0.9, 40, 30, 0.05, 0.05),
])
def test_degree_rule_unchanged_where_the_old_scan_did_not_crash(threshold, sigma, eta, gamma, delta) -> None:  # type: ignore[no-untyped-def]
    for n in itertools.chain(range(2, 80), range(80, 420, 49)):
        want = _reference_degree(n, "auto", threshold, sigma, eta, gamma, delta)
        if resolve_threshold(threshold, want + 1) > want + 1:  # impossible config at this n: refused either way
            with pytest.raises(SecAggConfigError):
                choose_degree(n, "auto", threshold, sigma, eta, gamma, delta)
            continue
        assert choose_degree(n, "auto", threshold, sigma, eta, gamma, delta)[0] == want, (n, threshold)


def test_degree_rule_is_bounded_for_a_huge_roster() -> None:
    """A server can claim any roster size; the old scan overflowed past ~1030 clients."""
    assert choose_degree(1 << 20, "auto", 3, 40, 20, 0.1, 0.1) == ((1 << 20) - 1, 3)
    assert choose_degree(1 << 20, "auto", 0.5, 40, 20, 0.1, 0.1)[0] < 100


@pytest.mark.parametrize("n, degree", [(2, 1), (7, 6), (12, 4), (31, 6), (64, 10)])
def test_one_neighbour_row_matches_the_whole_graph(n: int, degree: int) -> None:
    seed, roster = os.urandom(32), [3 * i + 1 for i in range(n)]
    graph = neighbour_graph(roster, degree, seed)
    assert all(neighbours_of(roster, degree, seed, u) == graph[u] for u in roster)
    with pytest.raises(ValueError):
        neighbours_of(roster, degree, seed, 0)
