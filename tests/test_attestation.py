"""RATS admission: verifier-made nonces, EAT JWT verification, policy, replay, plug-ins."""

from __future__ import annotations

import logging
import time
from importlib.metadata import EntryPoint

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519

from crypto.attestation import (
    ATTESTER_ENTRY_POINT_GROUP, Attester, UnknownAttester, available_attesters, create_attester,
)
from crypto.attestation import (
    AttestationGate, BadSignature, DebugEnabled, EatJwtVerifier, Evidence, InsecureDevAttester, InsecureVerifierRefused,
    KeyBindingMismatch, MalformedEvidence, MeasurementNotAllowed, NonceMismatch, Policy, ReplayedToken, TokenExpired,
    TokenTooOld, UnknownSigningKey, UnsupportedAlgorithm, Verifier, WrongAudience, WrongIssuer, create_verifier,
    verify_jws,
)
from crypto.attestation import plugins as plugins_mod
from crypto.attestation import verifier as verifier_mod
from crypto.attestation.jose import Jwks, sign_jws
from crypto.attestation.models import b64url
from crypto.attestation.testing import GOOD_MEASUREMENT, LocalTokenAttester, LocalTokenIssuer


def raw_pub() -> bytes:
    return x25519.X25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@pytest.fixture(scope="module")
def issuer() -> LocalTokenIssuer:
    return LocalTokenIssuer()


def make_gate(issuer: LocalTokenIssuer, **policy: object) -> AttestationGate:
    verifier = create_verifier("eat-jwt", issuer.verifier_config())
    return AttestationGate({"eat-jwt": verifier}, Policy(allowed_measurements={"measurement": [GOOD_MEASUREMENT]}, **policy))


def test_admission_happy_path(issuer: LocalTokenIssuer) -> None:
    gate, key = make_gate(issuer), raw_pub()
    ch = gate.challenge("site-a")
    ev = LocalTokenAttester("site-a", issuer).attest(ch.nonce_bytes(), key)
    result = gate.admit("site-a", ev, public_key=key)
    assert result.measurements["measurement"] == GOOD_MEASUREMENT and result.debug is False
    assert result.valid_at() and result.issuer == issuer.issuer


def test_reverse_direction_site_verifies_coordinator_seal_key(issuer: LocalTokenIssuer) -> None:
    """The site challenges the coordinator, which binds its X25519 sealing key; only then seal."""
    site_gate, coord_seal_pub = make_gate(issuer), raw_pub()
    ch = site_gate.challenge("coordinator")
    ev = LocalTokenAttester("coordinator", issuer).attest(ch.nonce_bytes(), coord_seal_pub)
    assert site_gate.admit("coordinator", ev, public_key=coord_seal_pub).key_hash
    with pytest.raises(KeyBindingMismatch):  # a different key from the bundle -> refuse to seal
        ch2 = site_gate.challenge("coordinator")
        ev2 = LocalTokenAttester("coordinator", issuer).attest(ch2.nonce_bytes(), coord_seal_pub)
        site_gate.admit("coordinator", ev2, public_key=raw_pub())


@pytest.mark.parametrize("alg", ["ES256", "ES384", "RS256", "PS256", "EdDSA"])
def test_jws_algorithms(alg: str) -> None:
    iss = LocalTokenIssuer(alg=alg, kid=f"k-{alg}")
    token = sign_jws({"iss": "x", "n": 1}, iss.key, alg, iss.kid)
    _, claims = verify_jws(token, Jwks.from_dict(iss.jwks()), [alg])
    assert claims == {"iss": "x", "n": 1}
    with pytest.raises(UnsupportedAlgorithm):
        verify_jws(token, Jwks.from_dict(iss.jwks()), ["ES512"])


def test_alg_none_and_garbage_refused(issuer: LocalTokenIssuer) -> None:
    jwks = Jwks.from_dict(issuer.jwks())
    none_token = b64url(b'{"alg":"none"}') + "." + b64url(b'{"iss":"x"}') + "."
    with pytest.raises(UnsupportedAlgorithm):
        verify_jws(none_token, jwks, ["ES256"])
    for junk in ["", "a.b", "a.b.c.d", "!!.??.**"]:
        with pytest.raises(MalformedEvidence):
            verify_jws(junk, jwks, ["ES256"])


# -- the negative cases, one each, each with its own reason -----------------------------------


def _admit(gate: AttestationGate, issuer: LocalTokenIssuer, party: str = "site-a", key: bytes | None = None,
           present_key: bytes | None = None, nonce: bytes | None = None, token_key: bytes | None = None,
           **mint: object) -> None:
    key = key or raw_pub()
    ch = gate.challenge(party)
    n = ch.nonce_bytes()
    token = issuer.mint(nonce=nonce or n, public_key=token_key or key, **mint)  # type: ignore[arg-type]
    ev = Evidence(format="eat-jwt", attester=party, nonce=b64url(n), public_key=b64url(key), payload=token)
    gate.admit(party, ev, public_key=present_key or key)


