"""azure-maa: a claim set in the shape Azure's documentation shows for an SEV-SNP confidential VM
(guest attestation), re-signed with a test RSA key, and each refusal with its reason code."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import os
import time
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crypto.attestation import AttestationError, Evidence, Policy, appraise, create_verifier
from crypto.attestation.azure_maa import AzureMaaVerifier
from crypto.attestation.jose import public_jwk, sign_jws
from crypto.attestation.models import b64url, binding

ISSUER = "https://sovfltest.weu.attest.azure.net"
LAUNCH = "6ad42a61" * 12
KID = "dRKh+hBcWUfQimSl3Iv6ZhStW3TSOt0ThwiTgUUqZAo="


def snp_cvm_claims(nonce_b64: str | None, iat: int | None = None) -> dict[str, Any]:
    """The claims of an MAA token for an SEV-SNP confidential VM, in the shape of Azure's documented sample."""
    iat = int(time.time()) if iat is None else iat
    claims: dict[str, Any] = {
        "exp": iat + 28800, "iat": iat, "nbf": iat, "iss": ISSUER, "jti": os.urandom(32).hex(),
        "secureboot": True, "x-ms-attestation-type": "azurevm", "x-ms-azurevm-attestation-protocol-ver": "2.0",
        "x-ms-azurevm-attested-pcrs": [0, 1, 2, 3, 4, 5, 6, 7], "x-ms-azurevm-bootdebug-enabled": False,
        "x-ms-azurevm-dbvalidated": True, "x-ms-azurevm-dbxvalidated": True, "x-ms-azurevm-debuggersdisabled": True,
        "x-ms-azurevm-default-securebootkeysvalidated": True, "x-ms-azurevm-elam-enabled": False,
        "x-ms-azurevm-flightsigning-enabled": False, "x-ms-azurevm-hvci-policy": 0,
        "x-ms-azurevm-hypervisordebug-enabled": False, "x-ms-azurevm-is-windows": False,
        "x-ms-azurevm-kerneldebug-enabled": False, "x-ms-azurevm-osbuild": "NotApplication",
        "x-ms-azurevm-osdistro": "Ubuntu", "x-ms-azurevm-ostype": "Linux", "x-ms-azurevm-osversion-major": 22,
        "x-ms-azurevm-osversion-minor": 4, "x-ms-azurevm-signingdisabled": True, "x-ms-azurevm-testsigning-enabled": False,
        "x-ms-azurevm-vmid": "C4C2B1E3-2B5B-4E50-A2B1-3D7D8B1E5E0D",
        "x-ms-isolation-tee": {
            "x-ms-attestation-type": "sevsnpvm", "x-ms-compliance-status": "azure-compliant-cvm",
            "x-ms-runtime": {"keys": [], "vm-configuration": {"console-enabled": True, "secure-boot": True,
                                                             "tpm-enabled": True, "vmUniqueId": "C4C2B1E3"}},
            "x-ms-sevsnpvm-authorkeydigest": "00" * 48, "x-ms-sevsnpvm-bootloader-svn": 3,
            "x-ms-sevsnpvm-familyId": "01000000000000000000000000000000", "x-ms-sevsnpvm-guestsvn": 2,
            "x-ms-sevsnpvm-hostdata": "00" * 32, "x-ms-sevsnpvm-idkeydigest": "57486a44" * 12,
            "x-ms-sevsnpvm-imageId": "02000000000000000000000000000000", "x-ms-sevsnpvm-is-debuggable": False,
            "x-ms-sevsnpvm-launchmeasurement": LAUNCH, "x-ms-sevsnpvm-microcode-svn": 115,
            "x-ms-sevsnpvm-migration-allowed": False, "x-ms-sevsnpvm-reportdata": "c6500859" * 8 + "00" * 32,
            "x-ms-sevsnpvm-reportid": "cf5ea742" * 8, "x-ms-sevsnpvm-smt-allowed": True, "x-ms-sevsnpvm-snpfw-svn": 8,
            "x-ms-sevsnpvm-tee-svn": 0, "x-ms-sevsnpvm-vmpl": 0},
        "x-ms-policy-hash": "wm9mHlvTU82e8UqoOy1Yj1FBRSNkfe99-69IYDq9eWs", "x-ms-runtime": {"keys": []},
        "x-ms-ver": "1.0",
    }
    if nonce_b64 is not None:
        claims["x-ms-runtime"]["client-payload"] = {"nonce": nonce_b64}
    return claims


@pytest.fixture(scope="module")
def signer() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def verifier(signer) -> AzureMaaVerifier:  # type: ignore[no-untyped-def]
    v = create_verifier("azure-maa", {"jwks": {"keys": [public_jwk(signer, KID, "RS256")]}, "issuer": ISSUER})
    assert isinstance(v, AzureMaaVerifier)
    return v


def token(signer, claims: dict[str, Any], alg: str = "RS256", kid: str = KID) -> str:  # type: ignore[no-untyped-def]
    return sign_jws(claims, signer, alg, kid, header={"jku": ISSUER + "/certs"})


def ev(tok: str, nonce: bytes, key: bytes) -> Evidence:
    return Evidence(format="azure-maa", attester="coordinator", nonce=b64url(nonce), public_key=b64url(key), payload=tok)


def bound(nonce: bytes, key: bytes) -> str:
    return base64.b64encode(binding(nonce, key)).decode()


