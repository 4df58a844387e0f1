"""Compact JWS verification for attestation tokens, on the maintained ``joserfc`` library.

What this module adds around joserfc is the attestation rules: an explicit algorithm list per
verifier taken from :data:`SUPPORTED_ALGS` (asymmetric signatures only: never ``HS*``, ``none``,
JWE or PBES2), the signing key chosen by ``kid`` from a pinned JWKS (or from an ``x5c`` chain
that must end at a pinned root, checked with ``cryptography.x509.verification``), the key type
checked against the algorithm before any signature check, ``crit`` refused unless every name in
it is one the caller understands, and every failure mapped to an :class:`AttestationError`.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.verification import (
    ExtensionPolicy, PolicyBuilder, Store, VerificationError,
)
from joserfc import jws as jrfc_jws
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from joserfc.errors import BadSignatureError, JoseError, SecurityWarning, UnsupportedAlgorithmError
from joserfc.jwk import ECKey, OKPKey, RSAKey
from joserfc.registry import HeaderParameter

from .errors import (
    BadCertificateChain, BadSignature, MalformedEvidence, TokenExpired, TokenNotYetValid, UnknownSigningKey,
    UnsupportedAlgorithm, UnsupportedCriticalHeader, UntrustedRoot, WrongKeyType,
)
from .models import b64url, is_b64url, load_json, numeric_date, unb64url, utcnow

# Every algorithm a verifier may list. Symmetric (HS*), "none" and anything JWE are absent on purpose.
_EC_CURVES = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}
_RSA_ALGS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
SUPPORTED_ALGS: tuple[str, ...] = (*_EC_CURVES, *_RSA_ALGS, "EdDSA")
MIN_RSA_BITS = 2048
MAX_TOKEN_CHARS = 256 * 1024
_CURVE_TYPES = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}


def check_algorithms(algorithms: Collection[str]) -> list[str]:
    """A verifier's explicit algorithm list; ValueError for anything outside :data:`SUPPORTED_ALGS`."""
    algs = list(algorithms)
    bad = [a for a in algs if a not in SUPPORTED_ALGS]
    if bad or not algs:
        raise ValueError(f"algorithms {bad or algs} not allowed; choose from {list(SUPPORTED_ALGS)} "
                         "(HS*, none, JWE and PBES2 are never accepted for attestation tokens)")
    return algs


class PinnedTokenConfig(BaseModel):
    """What every verifier of signed tokens pins: its keys (inline or a file, never fetched), the
    algorithms it accepts (explicit, never HS*/none), the `crit` names it understands, its clock skew."""

    model_config = ConfigDict(extra="forbid")

    jwks: dict[str, Any] | None = None  # the issuer's signing keys, pinned inline ...
    jwks_path: str | None = None  # ... or in a file (air-gapped: never fetched)
    algorithms: list[str]
    understood_crit: list[str] = Field(default_factory=list)
    clock_skew_s: float = Field(60.0, ge=0, le=600)

    @field_validator("algorithms")
    @classmethod
    def _explicit_algorithms(cls, v: list[str]) -> list[str]:
        return check_algorithms(v)

    @model_validator(mode="after")
    def _one_jwks(self) -> "PinnedTokenConfig":
        if (self.jwks is None) == (self.jwks_path is None):
            raise ValueError("give exactly one of jwks or jwks_path (the issuer's pinned signing keys)")
        return self

    def pinned_jwks(self) -> "Jwks":
        """The pinned keys, from the config itself or its file."""
        return Jwks.from_dict(self.jwks) if self.jwks is not None else Jwks.from_file(Path(self.jwks_path or ""))


def token_window(claims: Mapping[str, Any], now: dt.datetime, skew_s: float, what: str = "token"
                 ) -> tuple[dt.datetime, dt.datetime]:
    """(iat, exp) of a token's claims, checked against `now` with `skew_s` of clock skew either way:
    exp and iat required, nbf honoured (MalformedEvidence, TokenExpired, TokenNotYetValid)."""
    skew = dt.timedelta(seconds=skew_s)
    if "exp" not in claims or "iat" not in claims:
        raise MalformedEvidence(f"{what} has no exp or iat")
    exp, iat = numeric_date(claims["exp"], "exp"), numeric_date(claims["iat"], "iat")
    if now > exp + skew:
        raise TokenExpired(f"{what} expired at {exp.isoformat()}")
    if "nbf" in claims and now + skew < numeric_date(claims["nbf"], "nbf"):
        raise TokenNotYetValid(f"{what} is not valid before {claims['nbf']}")
    if now + skew < iat:
        raise TokenNotYetValid(f"{what} was issued in the future ({iat.isoformat()})")
    return iat, exp


