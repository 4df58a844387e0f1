"""Compact JWS (RFC 7515) verification against a JWKS (RFC 7517), built on ``cryptography``.

Only what attestation tokens need: ES256/384/512, RS256/384/512, PS256/384/512 and EdDSA
(Ed25519). ``alg=none``, ``crit`` headers, HMAC algorithms and alg/key-type confusion are refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from .errors import BadSignature, MalformedEvidence, UnknownSigningKey, UnsupportedAlgorithm
from .models import b64url, is_b64url, load_json, unb64url

_EC = {"ES256": (ec.SECP256R1, hashes.SHA256, 32), "ES384": (ec.SECP384R1, hashes.SHA384, 48),
       "ES512": (ec.SECP521R1, hashes.SHA512, 66)}
_RSA = {"RS256": hashes.SHA256, "RS384": hashes.SHA384, "RS512": hashes.SHA512,
        "PS256": hashes.SHA256, "PS384": hashes.SHA384, "PS512": hashes.SHA512}
SUPPORTED_ALGS = (*_EC, *_RSA, "EdDSA")
_CURVES = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}
MIN_RSA_BITS = 2048


def _b64int(text: str) -> int:
    return int.from_bytes(unb64url(text), "big")


@dataclass(frozen=True)
class Jwk:
    kid: str | None
    kty: str
    alg: str | None
    key: Any  # a cryptography public key

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Jwk":
        if not isinstance(d, Mapping):
            raise MalformedEvidence(f"a JWK is a JSON object, not {type(d).__name__}")
        kty = d.get("kty")
        try:
            if kty == "EC":
                curve = _CURVES[d["crv"]]()
                key: Any = ec.EllipticCurvePublicNumbers(_b64int(d["x"]), _b64int(d["y"]), curve).public_key()
            elif kty == "RSA":
                key = rsa.RSAPublicNumbers(_b64int(d["e"]), _b64int(d["n"])).public_key()
                if key.key_size < MIN_RSA_BITS:
                    raise ValueError(f"RSA key below {MIN_RSA_BITS} bits")
            elif kty == "OKP" and d.get("crv") == "Ed25519":
                key = ed25519.Ed25519PublicKey.from_public_bytes(unb64url(d["x"]))
            else:
                raise ValueError(f"unsupported key type {kty!r}/{d.get('crv')!r}")
        except (KeyError, ValueError, TypeError) as exc:
            raise MalformedEvidence(f"bad JWK {d.get('kid')!r}: {exc}") from exc
        if d.get("use") not in (None, "sig"):
            raise MalformedEvidence(f"JWK {d.get('kid')!r} is not a signature key")
        return cls(d.get("kid"), kty, d.get("alg"), key)

    def accepts(self, alg: str) -> bool:
        """Key type must fit the algorithm; a key that names its alg accepts only that one."""
        if self.alg is not None and self.alg != alg:
            return False
        if alg in _EC:
            return isinstance(self.key, ec.EllipticCurvePublicKey) and isinstance(self.key.curve, _EC[alg][0])
        if alg in _RSA:
            return isinstance(self.key, rsa.RSAPublicKey)
        return alg == "EdDSA" and isinstance(self.key, ed25519.Ed25519PublicKey)


class Jwks:
    """A JSON Web Key Set of trusted token-signing keys, looked up by ``kid``."""

    def __init__(self, keys: Sequence[Jwk]):
        self.keys = list(keys)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Jwks":
        if not isinstance(d, Mapping) or not isinstance(d.get("keys"), list):
            raise MalformedEvidence("JWKS has no 'keys' list")
        return cls([Jwk.from_dict(k) for k in d["keys"]])

    @classmethod
    def from_json(cls, data: bytes | str) -> "Jwks":
        """A JWKS document (as an attestation service publishes it); MalformedEvidence if unusable."""
        return cls.from_dict(load_json(data, "JWKS"))

    @classmethod
    def from_file(cls, path: str | Path) -> "Jwks":
        return cls.from_json(Path(path).read_bytes())

    def find(self, kid: str | None, alg: str) -> Jwk:
        if kid is None:
            if len(self.keys) == 1:  # single-key sets commonly omit kid
                cands = self.keys
            else:
                raise UnknownSigningKey("token has no 'kid' and the JWKS holds several keys")
        else:
            cands = [k for k in self.keys if k.kid == kid]
            if not cands:
                raise UnknownSigningKey(f"kid {kid!r} is not in the trusted JWKS")
        for k in cands:
            if k.accepts(alg):
                return k
        raise UnknownSigningKey(f"no key with kid {kid!r} accepts alg {alg}")


def _json_part(part: str, what: str) -> dict[str, Any]:
    obj = load_json(unb64url(part), f"JWS {what}")
    if not isinstance(obj, dict):
        raise MalformedEvidence(f"JWS {what} is not a JSON object")
    return obj


def verify_jws(token: str, jwks: Jwks, algorithms: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a compact JWS signature; return (protected header, claims). Raises on any doubt."""
    if not isinstance(token, str) or token.count(".") != 2:
        raise MalformedEvidence("not a compact JWS (header.payload.signature)")
    h64, p64, s64 = token.split(".")
    if not all(is_b64url(p) for p in (h64, p64, s64)):  # checked up front: the signed input is ASCII
        raise MalformedEvidence("a JWS part is not unpadded base64url")
    header = _json_part(h64, "header")
    alg = header.get("alg")
    if alg not in SUPPORTED_ALGS or alg not in algorithms:
        raise UnsupportedAlgorithm(f"alg {alg!r} is not allowed (allowed: {list(algorithms)})")
    if "crit" in header:
        raise UnsupportedAlgorithm("critical JWS header extensions are not supported")
    if header.get("b64") is False:
        raise UnsupportedAlgorithm("unencoded payloads are not supported")
    jwk = jwks.find(header.get("kid"), alg)
    sig = unb64url(s64)
    data = f"{h64}.{p64}".encode("ascii")
    try:
        if alg in _EC:
            _, hash_cls, size = _EC[alg]
            if len(sig) != 2 * size:
                raise InvalidSignature
            r, s = int.from_bytes(sig[:size], "big"), int.from_bytes(sig[size:], "big")
            jwk.key.verify(encode_dss_signature(r, s), data, ec.ECDSA(hash_cls()))
        elif alg in _RSA:
            h = _RSA[alg]()
            pad = padding.PKCS1v15() if alg.startswith("RS") else padding.PSS(padding.MGF1(h), h.digest_size)
            jwk.key.verify(sig, data, pad, h)
        else:
            jwk.key.verify(sig, data)
    except InvalidSignature as exc:
        raise BadSignature(f"{alg} signature does not verify with kid {jwk.kid!r}") from exc
    return header, _json_part(p64, "payload")


