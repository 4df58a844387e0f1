"""nvidia-nras: NVIDIA's genuine NRAS claim sets (nvtrust fixtures) re-signed under a test JWKS, and
every negative case with its own reason code."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto.attestation import AttestationError, Evidence, Policy, appraise, create_verifier
from crypto.attestation.jose import public_jwk, sign_jws
from crypto.attestation.models import b64url, binding
from crypto.attestation.nvidia_nras import NrasVerifier
from crypto.attestation.testing import NrasTestIssuer

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "attestation" / "nvtrust"
PROD, STAGING = "https://nras.attestation.nvidia.com", "https://nras.attestation-stg.nvidia.com"
# inside every fixture token's [nbf, exp] (the v3.0 GPU claims are valid for one hour in January 2025)
FIXTURE_NOW = dt.datetime.fromtimestamp(1736197400, dt.timezone.utc)


def fixture_claims(name: str) -> dict[str, Any]:
    path = FIXTURES / "data" / "gpu" / name
    assert path.is_file(), f"genuine fixtures missing: expected {path} (shared/ beside the repository)"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def nras() -> NrasTestIssuer:
    return NrasTestIssuer(issuer=PROD)


@pytest.fixture(scope="module")
def verifier(nras: NrasTestIssuer) -> NrasVerifier:
    # the fixtures' detached tokens come from NRAS's staging host (see the fixtures' README)
    v = create_verifier("nvidia-nras", nras.verifier_config(detached_issuer=STAGING))
    assert isinstance(v, NrasVerifier)
    return v


def ev(payload: str, nonce: bytes, key: bytes) -> Evidence:
    return Evidence(format="nvidia-nras", attester="site-a", nonce=b64url(nonce), public_key=b64url(key),
                    payload=payload)


def genuine(nras: NrasTestIssuer, version: str, nonce: bytes, key: bytes, gpus: int = 1) -> tuple[str, dict]:
    """The fixture claims of one NRAS version with our binding as eat_nonce, re-signed with the test key."""
    prefix = "" if version == "2.0" else "granular_"
    overall = fixture_claims(f"overall_{prefix}claims_remote.json")
    gpu = fixture_claims(f"detached_{prefix}claims_remote.json")
    n = binding(nonce, key).hex()
    detached = {f"GPU-{i}": {**gpu, "eat_nonce": n} for i in range(gpus)}
    overall = {**overall, "eat_nonce": n}
    overall.pop("submods")  # recomputed over the re-signed GPU tokens
    return nras.result(detached, overall), detached


@pytest.mark.parametrize("version", ["2.0", "3.0"])
def test_genuine_claims_re_signed_are_admitted(nras, verifier, version) -> None:  # type: ignore[no-untyped-def]
    nonce, key = os.urandom(32), os.urandom(32)
    payload, _ = genuine(nras, version, nonce, key, gpus=2)
    policy = Policy(allowed_measurements={"x-nvidia-gpu-vbios-version": ["96.00.9F.00.01"],
                                          "hwmodel": ["GH100 A01 GSP BROM"]}, max_token_age_s=10**9)
    result = appraise(ev(payload, nonce, key), nonce=nonce, public_key=key, verifiers={"nvidia-nras": verifier},
                      policy=policy, now=FIXTURE_NOW)
    assert result.debug is False and result.issuer == PROD
    assert result.measurements["gpu_count"] == "2"
    assert result.measurements["x-nvidia-gpu-driver-version"] == ("570.00" if version == "2.0" else "570.44")
    assert result.measurements["GPU-1.hwmodel"] == "gh100 a01 gsp brom"


def reason(verifier: NrasVerifier, payload: str, nonce: bytes, key: bytes, now: dt.datetime = FIXTURE_NOW,
           policy: Policy | None = None) -> str:
    with pytest.raises(AttestationError) as exc:
        appraise(ev(payload, nonce, key), nonce=nonce, public_key=key, verifiers={"nvidia-nras": verifier},
                 policy=policy or Policy(require_measurements=False, max_token_age_s=10**9), now=now)
    return exc.value.reason


def test_each_negative_case_has_its_reason(nras, verifier) -> None:  # type: ignore[no-untyped-def]
    nonce, key = os.urandom(32), os.urandom(32)
    payload, detached = genuine(nras, "3.0", nonce, key, gpus=2)
    body = json.loads(payload)
    overall_token, tokens = body[0][1], body[1]
    gpu = detached["GPU-0"]

    # a detached token swapped between GPUs
    swapped = json.dumps([["JWT", overall_token], {"GPU-0": tokens["GPU-1"], "GPU-1": tokens["GPU-0"]}])
    tokens_differ = tokens["GPU-0"] != tokens["GPU-1"]
    assert tokens_differ and reason(verifier, swapped, nonce, key) == "submod_digest_mismatch"
    dropped = json.dumps([["JWT", overall_token], {"GPU-0": tokens["GPU-0"]}])
    assert reason(verifier, dropped, nonce, key) == "submod_digest_mismatch"
    # a detached token carrying another nonce, even with the overall token digesting it
    other = nras.result({"GPU-0": {**gpu, "eat_nonce": binding(os.urandom(32), key).hex()}},
                        {"eat_nonce": binding(nonce, key).hex()})
    assert reason(verifier, other, nonce, key) == "nonce_mismatch"
    # another key bound (the token answers the nonce for someone else's key)
    assert reason(verifier, payload, nonce, os.urandom(32)) == "nonce_mismatch"
    # expired / not yet valid (the fixture GPU tokens live one hour)
    assert reason(verifier, payload, nonce, key, now=FIXTURE_NOW + dt.timedelta(hours=2)) == "token_expired"
    assert reason(verifier, payload, nonce, key, now=FIXTURE_NOW - dt.timedelta(hours=2)) == "token_not_yet_valid"
    # debug on, secure boot off, measurement failed, overall result false, a v4 policy claim false
    for change, want in [({"dbgstat": "enabled"}, "debug_enabled"), ({"secboot": False}, "secure_boot_off"),
                         ({"measres": "fail"}, "appraisal_failed"),
                         ({"x-nvidia-gpu-attestation-report-signature-verified": False}, "appraisal_failed"),
                         ({"x-nvidia-gpu-attestation-report-signature-verified": 1}, "appraisal_failed")]:
        assert reason(verifier, nras.result({"GPU-0": {**gpu, **change}}), nonce, key) == want, change
    assert reason(verifier, nras.result({"GPU-0": gpu}, {"x-nvidia-overall-att-result": False}),
                  nonce, key) == "appraisal_failed"
    # issuer: the overall token from staging, or from another service
    assert reason(verifier, nras.result({"GPU-0": gpu}, {"iss": STAGING}), nonce, key) == "wrong_issuer"
    assert reason(verifier, nras.result({"GPU-0": {**gpu, "iss": PROD + "/"}}), nonce, key) == "wrong_issuer"


def test_signature_and_key_attacks(nras, verifier) -> None:  # type: ignore[no-untyped-def]
    nonce, key = os.urandom(32), os.urandom(32)
    payload, detached = genuine(nras, "3.0", nonce, key)
    body = json.loads(payload)
    overall_token = body[0][1]
    gpu = detached["GPU-0"]

    def with_gpu_token(token: str) -> str:
        return nras.result({"GPU-0": token}, {k: gpu[k] for k in ("eat_nonce", "iat", "nbf", "exp")})

    claims64 = b64url(json.dumps(gpu).encode())
    none_token = b64url(b'{"alg":"none","kid":"nras-test-1"}') + "." + claims64 + "."
    assert reason(verifier, with_gpu_token(none_token), nonce, key) == "unsupported_algorithm"
    # HS256 keyed with the pinned public key itself
    import hmac
    pub = json.dumps(nras.jwks()["keys"][0]).encode()
    h = b64url(b'{"alg":"HS256","kid":"nras-test-1"}')
    hs = f"{h}.{claims64}." + b64url(hmac.new(pub, f"{h}.{claims64}".encode(), hashlib.sha256).digest())
    assert reason(verifier, with_gpu_token(hs), nonce, key) == "unsupported_algorithm"
    rogue = ec.generate_private_key(ec.SECP384R1())
    assert reason(verifier, with_gpu_token(nras.sign(gpu, key=rogue, kid="unknown")), nonce, key) == \
        "unknown_signing_key"
    assert reason(verifier, with_gpu_token(nras.sign(gpu, key=rogue)), nonce, key) == "bad_signature"
    # an RSA key offered for ES384: a JWKS whose entry for the kid is RSA
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {k: v for k, v in public_jwk(rsa_key, "nras-test-1", "RS256").items() if k != "alg"}
    rsa_verifier = NrasVerifier({"jwks": {"keys": [jwk]}, "issuer": PROD, "detached_issuer": STAGING})
    assert reason(rsa_verifier, payload, nonce, key) == "wrong_key_type"
    # an RS256 token where ES384 is the only algorithm
    assert reason(verifier, with_gpu_token(sign_jws(gpu, rsa_key, "RS256", "nras-test-1")), nonce, key) == \
        "unsupported_algorithm"
    crit = sign_jws(gpu, nras.key, "ES384", "nras-test-1", header={"crit": ["x-ext"], "x-ext": 1})
    assert reason(verifier, with_gpu_token(crit), nonce, key) == "unsupported_critical_header"
    # the overall token forged over a tampered submods
    h64, p64, s64 = overall_token.split(".")
    forged = json.dumps([["JWT", f"{h64}.{b64url(b'{}')}.{s64}"], body[1]])
    assert reason(verifier, forged, nonce, key) == "bad_signature"
    assert reason(verifier, '{"not": "nras"}', nonce, key) == "malformed_evidence"


def test_test_issuer_tokens_pass_with_the_default_issuer_config() -> None:
    issuer = NrasTestIssuer()
    v = NrasVerifier(issuer.verifier_config())
    nonce, key = os.urandom(32), os.urandom(32)
    n = binding(nonce, key).hex()
    result = v.verify(ev(issuer.result({"GPU-0": issuer.gpu_claims(n)}), nonce, key), nonce=nonce)
    assert result.debug is False and result.measurements["x-nvidia-gpu-driver-version"] == "570.00"
    debug = v.verify(ev(issuer.result({"GPU-0": issuer.gpu_claims(n, debug=True)}), nonce, key), nonce=nonce)
    assert debug.debug is True


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_results_are_never_accepted_and_never_crash(nras, verifier, data) -> None:  # type: ignore[no-untyped-def]
    nonce, key = b"\x01" * 32, b"\x02" * 32
    payload = _VALID.setdefault("p", genuine(nras, "3.0", nonce, key, gpus=2)[0])
    blob = bytearray(payload.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    text = blob.decode("utf-8", "replace")
    try:
        if json.loads(text) == json.loads(payload):
            return  # whitespace only: the same evidence
    except ValueError:
        pass
    with pytest.raises(AttestationError):
        verifier.verify(ev(text, nonce, key), nonce=nonce, now=FIXTURE_NOW)


_VALID: dict[str, str] = {}


def test_command_attester_runs_the_sites_tool_and_the_verifier_admits_its_output(tmp_path) -> None:
    """The `nvidia-nras` attester runs a configured command (here a stand-in for nvattest that asks a
    test NRAS issuer) with the binding as {nonce} and sends what it prints."""
    import sys

    from crypto.attestation import create_attester
    issuer = NrasTestIssuer()
    d = issuer.save(tmp_path / "nras")
    script = ("import sys; from crypto.attestation.testing import NrasTestIssuer as I; i = I.load(sys.argv[1]); "
              "print('{\"nras\": %s}' % i.result({'GPU-0': i.gpu_claims(sys.argv[2])}))")
    att = create_attester("nvidia-nras", "site-a", {"command": [sys.executable, "-c", script, str(d), "{nonce}"],
                                                     "result_key": "nras"})
    nonce, key = os.urandom(32), os.urandom(32)
    result = NrasVerifier(issuer.verifier_config()).verify(att.attest(nonce, key), nonce=nonce)
    assert result.measurements["gpu_count"] == "1"
    failing = create_attester("nvidia-nras", "site-a", {"command": [sys.executable, "-c", "exit(3)", "{nonce}"]})
    with pytest.raises(AttestationError) as exc:
        failing.attest(nonce, key)
    assert exc.value.reason == "attester_device_error"