class _Registry(jrfc_jws.JWSRegistry):
    """joserfc's registry with room for an ``x5c`` chain in the header (its default is 512 bytes)."""

    max_header_length = 16 * 1024
    max_payload_length = 192 * 1024
    max_signature_length = 1024


def _key_fits(key: Any, alg: str) -> bool:
    if alg in _EC_CURVES:
        return isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, _CURVE_TYPES[_EC_CURVES[alg]])
    if alg in _RSA_ALGS:
        return isinstance(key, rsa.RSAPublicKey) and key.key_size >= MIN_RSA_BITS
    return alg == "EdDSA" and isinstance(key, ed25519.Ed25519PublicKey)


def _joserfc_key(key: Any) -> Any:
    if isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)):
        return ECKey.import_key(key)
    if isinstance(key, (rsa.RSAPublicKey, rsa.RSAPrivateKey)):
        return RSAKey.import_key(key)
    if isinstance(key, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey)):
        return OKPKey.import_key(key)
    raise UnsupportedAlgorithm(f"no JOSE key type for {type(key).__name__}")


@dataclass(frozen=True)
class Jwk:
    """One pinned signing key: its ``kid``, the ``alg`` it is restricted to (if it says) and the key."""

    kid: str | None
    alg: str | None
    key: Any  # a cryptography public key

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Jwk":
        if not isinstance(d, Mapping):
            raise MalformedEvidence(f"a JWK is a JSON object, not {type(d).__name__}")
        kid = d.get("kid")
        if d.get("kty") not in ("EC", "RSA", "OKP"):
            raise MalformedEvidence(f"JWK {kid!r}: key type {d.get('kty')!r} is not a signature key type "
                                    "(EC, RSA or OKP; symmetric keys are refused)")
        if d.get("use") not in (None, "sig"):
            raise MalformedEvidence(f"JWK {kid!r} is not a signature key (use={d.get('use')!r})")
        if kid is not None and not isinstance(kid, str):
            raise MalformedEvidence("JWK kid is not a string")
        alg = d.get("alg")
        if alg is not None and alg not in SUPPORTED_ALGS:
            raise MalformedEvidence(f"JWK {kid!r} names alg {alg!r}, not one of {list(SUPPORTED_ALGS)}")
        public = {k: v for k, v in d.items() if k in ("kty", "crv", "x", "y", "n", "e")}
        try:
            imported = {"EC": ECKey, "RSA": RSAKey, "OKP": OKPKey}[d["kty"]].import_key(dict(public))
            key = imported.get_op_key("verify")
        except (JoseError, ValueError, TypeError, KeyError) as exc:
            raise MalformedEvidence(f"bad JWK {kid!r}: {type(exc).__name__}: {exc}"[:300]) from None
        if isinstance(key, rsa.RSAPublicKey) and key.key_size < MIN_RSA_BITS:
            raise MalformedEvidence(f"JWK {kid!r}: RSA key below {MIN_RSA_BITS} bits")
        if not isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey, ed25519.Ed25519PublicKey)):
            raise MalformedEvidence(f"JWK {kid!r}: unsupported key {type(key).__name__}")
        return cls(kid, alg, key)


