"""Key generation and on-disk key files.

Private keys are created with ``os.open(O_CREAT | O_EXCL, 0o600)``: the file never exists with
wider permissions (no chmod afterwards) and an existing key is never overwritten by accident.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, x25519

from crypto.durable import write_atomic

from .errors import PkiMaterialError

PEM = serialization.Encoding.PEM
RAW = serialization.Encoding.Raw
PKCS8 = serialization.PrivateFormat.PKCS8
SPKI = serialization.PublicFormat.SubjectPublicKeyInfo
NO_PASSWORD = serialization.NoEncryption()


class KeyFileExists(FileExistsError):
    """A key file is already there; rotation must be asked for explicitly."""


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 and write ``data``; fail if it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError as exc:
        raise KeyFileExists(f"refusing to overwrite private key {path}") from exc
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_public(path: Path, data: bytes) -> None:
    """Atomically write a non-secret file (certificate, public key, manifest)."""
    write_atomic(path, data, 0o644)


def write_json(path: Path, obj: Any) -> None:
    write_public(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes, the input to signatures over manifests."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# -- generation -------------------------------------------------------------------------------


def new_tls_key() -> ec.EllipticCurvePrivateKey:
    """ECDSA P-256: accepted by OpenSSL (Python ssl, uvicorn) and BoringSSL (grpc)."""
    return ec.generate_private_key(ec.SECP256R1())


def new_supernode_auth_key() -> ec.EllipticCurvePrivateKey:
    """Flower node-auth key: an EC key on a NIST curve (P-384, as Flower's docs generate)."""
    return ec.generate_private_key(ec.SECP384R1())


def new_signing_key() -> ed25519.Ed25519PrivateKey:
    return ed25519.Ed25519PrivateKey.generate()


def new_sealing_key() -> x25519.X25519PrivateKey:
    return x25519.X25519PrivateKey.generate()


def new_channel_key() -> x25519.X25519PrivateKey:
    """A site's long-term SecAgg+ channel key (X25519): seals the Shamir shares it sends its neighbours."""
    return x25519.X25519PrivateKey.generate()


# -- encodings ---------------------------------------------------------------------------------


def private_pem(key: Any) -> bytes:
    return key.private_bytes(PEM, PKCS8, NO_PASSWORD)


def public_pem(key: Any) -> bytes:
    return key.public_bytes(PEM, SPKI)


def openssh_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    """OpenSSH private key: what ``flower-supernode --auth-supernode-private-key`` loads
    (``load_ssh_private_key`` in flwr/supernode/cli/flower_supernode.py)."""
    return key.private_bytes(PEM, serialization.PrivateFormat.OpenSSH, NO_PASSWORD)


def openssh_public(key: Any, comment: str = "") -> bytes:
    """OpenSSH one-line public key: what ``flwr supernode register`` loads."""
    line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return line + (b" " + comment.encode() if comment else b"") + b"\n"


def raw_public(key: ed25519.Ed25519PublicKey | x25519.X25519PublicKey) -> bytes:
    return key.public_bytes(RAW, serialization.PublicFormat.Raw)


def fingerprint(data: bytes) -> str:
    """``sha256:<hex>`` of DER/raw bytes, the form used in manifests."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def public_key_fingerprint(key: Any) -> str:
    if isinstance(key, (ed25519.Ed25519PublicKey, x25519.X25519PublicKey)):
        return fingerprint(raw_public(key))
    return fingerprint(key.public_bytes(serialization.Encoding.DER, SPKI))


def cert_fingerprint(cert: x509.Certificate) -> str:
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


# -- loading -----------------------------------------------------------------------------------


def load_private(path: Path | str) -> Any:
    data = Path(path).read_bytes()
    if b"OPENSSH PRIVATE KEY" in data:
        return serialization.load_ssh_private_key(data, None)
    return serialization.load_pem_private_key(data, None)


def load_public(path: Path | str) -> Any:
    data = Path(path).read_bytes()
    if data.startswith((b"ssh-", b"ecdsa-")):
        return serialization.load_ssh_public_key(data)
    return serialization.load_pem_public_key(data)


def load_cert(path: Path | str) -> x509.Certificate:
    return parse_cert(Path(path).read_bytes(), str(path))


def parse_cert(data: bytes, what: str = "certificate") -> x509.Certificate:
    """A PEM certificate, or PkiMaterialError("malformed_certificate") (a ValueError, as before)."""
    try:
        return x509.load_pem_x509_certificate(bytes(data))
    except (ValueError, TypeError, x509.InvalidVersion) as exc:  # InvalidVersion is no ValueError
        raise PkiMaterialError("malformed_certificate", f"{what} is not a PEM X.509 certificate ({exc})") from None
