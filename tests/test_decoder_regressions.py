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
from crypto.attestation.jose import Jwks
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


# ---- federation/protocol (found by tests/fuzzing/protocol_targets.py) -----------------------------------


def _npy_array(shape, dtype: str = "<f4", body: bytes = b"\0" * 16):
    from flwr.app import Array

    from fuzzing.protocol_targets import npy_bytes

    return Array(dtype=str(np.dtype(dtype)), shape=tuple(shape), stype="numpy.ndarray", data=npy_bytes(shape, dtype, body))


@pytest.mark.parametrize("shape", [(2**40,), (2**32, 2**32, 2**32), (-1,), (2**63 - 1,)],
                         ids=["2**40", "wraps-to-0", "negative", "int64-max"])
def test_record_array_claiming_a_huge_size_is_refused_before_allocation(shape) -> None:
    """Flower's Array.numpy() (np.load) allocated the size a .npy header claims before reading a byte
    (MemoryError for 4 TiB, or a lazily mapped 16 GiB); from_records now checks the claim first."""
    import tracemalloc

    from flwr.app import ArrayRecord, RecordDict

    from federation.protocol.payload_records import MalformedRecord, from_records

    rd = RecordDict({"arrays": ArrayRecord({"w": _npy_array(shape)})})
    tracemalloc.start()
    try:
        for copy in (True, False):
            with pytest.raises(MalformedRecord, match="malformed_array"):
                from_records(rd, copy=copy)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_record_array_header_that_does_not_tokenize_is_malformed() -> None:
    """numpy's header parser raised tokenize.TokenError (not a ValueError) on an unclosed bracket."""
    from flwr.app import Array, ArrayRecord, RecordDict

    from federation.protocol.payload_records import MalformedRecord, from_records

    text = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1,"
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    data = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + b"\0" * 4
    rd = RecordDict({"arrays": ArrayRecord({"w": Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=data)})})
    with pytest.raises(MalformedRecord):
        from_records(rd)


def test_record_arrays_of_valid_input_decode_as_before() -> None:
    """The checked parse returns what Array.numpy() did, C and Fortran order, and views read-only."""
    from flwr.app import Array, ArrayRecord, RecordDict

    from federation.protocol.payload_records import from_records, to_array

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    rd = RecordDict({"arrays": ArrayRecord({"c": to_array(a), "f": Array(np.asfortranarray(a)),
                                            "z": to_array(np.float32(2.5)), "e": to_array(np.zeros((0, 3), np.int8))})})
    for copy in (True, False):
        got = from_records(rd, copy=copy).arrays
        for k in ("c", "f"):
            assert np.array_equal(got[k], a) and got[k].dtype == a.dtype
        assert got["z"].shape == () and got["z"] == np.float32(2.5) and got["e"].shape == (0, 3)
    assert not from_records(rd, copy=False).arrays["c"].flags.writeable


@pytest.mark.parametrize("value", [2**40, "text", 1.5], ids=["int", "str", "float"])
def test_update_envelope_fields_of_another_type_are_rejected(value) -> None:
    """envelope_of called bytes() on the signed-update metadata: an int asked for that many bytes
    (2**40: 1 TiB), a str raised TypeError. Now both are `malformed` updates."""
    from federation.protocol.envelope_layout import ARRAY, HEADER, SIGNATURE, envelope_of
    from federation.protocol.pipeline import Payload, UpdateRejected

    for field in (HEADER, SIGNATURE):
        meta = {HEADER: b"h", SIGNATURE: b"s", field: value}
        with pytest.raises(UpdateRejected, match="malformed"):
            envelope_of(Payload({ARRAY: np.zeros(4, np.uint8)}, meta))
    with pytest.raises(UpdateRejected, match="malformed"):
        envelope_of(Payload({ARRAY: np.zeros(4, np.float32)}, {HEADER: b"h", SIGNATURE: b"s"}))


@pytest.mark.parametrize("layout", [[["w", "<f4", [2**32, 2**32], 0]], [["w", "<f4", [2**70], 0]],
                                    [["w", "<f4", [-1, -4], 0]], [["w", ["<f4"], [1], 0]], [["w", "<f4", [1], 2**70]],
                                    [["w", "f4,(,)", [1], 0]], [["w", "(2,)f4", [1], 0]]],
                         ids=["wraps-to-0", "beyond-int64", "negative-dims", "dtype-list", "offset-beyond-int64",
                              "dtype-comma-string", "dtype-subarray"])