def sign_jws(claims: Mapping[str, Any], key: Any, alg: str, kid: str | None = None) -> str:
    """Mint a compact JWS (for test issuers and software attesters)."""
    header: dict[str, Any] = {"alg": alg, "typ": "JWT"}
    if kid is not None:
        header["kid"] = kid
    h64 = b64url(json.dumps(header, separators=(",", ":")).encode())
    p64 = b64url(json.dumps(dict(claims), separators=(",", ":"), default=str).encode())
    data = f"{h64}.{p64}".encode("ascii")
    if alg in _EC:
        _, hash_cls, size = _EC[alg]
        r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hash_cls())))
        sig = r.to_bytes(size, "big") + s.to_bytes(size, "big")
    elif alg in _RSA:
        h = _RSA[alg]()
        pad = padding.PKCS1v15() if alg.startswith("RS") else padding.PSS(padding.MGF1(h), h.digest_size)
        sig = key.sign(data, pad, h)
    elif alg == "EdDSA":
        sig = key.sign(data)
    else:
        raise UnsupportedAlgorithm(alg)
    return f"{h64}.{p64}.{b64url(sig)}"


def public_jwk(key: Any, kid: str, alg: str) -> dict[str, Any]:
    """The JWK (public part) of a cryptography private or public key."""
    pub = key.public_key() if hasattr(key, "public_key") else key
    if isinstance(pub, ec.EllipticCurvePublicKey):
        size = (pub.curve.key_size + 7) // 8
        crv = {v: k for k, v in _CURVES.items()}[type(pub.curve)]
        nums = pub.public_numbers()
        return {"kty": "EC", "crv": crv, "x": b64url(nums.x.to_bytes(size, "big")),
                "y": b64url(nums.y.to_bytes(size, "big")), "kid": kid, "alg": alg, "use": "sig"}
    if isinstance(pub, rsa.RSAPublicKey):
        nums = pub.public_numbers()
        return {"kty": "RSA", "n": b64url(nums.n.to_bytes((nums.n.bit_length() + 7) // 8, "big")),
                "e": b64url(nums.e.to_bytes((nums.e.bit_length() + 7) // 8, "big")), "kid": kid, "alg": alg, "use": "sig"}
    if isinstance(pub, ed25519.Ed25519PublicKey):
        from cryptography.hazmat.primitives import serialization

        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return {"kty": "OKP", "crv": "Ed25519", "x": b64url(raw), "kid": kid, "alg": alg, "use": "sig"}
    raise UnsupportedAlgorithm(f"no JWK form for {type(pub).__name__}")
