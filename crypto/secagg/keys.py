"""X25519 key pairs and the HKDF-SHA256 derivations of every symmetric key of a round.

Each client makes two fresh key pairs per round (Bonawitz et al. 2017): `c` for the channel that
carries encrypted shares, `s` for pairwise masks. Only the `s` private key is secret-shared; a
separate `c` key means revealing `s` of a dropped client never opens its share traffic. Every
derivation is salted with the round context digest and labelled with its purpose and the ordered
pair of ids, so no key is ever reused across purposes, pairs, rounds or runs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .context import RoundContext
from .errors import MalformedMessageError

KEY_BYTES = 32  # AEAD keys: AES-256-GCM
MASK_KEY_BYTES = 16  # mask PRG keys: AES-128-CTR (128-bit security, like X25519; ~15% faster)
_RAW = serialization.Encoding.Raw


@dataclass(frozen=True)
class KeyPair:
    """A raw 32-byte X25519 private/public pair."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        sk = X25519PrivateKey.generate()
        return cls(
            sk.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption()),
            sk.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw),
        )


def public_from_private(private: bytes) -> bytes:
    """The public key of a raw private key (checks a rebuilt `s` key against its advert)."""
    sk = X25519PrivateKey.from_private_bytes(private)
    return sk.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)


def agree(private: bytes, peer_public: bytes) -> bytes:
    """X25519 shared secret; rejects malformed or low-order public keys."""
    try:
        return X25519PrivateKey.from_private_bytes(private).exchange(
            X25519PublicKey.from_public_bytes(peer_public)
        )
    except ValueError as exc:  # wrong length or all-zero shared secret (low-order point)
        raise MalformedMessageError(f"unusable X25519 public key: {exc}") from None


def hkdf(ikm: bytes, ctx: RoundContext, purpose: bytes, *ids: int, length: int = KEY_BYTES) -> bytes:
    """Key = HKDF-SHA256(ikm, salt=ctx digest, info=purpose || ids), `length` bytes."""
    info = purpose + b"".join(struct.pack(">Q", i) for i in ids)
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=ctx.digest(), info=info).derive(ikm)


def pairwise_mask_key(s_private: bytes, peer_s_public: bytes, ctx: RoundContext, a: int, b: int) -> bytes:
    """AES key of the pairwise mask between clients a and b (the same from either side)."""
    lo, hi = sorted((a, b))
    return hkdf(agree(s_private, peer_s_public), ctx, b"pairwise-mask", lo, hi, length=MASK_KEY_BYTES)


def share_channel_key(c_private: bytes, peer_c_public: bytes, ctx: RoundContext, a: int, b: int) -> bytes:
    """AEAD key for the shares exchanged between clients a and b."""
    lo, hi = sorted((a, b))
    return hkdf(agree(c_private, peer_c_public), ctx, b"share-channel", lo, hi)


def self_mask_key(seed: bytes, ctx: RoundContext, client_id: int) -> bytes:
    """AES key of a client's self mask, from its secret-shared 32-byte seed."""
    return hkdf(seed, ctx, b"self-mask", client_id, length=MASK_KEY_BYTES)
