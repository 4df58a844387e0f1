"""JWS on joserfc: explicit algorithm lists, pinned keys by kid, key type vs alg, crit, x5c to pinned roots."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from pydantic import ValidationError

from crypto.attestation import (
    BadCertificateChain, BadSignature, EatJwtVerifier, MalformedEvidence, UnknownSigningKey, UnsupportedAlgorithm,
    UnsupportedCriticalHeader, UntrustedRoot, WrongKeyType,
)
from crypto.attestation.jose import SUPPORTED_ALGS, Jwks, public_jwk, sign_jws, verify_jws
from crypto.attestation.models import b64url

NOW = dt.datetime.now(dt.timezone.utc)


def _hs256_with_public_key(pub_pem: bytes, claims: dict) -> str:
    """The classic confusion attack: HMAC keyed with the verifier's own public key bytes."""
    h = b64url(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    p = b64url(json.dumps(claims).encode())
    sig = hmac.new(pub_pem, f"{h}.{p}".encode(), hashlib.sha256).digest()
    return f"{h}.{p}.{b64url(sig)}"


@pytest.fixture(scope="module")
def es384() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP384R1())


@pytest.fixture(scope="module")
def jwks(es384) -> Jwks:  # type: ignore[no-untyped-def]
    return Jwks.from_dict({"keys": [public_jwk(es384, "k1", "ES384")]})