class Jwks:
    """A pinned JSON Web Key Set (read from configuration or a file: never fetched), by ``kid``."""

    def __init__(self, keys: Sequence[Jwk]):
        self.keys = list(keys)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Jwks":
        if not isinstance(d, Mapping) or not isinstance(d.get("keys"), list):
            raise MalformedEvidence("JWKS has no 'keys' list")
        return cls([Jwk.from_dict(k) for k in d["keys"]])

    @classmethod
    def from_json(cls, data: bytes | str) -> "Jwks":
        return cls.from_dict(load_json(data, "JWKS"))

    @classmethod
    def from_file(cls, path: str | Path) -> "Jwks":
        return cls.from_json(Path(path).read_bytes())

    def find(self, kid: Any, alg: str) -> Jwk:
        """The key for ``kid`` that may verify ``alg``: UnknownSigningKey when no key has that kid,
        WrongKeyType when the kid's key is of another type (an RSA key offered for ES384)."""
        if kid is None:
            if len(self.keys) != 1:  # single-key sets commonly omit kid
                raise UnknownSigningKey("token has no 'kid' and the JWKS holds several keys")
            cands = self.keys
        else:
            cands = [k for k in self.keys if k.kid == kid]
            if not cands:
                raise UnknownSigningKey(f"kid {str(kid)[:80]!r} is not in the pinned JWKS")
        for k in cands:
            if (k.alg is None or k.alg == alg) and _key_fits(k.key, alg):
                return k
        raise WrongKeyType(f"the pinned key {str(kid)[:80]!r} is not a key for {alg} "
                           f"({type(cands[0].key).__name__}, alg {cands[0].alg!r})")


def load_pem_roots(path: str | Path) -> list[x509.Certificate]:
    """Pinned root certificates from a PEM file; ValueError when it holds none."""
    roots = x509.load_pem_x509_certificates(Path(path).read_bytes())
    if not roots:
        raise ValueError(f"{path} holds no PEM certificate")
    return roots


def x5c_key(chain: Any, roots: Sequence[x509.Certificate], now: dt.datetime) -> Any:
    """The leaf key of a header ``x5c`` chain (standard base64 DER, leaf first) that validates to one
    of ``roots`` at ``now``; the token's own chain never supplies the trust anchor."""
    if not isinstance(chain, list) or not chain or len(chain) > 8 or not all(isinstance(c, str) for c in chain):
        raise MalformedEvidence("x5c is not a list of 1-8 base64 certificates")
    try:
        certs = [x509.load_der_x509_certificate(base64.b64decode(c, validate=True)) for c in chain]
    except ValueError as exc:
        raise MalformedEvidence(f"x5c holds a certificate that does not parse: {exc}"[:300]) from None
    if not roots:
        raise UntrustedRoot("token carries x5c but no roots are pinned for it (x5c_roots_path)")
    builder = (PolicyBuilder().store(Store(list(roots))).time(now.astimezone(dt.timezone.utc).replace(tzinfo=None))
               .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(),
                                   ee_policy=ExtensionPolicy.permit_all()))
    try:
        builder.build_client_verifier().verify(certs[0], certs[1:])
    except VerificationError as exc:
        text = str(exc)
        if "candidates exhausted" in text or "issuer" in text.lower():
            raise UntrustedRoot(f"x5c does not chain to a pinned root: {text}"[:300]) from None
        raise BadCertificateChain(f"x5c chain does not validate: {text}"[:300]) from None
    except ValueError as exc:
        raise BadCertificateChain(f"x5c chain does not validate: {exc}"[:300]) from None
    return certs[0].public_key()


def _part(text: str, what: str) -> dict[str, Any]:
    try:
        raw = unb64url(text)
    except ValueError:  # a second spelling of the same bytes (unused bits set): never accepted
        raise MalformedEvidence(f"the JWS {what} is not canonical base64url") from None
    obj = load_json(raw, f"JWS {what}")
    if not isinstance(obj, dict):
        raise MalformedEvidence(f"JWS {what} is not a JSON object")
    return obj