def test_signed_layout_with_hostile_shapes_is_malformed(layout) -> None:
    """unpack computed sizes with np.prod(int64): (2**32, 2**32) wrapped to 0, 2**70 raised
    OverflowError, and np.dtype("f4,(,)") raised SyntaxError (numpy parses comma strings with ast;
    found by the 100k soak); now Python ints, non-negative dims and plain dtype strings, or `malformed`."""
    import json

    from federation.protocol.envelope_layout import from_inner
    from federation.protocol.pipeline import UpdateRejected

    with pytest.raises(UpdateRejected, match="malformed"):
        from_inner(np.zeros(64, np.uint8), json.dumps({"layout": layout, "meta": {}}).encode())


def test_signed_layout_nested_too_deep_is_malformed() -> None:
    """json.loads raised RecursionError on deeply nested signed metadata."""
    from federation.protocol.envelope_layout import from_inner
    from federation.protocol.pipeline import UpdateRejected

    with pytest.raises(UpdateRejected, match="malformed"):
        from_inner(np.zeros(4, np.uint8), b"[" * 100_000 + b"]" * 100_000)


def test_secagg_request_and_reply_with_infinite_round_are_malformed() -> None:
    """int(float('inf')) raised OverflowError out of Request.parse and check_reply."""
    from flwr.app import ConfigRecord, RecordDict

    from crypto.secagg import MalformedMessageError
    from federation.protocol import message_keys as keys
    from federation.protocol.secagg_records import Request, check_reply
    from fuzzing.protocol_targets import FLOWER_RUN, _message, _secagg_ctx

    rec = ConfigRecord({"stage": keys.UNMASK, "round": float("inf"), "run": f"f/{FLOWER_RUN}", "graph_seed": b"\0" * 32,
                        "config": "{}", "request": b"", "ctx": b"\0" * 32})
    msg = _message(RecordDict({keys.SECAGG: rec}), FLOWER_RUN)
    with pytest.raises(MalformedMessageError):
        Request.parse(msg)
    with pytest.raises(MalformedMessageError):
        check_reply(msg, keys.UNMASK, _secagg_ctx())


def test_masked_chunk_claiming_a_huge_size_is_refused_before_allocation() -> None:
    """parse_chunks checked Flower's dtype/shape fields, then Array.numpy() allocated what the .npy
    header claimed (caught afterwards); now the header is checked before anything is allocated."""
    import tracemalloc

    from flwr.app import ArrayRecord, RecordDict

    from crypto.secagg import MalformedMessageError
    from federation.protocol import message_keys as keys
    from federation.protocol.secagg_records import chunk_key, parse_chunks
    from fuzzing.protocol_targets import _message

    rd = RecordDict({keys.SECAGG_CHUNKS: ArrayRecord({chunk_key(0): _npy_array((2**40,), "|u1")})})
    tracemalloc.start()
    try:
        with pytest.raises(MalformedMessageError, match="does not parse"):
            parse_chunks(_message(rd), 8, 13)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("value", ["many", float("inf"), float("nan"), 2.5, b"9", True, None, [1], -1, 2**60],
                         ids=["str", "inf", "nan", "fraction", "bytes", "bool", "missing", "list", "negative", "huge"])
def test_status_num_examples_of_any_type_is_a_counted_rejection(value) -> None:
    """The coordinator read `int(status["num_examples"])`: a hostile site's string, inf or NaN raised
    ValueError/OverflowError out of the round (only UpdateRejected is counted). Now `bad_status`."""
    from federation.protocol.pipeline import UpdateRejected
    from federation.protocol.status_record import num_examples

    status = {"site": "a"} if value is None else {"site": "a", "num_examples": value}
    with pytest.raises(UpdateRejected, match="bad_status"):
        num_examples(status)


def test_status_fields_of_valid_replies_read_as_before() -> None:
    from federation.protocol.status_record import num_examples, site_name

    assert num_examples({"num_examples": 900}) == 900 and num_examples({"num_examples": 900.0}) == 900
    assert site_name({"site": "paris"}) == "paris"
    with pytest.raises(ValueError, match="bad_status"):
        site_name({"site": 7})


@pytest.mark.parametrize("value", [None, "0.5", True, 0, -1.0, float("nan"), float("inf"), 1e9, [0.5]])
def test_a_discovery_step_estimate_that_is_not_a_positive_finite_number_is_none(value) -> None:
    """A site's `step_s_estimate` (its trainer's seconds per step at start-up) plans round 1; one that
    is missing or malformed leaves that round to the sites' own local_steps instead of raising."""
    from federation.protocol.status_record import step_s_estimate

    assert step_s_estimate({} if value is None else {"step_s_estimate": value}) is None
    assert step_s_estimate({"step_s_estimate": 0.25}) == 0.25 and step_s_estimate({"step_s_estimate": 2}) == 2.0