def test_snp_cvm_token_is_admitted(signer, verifier) -> None:  # type: ignore[no-untyped-def]
    nonce, key = os.urandom(32), os.urandom(32)
    policy = Policy(allowed_measurements={"x-ms-sevsnpvm-launchmeasurement": [LAUNCH], "attestation_type": ["sevsnpvm"]})
    result = appraise(ev(token(signer, snp_cvm_claims(bound(nonce, key))), nonce, key), nonce=nonce, public_key=key,
                      verifiers={"azure-maa": verifier}, policy=policy)
    assert result.debug is False and result.issuer == ISSUER
    assert result.measurements["x-ms-sevsnpvm-hostdata"] == "00" * 32


def reason(signer, verifier, claims, nonce: bytes, key: bytes, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(AttestationError) as exc:
        appraise(ev(kw.pop("tok", None) or token(signer, claims, **kw), nonce, key), nonce=nonce, public_key=key,
                 verifiers={"azure-maa": verifier},
                 policy=Policy(allowed_measurements={"x-ms-sevsnpvm-launchmeasurement": [LAUNCH]}))
    return exc.value.reason


def test_each_refusal_has_its_reason(signer, verifier) -> None:  # type: ignore[no-untyped-def]
    nonce, key = os.urandom(32), os.urandom(32)
    good = snp_cvm_claims(bound(nonce, key))

    def changed(path: list[str], value: Any) -> dict[str, Any]:
        c = copy.deepcopy(good)
        d = c
        for p in path[:-1]:
            d = d[p]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
        return c

    tee = "x-ms-isolation-tee"
    cases = [
        (changed([tee, "x-ms-attestation-type"], "sgx"), "wrong_attestation_type"),
        (changed([tee, "x-ms-attestation-type"], "vbs"), "wrong_attestation_type"),
        (changed(["iss"], "https://other.weu.attest.azure.net"), "wrong_issuer"),
        (changed(["iss"], ISSUER + "/"), "wrong_issuer"),
        (changed([tee, "x-ms-sevsnpvm-is-debuggable"], True), "debug_enabled"),
        (changed([tee, "x-ms-sevsnpvm-is-debuggable"], KeyError), "debug_enabled"),  # silent on debug
        (changed(["x-ms-runtime", "client-payload"], KeyError), "nonce_mismatch"),  # no client payload
        (changed(["x-ms-runtime", "client-payload", "nonce"], bound(os.urandom(32), key)), "nonce_mismatch"),
        (changed(["x-ms-runtime", "client-payload", "nonce"], bound(nonce, os.urandom(32))), "nonce_mismatch"),
        (changed([tee, "x-ms-compliance-status"], "not-compliant"), "not_compliant"),
        (changed([tee, "x-ms-sevsnpvm-launchmeasurement"], "ff" * 48), "measurement_not_allowed"),
        (changed(["exp"], int(time.time()) - 3600), "token_expired"),
    ]
    for claims, want in cases:
        assert reason(signer, verifier, claims, nonce, key) == want, want
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert reason(signer, verifier, good, nonce, key, tok=token(other, good)) == "bad_signature"
    assert reason(signer, verifier, good, nonce, key, tok=token(other, good, kid="other")) == "unknown_signing_key"
    assert reason(signer, verifier, good, nonce, key, tok=token(signer, good, alg="PS256")) == "unsupported_algorithm"
    p384 = ec.generate_private_key(ec.SECP384R1())
    assert reason(signer, verifier, good, nonce, key, tok=token(p384, good, alg="ES384")) == "unsupported_algorithm"


def test_tdx_cvm_measurements_and_an_allowed_type_list() -> None:
    signer = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwks = {"keys": [public_jwk(signer, KID, "RS256")]}
    nonce, key = os.urandom(32), os.urandom(32)
    claims = snp_cvm_claims(bound(nonce, key))
    claims["x-ms-isolation-tee"] = {"x-ms-attestation-type": "tdxvm", "x-ms-compliance-status": "azure-compliant-cvm",
                                    "tdx_mrtd": "ab" * 48, "tdx_rtmr0": "cd" * 48, "tdx_td_attributes_debug": False}
    tdx = AzureMaaVerifier({"jwks": jwks, "issuer": ISSUER})
    result = tdx.verify(ev(token(signer, claims), nonce, key), nonce=nonce)
    assert result.measurements["tdx_mrtd"] == "ab" * 48 and result.debug is False
    snp_only = AzureMaaVerifier({"jwks": jwks, "issuer": ISSUER, "attestation_types": ["sevsnpvm"]})
    with pytest.raises(AttestationError) as exc:
        snp_only.verify(ev(token(signer, claims), nonce, key), nonce=nonce)
    assert exc.value.reason == "wrong_attestation_type"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_tokens_are_never_accepted_and_never_crash(signer, verifier, data) -> None:  # type: ignore[no-untyped-def]
    nonce, key = b"\x03" * 32, b"\x04" * 32
    tok = _VALID.setdefault("t", token(signer, snp_cvm_claims(bound(nonce, key))))
    blob = bytearray(tok.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    if blob == tok.encode():
        return
    with pytest.raises(AttestationError):
        verifier.verify(ev(blob.decode("utf-8", "replace"), nonce, key), nonce=nonce,
                        now=dt.datetime.now(dt.timezone.utc))


_VALID: dict[str, str] = {}