def test_wrong_nonce(issuer: LocalTokenIssuer) -> None:
    with pytest.raises(NonceMismatch) as exc:
        _admit(make_gate(issuer), issuer, nonce=b"\x01" * 32)
    assert exc.value.reason == "nonce_mismatch"


def test_nonce_not_issued_by_this_verifier(issuer: LocalTokenIssuer) -> None:
    gate, key, n = make_gate(issuer), raw_pub(), b"\x02" * 32  # attester-made nonce (NVFlare's flaw)
    ev = Evidence(format="eat-jwt", attester="site-a", nonce=b64url(n), public_key=b64url(key),
                  payload=issuer.mint(nonce=n, public_key=key))
    with pytest.raises(NonceMismatch):
        gate.admit("site-a", ev, public_key=key)


def test_expired_token(issuer: LocalTokenIssuer) -> None:
    with pytest.raises(TokenExpired) as exc:
        _admit(make_gate(issuer), issuer, iat=time.time() - 3600, lifetime_s=600)
    assert exc.value.reason == "token_expired"


def test_token_too_old_for_policy(issuer: LocalTokenIssuer) -> None:
    with pytest.raises(TokenTooOld):
        _admit(make_gate(issuer, max_token_age_s=30, clock_skew_s=5), issuer, iat=time.time() - 120, lifetime_s=3600)


def test_bad_signature(issuer: LocalTokenIssuer) -> None:
    gate, key = make_gate(issuer), raw_pub()
    ch = gate.challenge("site-a")
    h, p, s = issuer.mint(nonce=ch.nonce_bytes(), public_key=key).split(".")
    forged = h + "." + b64url(b'{"iss":"https://attestation.test","measurement":"evil"}') + "." + s
    ev = Evidence(format="eat-jwt", attester="site-a", nonce=ch.nonce, public_key=b64url(key), payload=forged)
    with pytest.raises(BadSignature) as exc:
        gate.admit("site-a", ev, public_key=key)
    assert exc.value.reason == "bad_signature"


def test_unknown_signing_key(issuer: LocalTokenIssuer) -> None:
    rogue = LocalTokenIssuer(kid="rogue-kid")
    with pytest.raises(UnknownSigningKey) as exc:
        _admit(make_gate(issuer), issuer, signing_key=rogue.key, kid="rogue-kid")
    assert exc.value.reason == "unknown_signing_key"


def test_measurement_not_allowlisted(issuer: LocalTokenIssuer) -> None:
    with pytest.raises(MeasurementNotAllowed) as exc:
        _admit(make_gate(issuer), issuer, measurement="ff" * 48)
    assert exc.value.reason == "measurement_not_allowed"


def test_debug_enabled(issuer: LocalTokenIssuer) -> None:
    with pytest.raises(DebugEnabled) as exc:
        _admit(make_gate(issuer), issuer, debug=True)
    assert exc.value.reason == "debug_enabled"


def test_token_bound_to_another_partys_key(issuer: LocalTokenIssuer) -> None:
    key_a, key_b = raw_pub(), raw_pub()
    with pytest.raises(KeyBindingMismatch) as exc:  # site-b presents site-a's token and key
        _admit(make_gate(issuer), issuer, party="site-b", key=key_a, present_key=key_b)
    assert exc.value.reason == "key_binding_mismatch"
    with pytest.raises(KeyBindingMismatch):  # token binds key_a, evidence claims key_b
        _admit(make_gate(issuer), issuer, key=key_b, token_key=key_a)


def test_replayed_token(issuer: LocalTokenIssuer) -> None:
    gate, key = make_gate(issuer), raw_pub()
    ch = gate.challenge("site-a")
    ev = LocalTokenAttester("site-a", issuer).attest(ch.nonce_bytes(), key)
    gate.admit("site-a", ev, public_key=key)
    with pytest.raises(ReplayedToken) as exc:
        gate.admit("site-a", ev, public_key=key)
    assert exc.value.reason == "replayed_token"


def test_nonce_issued_to_another_party(issuer: LocalTokenIssuer) -> None:
    gate, key = make_gate(issuer), raw_pub()
    ch = gate.challenge("site-a")
    ev = LocalTokenAttester("site-b", issuer).attest(ch.nonce_bytes(), key)
    with pytest.raises(NonceMismatch):
        gate.admit("site-b", ev, public_key=key)


def test_issuer_and_audience_checked(issuer: LocalTokenIssuer) -> None:
    key = raw_pub()
    with pytest.raises(WrongIssuer):
        _admit(make_gate(issuer), issuer, key=key, extra={"iss": "https://evil.test"})
    with pytest.raises(WrongAudience):
        _admit(make_gate(issuer), issuer, key=key, extra={"aud": "someone-else"})


