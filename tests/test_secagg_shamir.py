"""Shamir sharing over GF(2^256 + 297): correctness, secrecy of t - 1 shares, encoding."""

from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.secagg import shamir
from crypto.secagg.errors import MalformedMessageError, SecAggAbort


def _is_probable_prime(n: int, rounds: int = 40) -> bool:
    if n % 2 == 0:
        return n == 2
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    rnd = random.Random(1234)
    for _ in range(rounds):
        x = pow(rnd.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def test_field_is_the_smallest_prime_above_2_256() -> None:
    assert _is_probable_prime(shamir.PRIME)
    assert not any(_is_probable_prime((1 << 256) + k) for k in range(1, 297, 2))


secret_bytes = st.binary(min_size=32, max_size=32)
ids = st.lists(st.integers(0, (1 << 64) - 1), min_size=2, max_size=9, unique=True)


@settings(max_examples=60, deadline=None)
@given(secret=secret_bytes, holders=ids, data=st.data())
def test_any_t_shares_rebuild_the_secret(secret: bytes, holders: list[int], data: st.DataObject) -> None:
    t = data.draw(st.integers(1, len(holders)))
    shares = shamir.split_secret(secret, t, holders)
    subset = data.draw(st.lists(st.sampled_from(holders), min_size=t, max_size=len(holders), unique=True))
    assert shamir.combine_secret([shares[h] for h in subset], t) == secret


@settings(max_examples=40, deadline=None)
@given(secret=secret_bytes, other=secret_bytes, holders=ids, data=st.data())
def test_t_minus_1_shares_fit_every_secret(secret: bytes, other: bytes, holders: list[int], data: st.DataObject) -> None:
    """For any candidate secret there is a degree t-1 polynomial through it and the t-1 shares."""
    t = data.draw(st.integers(2, len(holders)))
    shares = [shamir.Share.from_bytes(b) for b in shamir.split_secret(secret, t, holders).values()][: t - 1]
    candidate = shamir.Share(0, int.from_bytes(other, "big"))
    pts = shares + [candidate]  # t points: a unique polynomial of degree <= t - 1
    for s in shares:
        assert shamir.interpolate(pts, s.x) == s.y
    assert shamir.interpolate(pts, 0) == candidate.y


def test_t_minus_1_shares_are_independent_of_the_secret_exhaustively(monkeypatch: pytest.MonkeyPatch) -> None:
    """GF(13), 2-of-3: over all random coefficients the library's split could draw, a single
    share takes every value exactly once, whatever the secret: it says nothing about it."""
    p, xs = 13, [1, 2, 3]
    for secret in range(p):
        for holder in range(len(xs)):
            counts = [0] * p
            for a in range(p):
                monkeypatch.setattr(shamir.secrets, "randbelow", lambda bound, a=a: a)
                counts[shamir.split_int(secret, 2, xs, prime=p)[holder].y] += 1
            assert counts == [1] * p


@settings(max_examples=50, deadline=None)
@given(secret=st.integers(0, shamir.PRIME - 1), x=st.integers(1, (1 << 64)), t=st.integers(1, 5))
def test_share_bytes_round_trip(secret: int, x: int, t: int) -> None:
    xs = [x + i for i in range(t)]
    for s in shamir.split_int(secret, t, xs):
        assert shamir.Share.from_bytes(s.to_bytes()) == s
    assert shamir.combine_int(shamir.split_int(secret, t, xs), t) == secret


def test_too_few_shares_abort() -> None:
    shares = shamir.split_secret(os.urandom(32), 3, [1, 2, 3, 4])
    with pytest.raises(SecAggAbort, match="cannot rebuild"):
        shamir.combine_secret([shares[1], shares[2]], 3)


def test_bad_share_bytes_rejected() -> None:
    with pytest.raises(MalformedMessageError):
        shamir.Share.from_bytes(b"\x00" * 10)
    with pytest.raises(MalformedMessageError):
        shamir.Share.from_bytes(b"\x00" * shamir.SHARE_BYTES)  # x = 0 holds the secret itself
    s = shamir.split_secret(os.urandom(32), 2, [5, 6])
    with pytest.raises(MalformedMessageError):
        shamir.combine_secret([s[5], s[5]], 2)


def test_fewer_shares_than_threshold_differ_from_secret_in_general() -> None:
    secret = os.urandom(32)
    shares = shamir.split_secret(secret, 3, [1, 2, 3])
    pairs = list(itertools.combinations(shares.values(), 2))
    # interpolating only 2 of 3 points gives a wrong value (with overwhelming probability)
    assert all(shamir.combine_int([shamir.Share.from_bytes(b) for b in pr], 2) != int.from_bytes(secret, "big") for pr in pairs)
