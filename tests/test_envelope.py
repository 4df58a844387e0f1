"""Update envelopes: sign, seal, open; every rejection has its own class and reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.envelope import (
    BadSignature, DecryptionFailed, DigestMismatch, Envelope, EnvelopeHeader, MalformedEnvelope, NotSealed,
    ReplayedNonce, ReplayedRound, ReplayGuard, RevokedSite, UnknownSite, WrongFederation, WrongRecipient, WrongRound,
    WrongRun, make_envelope, open_envelope, tree_digest,
)
from crypto.pki import PartyRecord, TrustStore

CHUNK = 4096
SITE_KEY = ed25519.Ed25519PrivateKey.generate()
COORD_KEY = x25519.X25519PrivateKey.generate()


def trust() -> TrustStore:
    return TrustStore("fed-1", {"site-a": PartyRecord("site-a", "site", SITE_KEY.public_key(), cert_serial=7)})


def make(payload, seal: bool = True, **kw):  # type: ignore[no-untyped-def]
    args = dict(signing_key=SITE_KEY, federation_id="fed-1", run_id=3, round=5, site="site-a", chunk_size=CHUNK,
                seal_to=COORD_KEY.public_key() if seal else None)
    args.update(kw)
    return make_envelope(payload, **args)


def open_(env: Envelope, **kw):  # type: ignore[no-untyped-def]
    args = dict(trust=trust(), federation_id="fed-1", run_id=3, round=5, recipient_key=COORD_KEY)
    args.update(kw)
    return open_envelope(env, **args)


@pytest.mark.parametrize("seal", [True, False])
@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 17])
def test_roundtrip(n: int, seal: bool) -> None:
    x = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    env = make(x, seal=seal)
    assert env.parsed().sealed is seal and len(np.asarray(env.body)) == env.parsed().body_len
    if seal and n >= 64:
        assert not np.array_equal(np.asarray(env.body)[:64], x[:64])
    opened = open_(Envelope.from_bytes(env.to_bytes()), replay=ReplayGuard())
    assert np.array_equal(opened.payload, x)


def test_float_array_zero_copy_and_meta() -> None:
    w = np.arange(10_000, dtype=np.float32)
    env = make(w, seal=False, meta=b'{"dtype":"float32"}', digest_alg="blake2b")
    assert np.shares_memory(env.body, w)  # unsealed body is a view, not a copy
    opened = open_(env)
    assert opened.header.meta == b'{"dtype":"float32"}'
    assert np.array_equal(opened.payload.view(np.float32), w)


def test_parallel_digest_matches_serial() -> None:
    x = np.random.default_rng(1).integers(0, 256, 10 * CHUNK + 5, dtype=np.uint8)
    assert tree_digest(x, chunk_size=CHUNK, workers=1) == tree_digest(x, chunk_size=CHUNK, workers=4)
    assert tree_digest(x, chunk_size=CHUNK) != tree_digest(x[:-1], chunk_size=CHUNK)


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=3 * CHUNK), st.integers(0, 2**32), st.text(max_size=12))
def test_roundtrip_property(data: bytes, rnd: int, meta: str) -> None:
    env = make(data, round=rnd, meta=meta.encode())
    assert EnvelopeHeader.decode(env.header).encode() == env.header
    assert bytes(open_(env, round=rnd).payload) == data


# -- rejections --------------------------------------------------------------------------------


def test_bad_signature() -> None:
    env = make(b"x" * 100)
    other = ed25519.Ed25519PrivateKey.generate().sign(env.header)
    with pytest.raises(BadSignature) as exc:
        open_(dataclasses.replace(env, signature=other))
    assert exc.value.reason == "bad_signature"


def test_tampered_header_field_breaks_signature() -> None:
    env = make(b"x" * 100)
    h = dataclasses.replace(env.parsed(), round=5, meta=b"injected")
    with pytest.raises(BadSignature):
        open_(dataclasses.replace(env, header=h.encode()))


def test_unknown_and_revoked_site() -> None:
    env = make(b"x" * 100, site="site-z")
    with pytest.raises(UnknownSite) as exc:
        open_(env)
    assert exc.value.reason == "unknown_site"
    t = trust()
    t.revoked_serials = frozenset({7})
    with pytest.raises(RevokedSite) as exc2:
        open_(make(b"x" * 100), trust=t)
    assert exc2.value.reason == "revoked_site"


def test_replayed_round_and_nonce() -> None:
    guard, env = ReplayGuard(), make(b"x" * 100)
    open_(env, replay=guard)
    with pytest.raises(ReplayedRound) as exc:
        open_(env, replay=guard)
    assert exc.value.reason == "replayed_round"
    # Same nonce under another (round, channel) slot: caught by the nonce table.
    env2 = make(b"y" * 100, round=6)
    open_(env2, replay=guard, round=6)
    h = dataclasses.replace(make(b"z", round=7, seal=False).parsed(), nonce=env2.parsed().nonce)
    forged = Envelope(h.encode(), SITE_KEY.sign(h.encode()), b"z")
    with pytest.raises(ReplayedNonce):
        open_(forged, replay=guard, round=7, recipient_key=None)


def test_corrupt_copy_does_not_burn_the_slot() -> None:
    guard, env = ReplayGuard(), make(b"x" * 10_000)
    body = np.array(env.body, copy=True)
    body[5] ^= 1
    with pytest.raises(DecryptionFailed):
        open_(dataclasses.replace(env, body=body), replay=guard)
    open_(env, replay=guard)  # the genuine one still gets in


def test_wrong_federation_run_round() -> None:
    env = make(b"x")
    with pytest.raises(WrongFederation):
        open_(env, federation_id="fed-2")
    with pytest.raises(WrongRun):
        open_(env, run_id=4)
    with pytest.raises(WrongRound):
        open_(env, round=6)


def test_truncation_reorder_and_unsealed_tamper() -> None:
    x = np.random.default_rng(2).integers(0, 256, 3 * CHUNK, dtype=np.uint8)
    env = make(x)
    body = np.asarray(env.body)
    with pytest.raises(MalformedEnvelope):
        open_(dataclasses.replace(env, body=body[: -(CHUNK + 16)]))
    step = CHUNK + 16
    swapped = np.concatenate([body[step:2 * step], body[:step], body[2 * step:]])
    with pytest.raises(DecryptionFailed):
        open_(dataclasses.replace(env, body=swapped))
    plain = make(x, seal=False)
    y = x.copy()
    y[0] ^= 1
    with pytest.raises(DigestMismatch):
        open_(dataclasses.replace(plain, body=y))


def test_seal_policy_and_recipient() -> None:
    with pytest.raises(NotSealed):
        open_(make(b"x", seal=False), require_sealed=True)
    with pytest.raises(WrongRecipient):
        open_(make(b"x"), recipient_key=x25519.X25519PrivateKey.generate())


def test_hostile_header_bytes() -> None:
    env = make(b"x")
    for junk in [b"", b"garbage", env.header[:-1], env.header + b"\x00", b"SOVFL-ENVELOPE\x00\x01" + b"\xff" * 8]:
        with pytest.raises(MalformedEnvelope):
            open_(dataclasses.replace(env, header=junk))