def verify_jws(token: Any, jwks: Jwks | None, algorithms: Collection[str], *, understood_crit: Collection[str] = (),
               x5c_roots: Sequence[x509.Certificate] = (), now: dt.datetime | None = None,
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check a compact JWS; return (protected header, claims). Raises an AttestationError on any doubt.

    The key: from ``x5c`` (validated to ``x5c_roots``) when the header carries one and roots are
    pinned, otherwise the pinned ``jwks`` entry for ``kid``."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise MalformedEvidence("not a compact JWS (a string of at most 256 KiB)")
    parts = token.split(".")
    if len(parts) == 5:
        raise UnsupportedAlgorithm("a JWE (encrypted token) is not an attestation result; JWE is never accepted")
    if len(parts) != 3 or not all(is_b64url(p) for p in parts):
        raise MalformedEvidence("not a compact JWS (three unpadded base64url parts)")
    header = _part(parts[0], "header")
    try:
        unb64url(parts[2])  # canonical: no second spelling of the same signature (unused bits set)
    except ValueError:
        raise MalformedEvidence("the JWS signature is not canonical base64url") from None
    alg = header.get("alg")
    if not isinstance(alg, str) or alg not in SUPPORTED_ALGS or alg not in algorithms:
        raise UnsupportedAlgorithm(f"alg {str(alg)[:40]!r} is not in this verifier's list {list(algorithms)}")
    crit = header.get("crit")
    if crit is not None:
        if not isinstance(crit, list) or not crit or not all(isinstance(c, str) for c in crit):
            raise MalformedEvidence("crit is not a non-empty list of header names")
        unknown = [c for c in crit if c not in understood_crit]
        if unknown:
            raise UnsupportedCriticalHeader(f"crit names header(s) this verifier does not understand: {unknown[:5]}")
        if any(c not in header for c in crit):
            raise MalformedEvidence("crit names a header that is absent")
    if "b64" in header:  # RFC 7797 unencoded payloads change what is signed: no attestation service uses them
        raise UnsupportedCriticalHeader("the b64 header (RFC 7797) is not accepted")
    if "x5c" in header and x5c_roots:
        key = x5c_key(header["x5c"], x5c_roots, now or utcnow())
        if not _key_fits(key, alg):
            raise WrongKeyType(f"the x5c leaf key ({type(key).__name__}) is not a key for {alg}")
    elif jwks is None:
        raise UnknownSigningKey("no pinned JWKS for a token without x5c")
    else:
        key = jwks.find(header.get("kid"), alg).key
    registry = _Registry(algorithms=[alg], strict_check_header=False,
                         header_registry={c: HeaderParameter(c, lambda v: None) for c in understood_crit})
    try:
        with warnings.catch_warnings():  # joserfc flags "EdDSA" as deprecated by RFC 9864; issuers still send it
            warnings.simplefilter("ignore", SecurityWarning)
            jrfc_jws.deserialize_compact(token, _joserfc_key(key), registry=registry)
    except BadSignatureError:
        raise BadSignature(f"{alg} signature does not verify with kid {str(header.get('kid'))[:80]!r}") from None
    except UnsupportedAlgorithmError as exc:
        raise UnsupportedAlgorithm(str(exc)[:200]) from None
    except (JoseError, ValueError, TypeError, UnicodeError, OverflowError) as exc:
        raise MalformedEvidence(f"JWS rejected: {type(exc).__name__}: {exc}"[:300]) from None
    return header, _part(parts[1], "payload")


def sign_jws(claims: Mapping[str, Any], key: Any, alg: str, kid: str | None = None,
             header: Mapping[str, Any] | None = None) -> str:
    """Mint a compact JWS (test issuers and software attesters)."""
    if alg not in SUPPORTED_ALGS:
        raise UnsupportedAlgorithm(alg)
    protected: dict[str, Any] = {"alg": alg, "typ": "JWT"}
    if kid is not None:
        protected["kid"] = kid
    protected.update(header or {})
    payload = json.dumps(dict(claims), separators=(",", ":"), default=str).encode()
    registry = _Registry(algorithms=[alg], strict_check_header=False,
                         header_registry={h: HeaderParameter(h, lambda v: None) for h in protected})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SecurityWarning)
        return jrfc_jws.serialize_compact(protected, payload, _joserfc_key(key), registry=registry)


def public_jwk(key: Any, kid: str, alg: str) -> dict[str, Any]:
    """The JWK (public part) of a cryptography key."""
    pub = key.public_key() if hasattr(key, "public_key") else key
    return {**_joserfc_key(pub).as_dict(private=False), "kid": kid, "alg": alg, "use": "sig"}


__all__ = ["Jwk", "Jwks", "SUPPORTED_ALGS", "b64url", "check_algorithms", "load_pem_roots", "public_jwk",
           "sign_jws", "verify_jws", "x5c_key"]
