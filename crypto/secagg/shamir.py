"""Shamir t-of-n secret sharing over the prime field GF(2^256 + 297).

The secrets we share are 32-byte strings (the self-mask seed and an X25519 private key), so the
field must hold every 256-bit integer: 2^256 + 297 is the smallest prime above 2^256 (checked by
tests/test_secagg_shamir.py). Share x-coordinates are the holders' client ids + 1, so no index
table has to travel and x is never 0 (the point that holds the secret).

Why it is secure: a random polynomial f of degree t-1 with f(0) = secret; any t-1 points leave
f(0) uniformly distributed (for every candidate secret exactly one polynomial fits), while any t
points fix f by Lagrange interpolation.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import MalformedMessageError, SecAggAbort

PRIME = (1 << 256) + 297
SECRET_BYTES = 32
_X_BYTES = 9  # holder id + 1 for 64-bit ids
_Y_BYTES = 33  # field elements are < 2^257
SHARE_BYTES = _X_BYTES + _Y_BYTES


@dataclass(frozen=True)
class Share:
    """One point (x, f(x)) of a sharing polynomial."""

    x: int
    y: int

    def to_bytes(self) -> bytes:
        return self.x.to_bytes(_X_BYTES, "big") + self.y.to_bytes(_Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes, prime: int = PRIME) -> Share:
        if len(data) != SHARE_BYTES:
            raise MalformedMessageError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
        x = int.from_bytes(data[:_X_BYTES], "big")
        y = int.from_bytes(data[_X_BYTES:], "big")
        if not 0 < x < prime or y >= prime:
            raise MalformedMessageError("share coordinates outside the field")
        return cls(x, y)


def x_for(client_id: int) -> int:
    """The x-coordinate of the share held by `client_id` (never 0)."""
    return client_id + 1


def split_int(secret: int, threshold: int, xs: Sequence[int], prime: int = PRIME) -> list[Share]:
    """Share `secret` so that any `threshold` of the points at `xs` rebuild it."""
    if not 0 <= secret < prime:
        raise ValueError("secret outside the field")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} not in [1, {len(xs)}]")
    if len(set(x % prime for x in xs)) != len(xs) or any(x % prime == 0 for x in xs):
        raise ValueError("share x-coordinates must be distinct and non-zero in the field")
    coeffs = [secret] + [secrets.randbelow(prime) for _ in range(threshold - 1)]
    return [Share(x, _eval(coeffs, x, prime)) for x in xs]


def combine_int(shares: Iterable[Share], threshold: int, prime: int = PRIME) -> int:
    """Rebuild f(0) from the first `threshold` shares (Lagrange interpolation at 0)."""
    pts = list(shares)[:threshold]
    if len(pts) < threshold:
        raise SecAggAbort(f"{len(pts)} shares cannot rebuild a {threshold}-of-n secret")
    if len({s.x for s in pts}) != len(pts):
        raise MalformedMessageError("two shares with the same x-coordinate")
    return interpolate(pts, 0, prime)


def interpolate(points: Sequence[Share], at: int, prime: int = PRIME) -> int:
    """Value at `at` of the unique polynomial of degree < len(points) through `points`."""
    total = 0
    for i, pi in enumerate(points):
        num, den = 1, 1
        for j, pj in enumerate(points):
            if i != j:
                num = num * (at - pj.x) % prime
                den = den * (pi.x - pj.x) % prime
        total = (total + pi.y * num * pow(den, -1, prime)) % prime
    return total


def split_secret(secret: bytes, threshold: int, holder_ids: Sequence[int]) -> dict[int, bytes]:
    """Share a 32-byte secret among `holder_ids`; returns holder id -> encoded share."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secrets are {SECRET_BYTES} bytes")
    shares = split_int(int.from_bytes(secret, "big"), threshold, [x_for(h) for h in holder_ids])
    return {h: s.to_bytes() for h, s in zip(holder_ids, shares, strict=True)}


def combine_secret(shares: Iterable[bytes], threshold: int) -> bytes:
    """Rebuild a 32-byte secret from at least `threshold` encoded shares."""
    value = combine_int([Share.from_bytes(s) for s in shares], threshold)
    if value >= 1 << (8 * SECRET_BYTES):
        raise MalformedMessageError("shares rebuild a value that is not a 32-byte secret")
    return value.to_bytes(SECRET_BYTES, "big")


def _eval(coeffs: Sequence[int], x: int, prime: int) -> int:
    acc = 0
    for c in reversed(coeffs):
        acc = (acc * x + c) % prime
    return acc