def test_nonce_hash_binding_mode(issuer: LocalTokenIssuer) -> None:
    """Services with a single user-data field get SHA-256(nonce || key hash) as the nonce."""
    import hashlib

    from crypto.attestation.models import key_hash

    v = EatJwtVerifier(issuer.verifier_config(key_binding="nonce_hash", nonce_claims=["nonce"], nonce_encoding="hex"))
    gate = AttestationGate({"eat-jwt": v}, Policy(allowed_measurements={"measurement": [GOOD_MEASUREMENT]}))
    key = raw_pub()
    ch = gate.challenge("coordinator")
    bound = hashlib.sha256(ch.nonce_bytes() + key_hash(key)).hexdigest()
    token = issuer.mint(nonce=ch.nonce_bytes(), public_key=key, extra={"nonce": bound})
    ev = Evidence(format="eat-jwt", attester="coordinator", nonce=ch.nonce, public_key=b64url(key), payload=token)
    assert gate.admit("coordinator", ev, public_key=key).debug is False


# -- insecure-dev and plug-ins -----------------------------------------------------------------


def test_insecure_dev_refused_unless_named(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(InsecureVerifierRefused):
        create_verifier("insecure-dev", {})
    with pytest.raises(InsecureVerifierRefused):
        create_verifier("insecure-dev", {"allow_insecure_dev": False}, allow_insecure_dev=True)
    v = create_verifier("insecure-dev", {"allow_insecure_dev": True}, allow_insecure_dev=True)
    key = raw_pub()
    policy = Policy(allowed_measurements={"measurement": ["00" * 48]})
    gate = AttestationGate({"insecure-dev": v}, policy)
    ch = gate.challenge("site-a")
    ev = InsecureDevAttester("site-a").attest(ch.nonce_bytes(), key)
    with pytest.raises(InsecureVerifierRefused):  # the policy must opt in too
        gate.admit("site-a", ev, public_key=key)
    gate.policy = policy.model_copy(update={"allow_insecure_dev": True})
    ch = gate.challenge("site-a")
    with caplog.at_level(logging.WARNING):
        result = gate.admit("site-a", InsecureDevAttester("site-a").attest(ch.nonce_bytes(), key), public_key=key)
    assert result.insecure and sum("INSECURE" in r.getMessage() for r in caplog.records) >= 2


class _DummyVerifier(Verifier):
    name = "dummy-tee"
    config_model = Policy  # any pydantic model will do for the test

    def verify(self, evidence, *, nonce, now=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_entry_point_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="dummy-tee", value=f"{__name__}:_DummyVerifier", group=verifier_mod.ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins_mod, "entry_points", lambda group: [ep] if group == ep.group else [])
    assert "dummy-tee" in verifier_mod.available_verifiers()
    assert isinstance(verifier_mod.create_verifier("dummy-tee", {}), _DummyVerifier)
    with pytest.raises(verifier_mod.UnknownVerifier):
        verifier_mod.create_verifier("no-such-tee")


class _DummyAttester(Attester):
    format = "dummy-tee"

    def __init__(self, party: str, level: int = 0):
        super().__init__(party)
        self.level = level

    def attest(self, nonce, public_key):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_attester_plugins_and_builtins(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    ep = EntryPoint(name="dummy-tee", value=f"{__name__}:_DummyAttester", group=ATTESTER_ENTRY_POINT_GROUP)
    monkeypatch.setattr(plugins_mod, "entry_points", lambda group: [ep] if group == ep.group else [])
    assert {"dummy-tee", "insecure-dev", "local-token"} <= set(available_attesters())
    built = create_attester("dummy-tee", "site-a", {"level": 3})
    assert isinstance(built, _DummyAttester) and built.level == 3 and built.party == "site-a"
    with pytest.raises(UnknownAttester, match="does not accept config"):
        create_attester("dummy-tee", "site-a", {"nope": 1})
    with pytest.raises(UnknownAttester, match="installed"):
        create_attester("no-such-tee", "site-a")
    # local-token: a saved issuer, shared between processes through its directory
    issuer = LocalTokenIssuer()
    issuer.save(tmp_path / "issuer")
    assert oct((tmp_path / "issuer" / "issuer_key.pem").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(UnknownAttester, match="issuer_dir"):
        create_attester("local-token", "site-a", {})
    with pytest.raises(UnknownAttester, match="unknown option"):
        create_attester("local-token", "site-a", {"issuer_dir": str(tmp_path / "issuer"), "measurment": "x"})
    attester = create_attester("local-token", "site-a", {"issuer_dir": str(tmp_path / "issuer")})
    gate, key = make_gate(issuer), raw_pub()
    ch = gate.challenge("site-a")
    assert gate.admit("site-a", attester.attest(ch.nonce_bytes(), key), public_key=key).attester == "site-a"