def test_valid_es384_token_verifies(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    header, claims = verify_jws(sign_jws({"a": 1}, es384, "ES384", "k1"), jwks, ["ES384"])
    assert claims == {"a": 1} and header["kid"] == "k1" and header["alg"] == "ES384"


def test_alg_none_hs256_and_jwe_are_refused(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    none_token = b64url(b'{"alg":"none","kid":"k1"}') + "." + b64url(b'{"iss":"x"}') + "."
    pem = es384.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for token in (none_token, _hs256_with_public_key(pem, {"iss": "x"})):
        with pytest.raises(UnsupportedAlgorithm) as exc:
            verify_jws(token, jwks, ["ES384"])
        assert exc.value.reason == "unsupported_algorithm"
    # even a verifier that lists everything it may list cannot be talked into HS256
    with pytest.raises(UnsupportedAlgorithm):
        verify_jws(_hs256_with_public_key(pem, {"iss": "x"}), jwks, SUPPORTED_ALGS)
    jwe = ".".join([b64url(b'{"alg":"PBES2-HS256+A128KW","enc":"A128GCM"}'), "AA", "AA", "AA", "AA"])
    with pytest.raises(UnsupportedAlgorithm):
        verify_jws(jwe, jwks, ["ES384"])


@pytest.mark.parametrize("algs", [["HS256"], ["none"], ["ES384", "HS512"], ["PBES2-HS256+A128KW"], []])
def test_verifier_configs_cannot_list_symmetric_or_none(algs: list[str]) -> None:
    with pytest.raises(ValidationError):
        EatJwtVerifier({"jwks": {"keys": []}, "issuer": "x", "algorithms": algs})


def test_unknown_kid_and_wrong_key_type(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnknownSigningKey) as exc:
        verify_jws(sign_jws({"a": 1}, es384, "ES384", "other"), jwks, ["ES384"])
    assert exc.value.reason == "unknown_signing_key"
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_jwk = {k: v for k, v in public_jwk(rsa_key, "k1", "RS256").items() if k != "alg"}  # names no alg
    rsa_jwks = Jwks.from_dict({"keys": [rsa_jwk]})
    with pytest.raises(WrongKeyType) as exc2:  # an RSA key offered for ES384
        verify_jws(sign_jws({"a": 1}, es384, "ES384", "k1"), rsa_jwks, ["ES384"])
    assert exc2.value.reason == "wrong_key_type"
    p256 = ec.generate_private_key(ec.SECP256R1())  # right type, wrong curve
    with pytest.raises(WrongKeyType):
        verify_jws(sign_jws({"a": 1}, es384, "ES384", "k1"), Jwks.from_dict({"keys": [public_jwk(p256, "k1", "ES256")]}),
                   ["ES384"])


def test_forged_signature(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    h, _, s = sign_jws({"a": 1}, es384, "ES384", "k1").split(".")
    with pytest.raises(BadSignature):
        verify_jws(h + "." + b64url(b'{"a":2}') + "." + s, jwks, ["ES384"])


def test_crit_is_enforced(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    token = sign_jws({"a": 1}, es384, "ES384", "k1", header={"crit": ["exp-ext"], "exp-ext": 5})
    with pytest.raises(UnsupportedCriticalHeader) as exc:
        verify_jws(token, jwks, ["ES384"])
    assert exc.value.reason == "unsupported_critical_header"
    assert verify_jws(token, jwks, ["ES384"], understood_crit=["exp-ext"])[1] == {"a": 1}
    b64 = sign_jws({"a": 1}, es384, "ES384", "k1", header={"crit": ["b64"], "b64": True})
    with pytest.raises(UnsupportedCriticalHeader):
        verify_jws(b64, jwks, ["ES384"])


# -- x5c chains ----------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, days: int = 30):  # type: ignore[no-untyped-def]
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(NOW - dt.timedelta(days=1)).not_valid_after(NOW + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    return b.sign(issuer_key, hashes.SHA384())


def _pki(name: str):  # type: ignore[no-untyped-def]
    root_key, int_key, leaf_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(3))
    root = _cert(f"{name} root", root_key, f"{name} root", root_key, ca=True)
    inter = _cert(f"{name} int", int_key, f"{name} root", root_key, ca=True)
    leaf = _cert(f"{name} token signer", leaf_key, f"{name} int", int_key, ca=False)
    x5c = [base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode() for c in (leaf, inter)]
    return root, leaf_key, x5c


def test_x5c_chain_must_end_at_a_pinned_root() -> None:
    root, leaf_key, x5c = _pki("svc")
    other_root, other_leaf_key, other_x5c = _pki("rogue")
    token = sign_jws({"a": 1}, leaf_key, "ES384", header={"x5c": x5c})
    assert verify_jws(token, None, ["ES384"], x5c_roots=[root], now=NOW)[1] == {"a": 1}
    rogue = sign_jws({"a": 1}, other_leaf_key, "ES384", header={"x5c": other_x5c})
    with pytest.raises(UntrustedRoot) as exc:  # the token's own chain never supplies the anchor
        verify_jws(rogue, None, ["ES384"], x5c_roots=[root], now=NOW)
    assert exc.value.reason == "untrusted_root"
    with pytest.raises((UntrustedRoot, BadCertificateChain)):  # chain expired by then
        verify_jws(token, None, ["ES384"], x5c_roots=[root], now=NOW + dt.timedelta(days=400))
    # a chain from the pinned PKI but the token signed by another key
    forged = sign_jws({"a": 1}, other_leaf_key, "ES384", header={"x5c": x5c})
    with pytest.raises(BadSignature):
        verify_jws(forged, None, ["ES384"], x5c_roots=[root], now=NOW)
    with pytest.raises(UnknownSigningKey):  # x5c but nothing pinned for it: never trusted as is
        verify_jws(token, None, ["ES384"], now=NOW)


def test_a_second_spelling_of_the_signature_is_refused(es384, jwks) -> None:  # type: ignore[no-untyped-def]
    """ES384 signatures are 96 bytes (no unused bits); an RS256 one is 256 bytes: its last base64url
    character carries 4 unused bits, which must be zero."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rjwks = Jwks.from_dict({"keys": [public_jwk(key, "r", "RS256")]})
    token = sign_jws({"a": 1}, key, "RS256", "r")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(token[-1])
    assert last & 0xF == 0
    other = token[:-1] + alphabet[last | 1]
    assert verify_jws(token, rjwks, ["RS256"])[1] == {"a": 1}
    with pytest.raises(MalformedEvidence):
        verify_jws(other, rjwks, ["RS256"])


@pytest.mark.parametrize("part", [0, 1], ids=["header", "payload"])
def test_a_second_spelling_of_the_header_or_payload_is_refused(es384, jwks, part) -> None:  # type: ignore[no-untyped-def]
    """A header or payload whose last base64url character has unused bits set decodes to the same
    JSON; it is refused as malformed evidence, never a ValueError (found by the NRAS mutation test)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    for claims in ({"a": 1}, {"a": 12}, {"ab": 123}):  # one of these lengths leaves unused bits
        parts = sign_jws(claims, es384, "ES384", "k1").split(".")
        if len(parts[part]) % 4 == 0:
            continue
        last = alphabet.index(parts[part][-1])
        spare = 0xF if len(parts[part]) % 4 == 2 else 0x3
        assert last & spare == 0
        parts[part] = parts[part][:-1] + alphabet[last | 1]
        with pytest.raises(MalformedEvidence):
            verify_jws(".".join(parts), jwks, ["ES384"])
        return
    pytest.fail("no test token has a part with unused bits")
